"""HeteroMonitor on 2 GPUs: ``python -m pytest -q tests/gpu/test_gpu_monitor.py -m gpu`` (skipped without them)."""

import pytest
from gpu_common import run_worker

pytestmark = pytest.mark.gpu(2)

def test_monitor_sees_the_wait_of_a_quarter_sm_rank_and_its_removal(tmp_path):
    result = run_worker("monitor_worker.py", tmp_path, timeout=500)
    equal, profile = result["equal"], result["profile"]
    print(f"\nmonitor on GPUs: equal shares wait {equal['wait_fraction']}, profiled {profile['shares']} wait "
          f"{profile['wait_fraction']}, ideal fraction {profile['ideal_fraction']:.2f}, nvml {profile['nvml']}")
    # Rank 1 has a quarter of the SMs: with equal shares rank 0 waits for the slow rank's extra compute (its step also
    # holds data, logging and the exchange, so the fraction is below 1 - 1/slowdown: 0.38 measured on 2x H200), with
    # profiled shares hardly at all.
    s = equal["per_step_s"]
    extra = (s["compute"][1] - s["compute"][0]) / s["cycle"][0]
    assert extra > 0.25 and abs(equal["wait_fraction"][0] - extra) < 0.1, (equal["wait_fraction"], extra)
    assert equal["wait_fraction"][1] < 0.1
    assert profile["wait_fraction"][0] < 0.15 and profile["shares"][0] > 0.65
    for run in (equal, profile):
        s = run["per_step_s"]
        for r in range(2):
            parts = s["compute"][r] + s["wait"][r] + s["data"][r] + s["comm"][r]
            assert abs(parts - s["cycle"][r]) <= 1e-6 + 1e-3 * s["cycle"][r]
