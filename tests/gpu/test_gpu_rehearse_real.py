"""The rehearsal held against the same lab really run, one GPU per card (``rehearse_check.py --real-gpus``): for ours
(replicas, and sharded with every rank keeping its shard) and Lightning's DDP and FSDP, every rehearsed peak within
5 % of the real one and every predicted step within 10 % of the real step (issue 37's bars).

    python -m pytest -q -s tests/gpu/test_gpu_rehearse_real.py          # 2 GPUs; about 3 minutes; needs jsonargparse
    REHEARSE_REAL_OUT=DIR python -m pytest ...   # keep real_check.json and real.log in DIR
"""

import os
from typing import Any

import pytest

from benchmarks.rehearse_real import PEAK_AGREEMENT, STEP_AGREEMENT, real_check

pytestmark = pytest.mark.gpu(2)  # rank r on GPU r, emulated as the lab's card r

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "rehearse_gpt_check.yaml")  # a 350M GPT, bf16-mixed, AdamW, global batch 8
LAB = "A100-80GB,RTX3090"  # ours splits 7 + 1, Lightning's 4 + 4
RUNS = ["hetero_ddp", "hetero_fsdp:keep", "ddp", "fsdp"]


def test_rehearsed_peaks_and_predicted_steps_agree_with_the_lab_really_run(tmp_path: Any, monkeypatch: Any) -> None:
    pytest.importorskip("jsonargparse", reason="the rehearsal builds the config's LightningCLI")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out_dir = os.environ.get("REHEARSE_REAL_OUT") or str(tmp_path)
    os.makedirs(out_dir, exist_ok=True)
    # 10 steps (8 timed): a step's forward is host-bound at these sizes, and over 3 timed steps one slow host step
    # moved the median by a quarter (160 vs 128 ms for the same run).
    results = real_check(CONFIG, LAB, RUNS, steps=10, out_dir=out_dir, timeout=150.0)
    assert [run["run"] for run in results["runs"]] == RUNS
    for run in results["runs"]:
        for row in run["ranks"]:
            assert row["errors"] == [None, None], (run["run"], row)
            assert row["peak_error"] is not None and abs(row["peak_error"]) <= PEAK_AGREEMENT, (run["run"], row)
        assert run["step_error"] is not None and abs(run["step_error"]) <= STEP_AGREEMENT, (
            run["run"], run["predicted_step_seconds"], run["real_step_seconds"], run["predicted_phase_seconds"],
            [row["phase_seconds"] for row in run["ranks"]])
    # Ours splits the batch unevenly (the case the phases decide), Lightning's evenly.
    assert results["runs"][0]["ranks"][0]["batch"][1] > results["runs"][0]["ranks"][1]["batch"][1]
