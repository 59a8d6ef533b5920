"""Per training step, the strategy issues no more collectives and host reads than Lightning's DDPStrategy, but the
one pre-emption agreement, and none of Lightning's per-step SIGTERM-flag broadcast (benchmarks/step_census.py counts
them on CPU; on GPUs each costs device time, a host read a wait for the device)."""

import pytest

from benchmarks.host_overhead import parse_args, run_config


@pytest.mark.slow
def test_equal_shares_add_at_most_the_queued_preemption_agreement_per_step():
    args = parse_args(["--warmup", "3", "--steps", "10", "--log", "sync", "--out", "unused"])
    ddp, ours = (run_config(config, args, profile=False, census=True)[0]["census"] for config in ("ddp-2", "hetero-2"))
    extra_collectives = sum(ours["collectives"].values()) - sum(ddp["collectives"].values())
    extra_reads = sum(ours["host reads"].values()) - sum(ddp["host reads"].values())
    # The agreement's all-reduce, queued behind the step; its read is the previous step's notes (a finished copy).
    assert extra_collectives <= 1.0, (ours, ddp)
    assert extra_reads <= 1.0, (ours, ddp)
    assert "c10d::barrier" not in ours["collectives"], ours  # a weighted logged mean needs no barrier
    # Lightning's flag broadcast and its read are off: the handler owns SIGTERM. With no per-step sync left, the
    # census finds no host gap after one.
    assert "c10d::broadcast_" not in ours["collectives"] and ddp["collectives"]["c10d::broadcast_"] >= 0.9, (ours, ddp)
    assert ours["host gap us"] is None and ddp["host gap us"] is not None
