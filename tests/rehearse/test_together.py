"""`doctor --model CONFIG --lab LAB` for the hybrid layout: the lab's ranks run together on this device, and the report
gives each rank's role, its replica's share and micro-batches, the pipelines chosen and its memory against its card,
names the rank that ran out of memory, and predicts no step time."""

import json
import os
from dataclasses import asdict

import pytest

from lightning_hetero.plan.memory import GIB
from lightning_hetero.rehearse.command import failure
from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.together import first_failure, format_together, is_hybrid, pipelines_asked
from tests.rehearse._doctor import run_doctor
from tests.rehearse._pipeline_model import MODEL_ERROR

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
MODEL = "model: {class_path: tests.rehearse._pipeline_model.Blocks, init_args: {batch_size: 4, fail_rank: %d}}\n"
HYBRID = ("trainer: {strategy: {class_path: lightning_hetero.HeteroHybridStrategy, "
          "init_args: {pipelines: [[1, 2]], capacities: [2, 1, 1]}}}\n")
DDP = "trainer: {strategy: {class_path: lightning_hetero.HeteroDDPStrategy, init_args: {capacities: [2, 1, 1]}}}\n"
# The stage cards hold less than a replica of the model, its gradients and AdamW's state (12 KiB), and more than half
# of it with the whole model's weights beside it: pipelines="auto" pairs them.
LAB = ('["A100-80GB", {"preset": "RTX3090", "memory_gib": 1.1e-5}, {"preset": "RTX3090", "memory_gib": 1.1e-5}]')


def _config(tmp_path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_hybrid_layout_is_chosen_by_the_flag_or_by_the_configs_strategy(tmp_path):
    hybrid, ddp = _config(tmp_path, MODEL % -1 + HYBRID, "h.yaml"), _config(tmp_path, MODEL % -1 + DDP, "d.yaml")
    bare = _config(tmp_path, "model: {class_path: x.Y}\n", "bare.yaml")
    broken = _config(tmp_path, "trainer: [unclosed\n", "broken.yaml")
    assert is_hybrid(hybrid, None) and is_hybrid(ddp, "hetero_hybrid") and is_hybrid(bare, "hetero_hybrid")
    assert not is_hybrid(ddp, None) and not is_hybrid(hybrid, "hetero_ddp")
    assert not is_hybrid(bare, None) and not is_hybrid(broken, None)  # the ranks then say what is wrong
    # Lightning's registry spelling in the config: the name, or a launcher variant's.
    by_name = [_config(tmp_path, MODEL % -1 + f"trainer: {{strategy: {name}}}\n", f"{name}.yaml")
               for name in ("hetero_hybrid", "hetero_hybrid_spawn", "hetero_ddp")]
    assert [is_hybrid(c, None) for c in by_name] == [True, True, False]
    # The pipelines asked: the config's own, or the planner's for a config of another strategy.
    assert pipelines_asked(hybrid) == [[1, 2]] and pipelines_asked(ddp) == "auto"


def _rank(rank: int, card: str, **fields) -> RankResult:
    return RankResult("shared", rank, card, card_memory_bytes=(80 if rank == 0 else 24) * GIB,
                      local_memory_bytes=int(79.2 * GIB), pipelines=[[1, 2]], global_batch=12, **fields)


def _report(results: list, **fields) -> dict:
    return {"config": "job.yaml", "lab_text": "A100-80GB,RTX3090,RTX3090", "strategy": "the config's",
            "lab": ["A100-80GB", "RTX3090", "RTX3090"], "local_device": "NVIDIA H100", "steps": 6,
            "accelerator": "gpu", "hetero": [asdict(r) for r in results], "pipelines_asked": [[1, 2]],
            "assumptions": [], "notes": [], **fields}


def test_the_rank_that_ran_out_of_memory_first_is_named_and_the_others_stopped_with_it():
    # Rank 2 (the last stage) ran out of memory; ranks 0 and 1 then lost their peer.
    lost = "RuntimeError: Connection closed by peer"
    results = [_rank(0, "A100-80GB", error=lost, failed_at=12.0, plan="replica", share=0.5),
               _rank(1, "RTX3090", error=lost, failed_at=11.5, stage=0, plan="stage 0 of pipeline 0", share=0.5),
               _rank(2, "RTX3090", oom=True, error="CUDA out of memory.", failed_at=11.0, stage=1,
                     plan="stage 1 of pipeline 0", share=0.5, micro_batches=3, peak_allocated_bytes=23 * GIB)]
    first = first_failure(results)
    assert first.rank == 2
    assert failure([asdict(first)], "rehearsal.log", None) is None  # out of memory on a card: the answer, no failure
    text = format_together(_report(results))
    assert ("OUT OF MEMORY: rank 2 (RTX3090, stage 1 of pipeline 0) ran out of memory under its card's 24.00 GiB"
            in text)
    rows = {line.split()[0]: line for line in text.splitlines() if line[:1].isdigit()}
    assert "stopped (rank 2 ran out of memory first)" in rows["0"] and rows["2"].rstrip().endswith("OOM")
    assert "data-parallel replica" in rows["0"] and "3 x 2" in rows["2"] and "50.0%" in rows["1"]
    assert "Step time: not predicted" in text and " ms" not in text
    # A rank's own error before any other failure is the rehearsal's failure, its error first.
    results[0] = _rank(0, "A100-80GB", error="ValueError: the model's own", failed_at=10.0)
    first = first_failure(results)
    assert first.rank == 0
    assert failure([asdict(first)], "rehearsal.log", None).startswith("ValueError: the model's own [rehearsed rank 0")


def test_an_out_of_memory_error_inside_a_pipeline_stage_counts_as_out_of_memory():
    import torch

    from lightning_hetero.rehearse.rank import out_of_memory

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        try:
            raise oom
        except Exception as err:  # as torch's pipeline stage raises a forward's error again
            raise RuntimeError("[Stage 1] failed to run forward") from err
    except RuntimeError as wrapped:
        assert out_of_memory(wrapped) is oom
    assert out_of_memory(ValueError("the model's own")) is None


def test_ranks_that_fit_show_their_peaks_against_their_cards():
    results = [_rank(0, "A100-80GB", ok=True, plan="replica", share=0.5, peak_allocated_bytes=9 * GIB),
               _rank(1, "RTX3090", ok=True, stage=0, plan="stage 0 of pipeline 0", share=0.5, micro_batches=2,
                     peak_allocated_bytes=5 * GIB),
               _rank(2, "RTX3090", ok=True, stage=1, plan="stage 1 of pipeline 0", share=0.5, micro_batches=2,
                     peak_allocated_bytes=6 * GIB)]
    text = format_together(_report(results))
    assert ("Memory: every rank fits its card (peak of card, GiB: rank 0 9.00 of 80.00, rank 1 5.00 of 24.00, "
            "rank 2 6.00 of 24.00)") in text
    assert "pipelines: [[1, 2]]\n" in text  # as the config asked; no planner's choice to speak of


@pytest.mark.slow
def test_a_config_rehearsed_as_the_hybrid_layout_reports_each_ranks_part_as_json(tmp_path, capsys, monkeypatch):
    """A HeteroDDPStrategy config rehearsed with `--strategy hetero_hybrid` on a lab whose two small cards cannot
    hold a replica: the planner pairs them into a pipeline (pipelines="auto"), and every rank runs."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code, out, err = run_doctor(["--model", _config(tmp_path, MODEL % -1 + DDP), "--lab", LAB, "--strategy",
                              "hetero_hybrid", "--steps", "4", "--out", str(tmp_path / "out"), "--json"], capsys)
    assert code == 0, err[-3000:]
    report = json.loads(out)  # stdout is the report and nothing else
    assert report["failed"] is None and report["pipelines_asked"] == "auto"
    ranks = report["hetero"]
    assert [r["ok"] for r in ranks] == [True, True, True], err[-3000:]
    assert [r["pipelines"] for r in ranks] == [[[1, 2]]] * 3
    assert [(r["stage"], r["plan"]) for r in ranks] == [(None, "replica"), (0, "stage 0 of pipeline 0"),
                                                         (1, "stage 1 of pipeline 0")]
    # Capacities 2 : 1 + 1: the data-parallel replica and the pipeline each train on half the global batch of 12,
    # the pipeline as 3 micro-batches of 2 (the most, up to 2 x stages, that divide its 6).
    assert [r["share"] for r in ranks] == [0.5, 0.5, 0.5] and ranks[0]["global_batch"] == 12
    assert [r["micro_batches"] for r in ranks] == [None, 3, 3]
    assert all(r["host_rss_bytes"] > 0 and r["step_seconds"] == [] for r in ranks)  # no step time kept
    assert report["prediction"]["step_seconds"] is None and report["ddp"] == [] and report["advice"] is None
    assert "pipelines: [[1, 2]] (pipelines='auto': the planner's choice" in err
    assert "Step time: not predicted" in err and "rehearsed hybrid rank 2 (RTX3090): ok" in err
    assert any("not rehearsed beside the hybrid layout" in n for n in report["notes"])


@pytest.mark.slow
def test_a_rank_that_fails_ends_the_hybrid_rehearsal_non_zero_with_its_error_first(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code, out, err = run_doctor(["--model", _config(tmp_path, MODEL % 2 + HYBRID), "--lab", "A100-80GB,RTX3090,RTX3090",
                              "--steps", "4", "--out", str(tmp_path / "out")], capsys)
    assert code == 1, (out, err)
    assert f"lightning-hetero doctor: error: ValueError: {MODEL_ERROR} [rehearsed rank 2, RTX3090" in err
    assert "rehearsed hybrid rank 0 (A100-80GB): stopped (rank 2 failed first)" in out
