"""`doctor --model CONFIG --lab LAB` as a user meets it: a user's own LightningCLI script is rehearsed (`--script`),
`--json` puts the report alone on stdout, a model that cannot run ends the command non-zero with its own error first
and before Lightning's baselines, and bad flags are refused naming the flag before any rank starts."""

import json
import os

import pytest

from lightning_hetero.rehearse.job import RankResult
from tests.rehearse._doctor import run_doctor
from tests.rehearse._user_script import MODEL_ERROR

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
SCRIPT = os.path.join(ROOT, "tests", "rehearse", "_user_script.py")
LAB = "A100-80GB,RTX3090"
# A config of the script above: the model's arguments without a class path, our strategy with a capacity mapping.
CONFIG = """model: {{batch_size: 8, n: 200, fail: {fail}}}
trainer:
  strategy:
    class_path: lightning_hetero.HeteroDDPStrategy
    init_args: {{capacities: {{A100: 3, "3090": 1}}}}
"""


def _config(tmp_path, fail: bool = False) -> str:
    path = tmp_path / ("fails.yaml" if fail else "job.yaml")
    path.write_text(CONFIG.format(fail=str(fail).lower()))
    return str(path)


@pytest.mark.parametrize(("args", "message"), [
    (["--lab", ""], "`--lab`='' must name at least two cards"),
    (["--lab", "A100-80GB,GTX9999"], "`--lab[1]`='GTX9999' is not a preset; known presets: ['A10', 'A100-40GB', "),
    (["--lab", LAB, "--steps", "0"], "`--steps`=0 must be an integer >= 4"),
    (["--lab", LAB, "--steps", "-3"], "`--steps`=-3 must be an integer >= 4"),
    (["--steps", "0"], "`--steps`=0 must be an integer >= 2"),  # the dry run, without --lab
])
def test_a_bad_flag_is_refused_naming_it(tmp_path, capsys, args, message):
    code, out, err = run_doctor(["--model", _config(tmp_path), "--out", str(tmp_path / "out"), *args], capsys)
    assert code == 2 and f"lightning-hetero doctor: error: {message}" in err, (code, err)
    assert not (tmp_path / "out" / "rehearsal.log").exists()  # refused before any rank started


def test_identical_cards_that_step_far_apart_are_warned_about():
    from lightning_hetero.rehearse.notes import uneven_twins

    def rank(r, card, step, batch=2):
        return RankResult("hetero", r, card, ok=True, batch=batch, plan="replica",
                          step_seconds=[1.0, 1.0] + [step] * 4)

    # Two RTX 3090 ranks measured 547 vs 3734 ms on a loaded CPU: named with their times and the likely cause.
    warned = uneven_twins([rank(0, "A100-80GB", 0.300, batch=10), rank(1, "RTX3090", 0.547),
                           rank(2, "RTX3090", 3.734)])
    assert len(warned) == 1 and warned[0].startswith("ranks 1 and 2 are the same card (RTX3090, batch 2)")
    assert "547.0 ms" in warned[0] and "3734.0 ms" in warned[0] and "(6.8x)" in warned[0] and "loaded" in warned[0]
    # Within 1.5x, or different batches of one card (a different amount of work), say nothing.
    assert uneven_twins([rank(1, "RTX3090", 0.500), rank(2, "RTX3090", 0.700)]) == []
    assert uneven_twins([rank(1, "RTX3090", 0.500), rank(2, "RTX3090", 2.0, batch=8)]) == []


def test_a_rank_that_exits_says_its_error_in_one_line():
    from lightning_hetero.rehearse.command import failure
    from lightning_hetero.rehearse.launch import exit_error

    wall = ("usage: rank.py [-h] ...\n               [--model CONFIG]\ntip: For details run: rank.py --help\n"
            "error: Parser key \"model\":\n  Does not validate against any of the Union subtypes\n"
            "  Subtypes: [<class 'LightningModule'>, <class 'NoneType'>]\n  Errors:\n"
            "    - Problem with given class_path 'lightning.LightningModule':\n"
            "        Option 'batch_size' is not accepted\n    - Expected a <class 'NoneType'>\n"
            "  Given value type: <class 'dict'>\n  Given value: {'batch_size': 8}\n")
    said = exit_error(wall)
    assert said == ("Parser key \"model\": Problem with given class_path 'lightning.LightningModule': Option "
                    "'batch_size' is not accepted")
    assert exit_error("Traceback ...\nSegmentation fault\n") is None
    # A union none of whose types takes the value: what it takes and what it got (it said "Parser key ...:" alone).
    nested = ("error: Parser key \"trainer.strategy\":\n  Does not validate against any of the Union subtypes\n"
              "  Subtypes: [<class 'str'>, <class 'Strategy'>]\n  Errors:\n    - Expected a <class 'str'>\n"
              "    - Problem with given class_path 'x.HeteroHybridStrategy':\n        Parser key \"pipelines\":\n"
              "          Does not validate against any of the Union subtypes\n"
              "          Subtypes: [list[list[int]], typing.Literal['auto'], <class 'NoneType'>]\n          Errors:\n"
              "            - Expected a <class 'list'>\n            - Expected a typing.Literal['auto']\n"
              "          Given value type: <class 'int'>\n          Given value: 3\n"
              "  Given value type: <class 'dict'>\n  Given value: {'class_path': 'x'}\n")
    assert exit_error(nested) == ("Parser key \"trainer.strategy\": Problem with given class_path "
                                  "'x.HeteroHybridStrategy': Parser key \"pipelines\": expected one of "
                                  "[list[list[int]], typing.Literal['auto'], <class 'NoneType'>], given 3")
    # Without --script, a config that names no class path is pointed at --script.
    ranks = [dict(RankResult("hetero", 0, "A100-80GB", error=said).__dict__)]
    assert failure(ranks, "out/rehearsal.log", None).startswith("Parser key \"model\"")
    assert "give `--script SCRIPT`" in failure(ranks, "out/rehearsal.log", None)
    assert "--script" not in failure(ranks, "out/rehearsal.log", "train.py")
    # A config's own class path refusing an argument (a strategy's option of the wrong type) is not pointed at --script.
    wrong_type = ("Parser key \"trainer.strategy\": Problem with given class_path "
                  "'lightning_hetero.HeteroHybridStrategy': Parser key \"pipelines\": (the rank's process exited with "
                  "code 2)")
    said = failure([dict(RankResult("shared", 0, "A100-80GB", error=wrong_type).__dict__)], "log", None)
    assert said.startswith(wrong_type) and "--script" not in said
    assert failure([dict(RankResult("hetero", 0, "RTX3090", oom=True, error="CUDA out of memory").__dict__)],
                   "log", None) is None  # out of memory on a card is the rehearsal's answer, not a failure


@pytest.mark.slow
def test_a_users_script_is_rehearsed_and_json_is_all_of_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code, out, err = run_doctor(["--model", _config(tmp_path), "--script", SCRIPT, "--lab", LAB, "--steps", "4",
                              "--out", str(tmp_path / "out"), "--json"], capsys)
    assert code == 0, err[-3000:]
    report = json.loads(out)  # stdout is the report and nothing else
    assert report["failed"] is None and report["script"] == SCRIPT
    assert [(r["rank"], r["ok"], r["batch"]) for r in report["hetero"]] == [(0, True, 12), (1, True, 4)], err
    assert [r["ok"] for r in report["ddp"]] == [True, True]  # Lightning's baseline, through the same script
    assert "rehearsed hetero rank 1 (RTX3090): ok" in err and "Predicted step" in err  # the tables on stderr
    # Every layout compared from the measured ranks, the fast card alone included, with the pick's arguments.
    assert {"ddp:0,1", "fsdp:0,1", "ddp:0"} <= set(report["layouts"]["layouts"]) and report["layouts"]["pick"]
    assert "Every layout, the fastest cards alone included" in err and "devices=" in report["layouts"]["trainer"]
    # Every step timed in its phases, which make up the step; Lightning's DDP buckets noted as they were ready.
    for rank in report["hetero"] + report["ddp"]:
        assert len(rank["phase_seconds"]) == len(rank["step_seconds"]) == 4
        for phases, step in zip(rank["phase_seconds"], rank["step_seconds"]):
            assert min(phases) >= 0 and sum(phases) == pytest.approx(step, rel=1e-6)
        # The same phases on the host clock make up the step too (on CPU the device clock is the host's).
        assert len(rank["host_phase_seconds"]) == 4 and len(rank["step_cpus"]) == 4
        for phases, host, step in zip(rank["phase_seconds"], rank["host_phase_seconds"], rank["step_seconds"]):
            assert min(host) >= 0 and sum(host) == pytest.approx(step, rel=1e-6)
            assert host == pytest.approx(phases, rel=0.05, abs=5e-3)
    for rank in report["ddp"]:
        assert sum(rank["bucket_bytes"]) >= rank["param_bytes"]
        assert len(rank["bucket_ready"]) == len(rank["bucket_bytes"])
        assert rank["bucket_ready"] == sorted(rank["bucket_ready"]) and 0 < rank["bucket_ready"][-1] <= 1


@pytest.mark.slow
def test_a_model_that_cannot_run_fails_loudly_before_the_baselines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code, out, err = run_doctor(["--model", _config(tmp_path, fail=True), "--script", SCRIPT, "--lab", LAB,
                              "--steps", "4", "--out", str(tmp_path / "out")], capsys)
    assert code == 1, (out, err)
    assert f"lightning-hetero doctor: error: ValueError: {MODEL_ERROR} [rehearsed rank 0, A100-80GB" in err
    report = json.loads((tmp_path / "out" / "rehearsal.json").read_text())
    # Rank 0's error stops the rehearsal: no other rank, and none of Lightning's strategies, is started.
    assert len(report["hetero"]) == 1 and report["ddp"] == [] and report["failed"].startswith("ValueError")
    assert "rehearsed ddp" not in out
