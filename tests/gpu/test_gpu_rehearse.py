"""`doctor --lab` on one GPU: what a rehearsal measures for each card, one rank at a time on the fake process group,
agrees with the same ranks really run (plan, split, peak memory within 10 %, measured as the ranks share this GPU
through gloo) and with each card emulated alone (step time within 10 % under DDP; under FSDP, where this
model's step is host-bound, every difference named with its cause), for both strategies.

    python -m pytest -q -s tests/gpu/test_gpu_rehearse.py
    REHEARSE_CHECK_OUT=DIR python -m pytest ...   # keep every report (check.json, rehearsal.log/.json/.png) in DIR
"""

import os
from typing import Any

import pytest

from benchmarks.rehearse_check import AGREEMENT, honesty_check

pytestmark = pytest.mark.gpu  # one CUDA device: the ranks take turns on it, or share it capped as their cards

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "rehearse_gpt_check.yaml")  # a 350M GPT, bf16-mixed, AdamW
LAB = "A100-40GB,RTX3090"  # 40 + 24 GiB of caps: both ranks fit one 80 GiB card together


# Whether the step times must agree within AGREEMENT. This GPT's FSDP2 step is host-bound on the lent H100 VM (the
# GPU has finished when the host issues the step's last work: 0.1 ms of wait in every step) and that host's speed
# varies by ±20 % between processes (RESULTS.md, 2026-11-26): there the check names each difference and its cause,
# and the test holds it to that.
STEP_TIMES_AGREE = {"hetero_ddp": True, "hetero_fsdp": False}


@pytest.mark.parametrize("strategy", ["hetero_ddp", "hetero_fsdp"])
def test_rehearsal_agrees_with_the_ranks_really_run(strategy: str, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    keep = os.environ.get("REHEARSE_CHECK_OUT")
    out_dir = os.path.join(keep, strategy) if keep else str(tmp_path)
    report = honesty_check(CONFIG, LAB, steps=16, out_dir=out_dir, strategy=strategy, timeout=300)
    rows = report["check"]["rows"]
    assert [row["card"] for row in rows] == ["A100-40GB", "RTX3090"]
    for row in rows:
        rehearsed_plan, real_plan = row["plan"]
        assert rehearsed_plan is not None and rehearsed_plan == real_plan, row
        rehearsed_split, real_split = row["split"]
        assert rehearsed_split == real_split and rehearsed_split[0] > rehearsed_split[1], row
        assert row["peak_error"] is not None and abs(row["peak_error"]) <= AGREEMENT, row
        assert row["step_error"] is not None, row
        if STEP_TIMES_AGREE[strategy]:
            assert abs(row["step_error"]) <= AGREEMENT, row
    # Only step times may differ (plans, splits and peaks agree, asserted above), and each difference is named.
    differs = report["check"]["disagreements"]
    assert [d.split(":")[0] for d in differs] == [f"rank {row['rank']}" for row in rows
                                                   if abs(row["step_error"]) > AGREEMENT], differs
    assert all(": rehearsed step " in d for d in differs), differs
