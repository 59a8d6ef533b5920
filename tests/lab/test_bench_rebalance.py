"""benchmarks/bench_rebalance.py: its step counting, and its CPU smoke run end to end (a rank throttled mid-fit)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import bench_rebalance  # noqa: E402


def test_windows_and_steps_after_the_change():
    # 8 samples a step: 1 s a step before the change at step 3, 2 s after it, 1 s again from step 7 on.
    seconds = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    series = bench_rebalance.windowed(seconds, 8, 2)
    assert series[0] is None and series[1] == 8.0 and series[4] == 4.0 and series[8] == 8.0
    # Windows count only once they hold no step before the change: the one ending at step 3 (half before) is out.
    assert bench_rebalance.steps_to(series, 3, 2, 7.9) == (6, 6)  # window of steps 7-8, the 6th step from step 3
    assert bench_rebalance.steps_to(series, 3, 2, 5.0) == (5, 5)  # steps 6-7: 8 samples x 2 / 3 s
    assert bench_rebalance.steps_to(series, 3, 2, 9.0) == (None, None)
    dip = bench_rebalance.windowed([1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0], 8, 2)
    assert bench_rebalance.steps_to(dip, 1, 2, 7.0) == (2, 6)  # reached at once, held only after the dip


def test_every_rank_gets_an_emulator_and_cpu_ranks_start_slowed():
    gpu = bench_rebalance.emulate_specs("same2", "gpu")
    assert gpu == [{"link": "nvlink"}, {"link": "nvlink"}]  # whole cards, yet each with an emulator to throttle
    assert bench_rebalance.emulate_specs("mix2", "gpu")[1] == {"link": "pcie", "sm_share": 0.25, "memory_gib": 24}
    assert [s["slowdown"] for s in bench_rebalance.emulate_specs("mix2", "cpu")] == [1.5, 6.0]


@pytest.mark.slow
def test_bench_rebalance_tiny_cpu_run(tmp_path):
    rows = bench_rebalance.main(["--tiny", "--accelerator", "cpu", "--models", "gpt", "--rounds", "1",
                                 "--change-at", "6", "--after", "10", "--window", "2", "--settle", "4",
                                 "--oracle-steps", "3", "--solo-steps", "2", "--out", str(tmp_path)])
    assert [r["config"] for r in rows] == ["solo", "ddp", "static", "rebalance", "oracle"]
    assert all("error" not in r for r in rows), rows
    solo = rows[0]
    # Rank 0 (slowdown 1.5) was throttled 2x between its solo loops; rank 1 kept its own.
    assert [e[1] for e in solo["emulation"]] == ["slowdown 3.00x, gloo (link not emulated)",
                                                 "slowdown 6.00x, gloo (link not emulated)"]
    # Every rank ran under its emulation before and after the change (the oracle is throttled from its first step).
    assert all(r["capped"] == [[True, True], [True, True]] for r in rows[:4]), [(r["config"], r["capped"])
                                                                                  for r in rows]
    assert rows[4]["capped"] == [[None, True], [None, True]]
    for row in rows[1:4]:
        assert len(row["seconds"]) == 16 and row["change_at"] == 6 and 0 < row["settled_ratio"]
        assert len(row["reach_hold_ideal"]) == 2
    static, oracle = rows[2], rows[4]
    assert static["split_before"] == static["split_after"] and sum(static["split_after"]) == 32
    assert oracle["split_before"] == oracle["split_after"]  # the oracle's split is the post-change rates' all along
    saved = json.loads((tmp_path / "bench_rebalance.json").read_text())
    assert [line["config"] for line in saved["summary"]] == ["solo", "ddp", "static", "rebalance", "oracle"]
    assert all(not line["unemulated"] for line in saved["summary"])
