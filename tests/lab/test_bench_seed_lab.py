"""benchmarks/bench_seed_lab.py: options checked first, every layout's strategy, the ideal and the ratios, a layout
that fails or is not reached kept as a row, a hung layout's whole process group ended, the CPU dry run's JSON."""

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import bench_seed_lab as seed  # noqa: E402

LAB = seed.DEFAULT_LAB.split(",")


@pytest.mark.parametrize(("argv", "flag"), [
    (["--workloads", "bret"], "--workloads"),
    (["--layouts", "ddp5"], "--layouts"),
    (["--lab", "A100-80GB,RTX3090"], "--lab"),
    (["--lab", "A100-80GB,A100-80GB,RTX3090,RTX3091"], "--lab"),
    (["--slow-batches", "8,x"], "--slow-batches"),
], ids=["workload", "layout", "three cards short", "unknown preset", "slow batches"])
def test_bad_options_stop_before_anything_runs(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit):
        seed.main(argv + ["--accelerator", "cpu", "--tiny", "--out", str(tmp_path)])
    assert flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("layout", "kind", "capacities"), [
    ("pair", "HeteroDDPStrategy", "equal"), ("ddp4", "HeteroDDPStrategy", "profile"),
    ("fsdp4", "HeteroFSDPStrategy", "auto"), ("hybrid4", "HeteroHybridStrategy", "profile")])
def test_our_layouts_get_the_lab_as_given(layout, kind, capacities):
    args = seed.parse_args(["--accelerator", "cpu", "--tiny"])
    strategy = seed.strategy_for(layout, seed.TINY["bert"], LAB, args)
    assert type(strategy).__name__ == kind
    assert strategy.plan.spec.source == capacities
    assert [s.preset for s in strategy.core.lab.emulate] == (LAB[:2] if layout == "pair" else LAB)
    assert {s.workload for s in strategy.core.lab.emulate} == {"bert"}  # each card at its BERT calibration
    if layout == "hybrid4":
        assert strategy.pipelines == [[2, 3]] and strategy.overlap_stage_exchange


@pytest.mark.parametrize(("layout", "base"), [("lightning_ddp4", "DDPStrategy"), ("lightning_fsdp4", "FSDPStrategy")])
def test_lightning_layouts_are_lightnings_own_under_emulation(layout, base):
    args = seed.parse_args(["--accelerator", "cpu", "--tiny"])
    strategy = seed.strategy_for(layout, seed.TINY["gpt124m"], LAB, args)
    assert base in [c.__name__ for c in type(strategy).__mro__]
    assert type(strategy).__name__ == f"Emulated{base}" and strategy.emulator is None  # started at set-up


def test_ideal_is_the_pair_plus_both_slow_cards_at_their_ddp4_batch():
    rows = {"pair": {"samples_per_s": 1900.0}, "ddp4": {"samples_per_s": 2100.0, "split": [64, 64, 16, 16]},
            "lightning_ddp4": {"samples_per_s": 1500.0}, "fsdp4": {"error": "does not fit (out of memory): ..."},
            "solo": {"cards": {"RTX3090": {"rates": {"40": 400.0, "20": 300.0}}}}}
    r = seed.ratios(seed.WORKLOADS["bert"], rows, LAB)
    assert r["ideal"] == 1900.0 + 2 * 300.0  # batch 20 is nearer to the 3090's 16 than 40
    assert "batch 20" in r["ideal_means"] and "ddp4 (16)" in r["ideal_means"]
    assert r["per_layout"]["ddp4"] == {"vs_pair": 1.105, "vs_ideal": 0.84, "ours_vs_lightning": 1.4}
    assert "fsdp4" not in r["per_layout"] and r["fastest"] == "ddp4"
    assert seed.ratios(seed.WORKLOADS["bert"], {"pair": {"samples_per_s": 10.0}}, LAB)["ideal"] is None


def test_a_replica_too_big_for_a_3090_is_reported_without_launching():
    assert "RTX3090's 24 GiB" in seed.unfit_reason("ddp4", seed.WORKLOADS["gpt1.6b"], LAB)
    assert seed.unfit_reason("fsdp4", seed.WORKLOADS["gpt1.6b"], LAB) is None
    assert seed.unfit_reason("ddp4", seed.WORKLOADS["bert"], LAB) is None


def test_the_solo_runs_beside_the_pair_on_the_gpus_it_leaves():
    args = seed.parse_args(["--accelerator", "cpu"])
    assert seed.steps_of(list(seed.LAYOUTS))[0] == ["pair", "solo"]
    children = seed.launches_of(args, seed.WORKLOADS["bert"], ["pair", "solo"])
    assert [(name, gpus) for name, _, gpus in children] == [
        ("pair", [0, 1]), ("solo_A100-80GB", [2]), ("solo_RTX3090", [3])]
    assert children[1][1] == ["--card", "0", "--solo-batches", "80"]
    assert children[2][1] == ["--card", "2", "--solo-batches", "40,20"]


def test_the_calibration_file_is_named_with_its_hash_and_host(tmp_path, monkeypatch):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"host": "NVIDIA H200", "presets": {}}))
    monkeypatch.setenv(seed.CALIBRATION_ENV, str(path))
    identity = seed.calibration_identity()
    assert identity["source"] == "$" + seed.CALIBRATION_ENV
    assert identity["files"][0]["host"] == "NVIDIA H200" and len(identity["files"][0]["sha256"]) == 16


def test_error_lines_say_why():
    assert seed.error_line("x\nRuntimeError: CUDA out of memory. Tried", 1).startswith("does not fit (out of memory)")
    assert seed.error_line("Traceback\nValueError: bad\nwarning", 1) == "failed (1): ValueError: bad"
    assert seed.error_line("step 3", "timeout") == "cut at its time limit (step 3)"


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a killed orphan may stay a zombie where nothing reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_layout_is_ended_with_its_whole_process_group(tmp_path):
    began = time.perf_counter()
    launch = seed.Launch([sys.executable, "-c", "import subprocess, time; "
                          "print(subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)"],
                         str(tmp_path / "log"), None)
    time.sleep(0.5)
    assert launch.wait(1.0) == "timeout"
    grandchild = int((tmp_path / "log").read_text().split()[0])
    time.sleep(0.2)
    assert not running(grandchild)  # the child's own child is gone too, not left holding a GPU
    assert time.perf_counter() - began < 15


def test_layouts_past_the_deadline_are_rows_that_say_so(tmp_path, capsys):
    result = seed.main(["--accelerator", "cpu", "--tiny", "--workloads", "bert,gpt1.6b", "--deadline-s", "1",
                        "--min-layout-s", "30", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "seed_lab_bert_gpt16b.json").read_text())
    assert saved["emulated"] is True and saved["lab"] == LAB and saved["calibration"]["source"]
    for work in saved["workloads"]:
        assert set(work["layouts"]) == set(seed.LAYOUTS)
        assert all(row.get("error") for row in work["layouts"].values())
        assert set(work["doctor"]["predicted_samples_per_s"]) == {"pair", "ddp4", "fsdp4", "hybrid4"}
    assert result["workloads"][0]["layouts"]["pair"]["error"].startswith("not run")
    assert "lightning_fsdp4" in capsys.readouterr().out


@pytest.mark.slow
def test_the_cpu_dry_run_measures_the_pair_and_the_solo_cards(tmp_path):
    seed.main(["--accelerator", "cpu", "--tiny", "--layouts", "pair,solo", "--warmup", "1", "--steps", "2",
               "--layout-s", "240", "--deadline-s", "260", "--out", str(tmp_path)])
    work = json.loads((tmp_path / "seed_lab_bert.json").read_text())["workloads"][0]
    pair, solo = work["layouts"]["pair"], work["layouts"]["solo"]["cards"]
    assert pair["samples_per_s"] > 0 and len(pair["emulation"]) == 2 and len(pair["peak_gib"]) == 2
    assert set(solo) == {"A100-80GB", "RTX3090"} and set(solo["RTX3090"]["rates"]) == {"4", "2"}
    assert solo["RTX3090"]["emulation"][0]["expected_slowdown"] > 1
    assert work["ratios"]["ideal"] > pair["samples_per_s"]
    assert os.path.exists(tmp_path / "logs" / "bert_pair.log")
