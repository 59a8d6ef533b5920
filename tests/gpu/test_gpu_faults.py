"""Fail fast on 2 GPUs with NCCL: an exception, a SIGKILL and a stuck rank end both ranks, rank 0 names the rank.

NCCL differs from gloo where it matters here: a collective whose peer died does not fail at once (it waits for the
NCCL timeout), so the surviving rank is ended by its watchdog after the 5 s grace, not by its own exception.

    python -m pytest -q -s tests/gpu/test_gpu_faults.py     # prints the time to fail of each case

Each rank is its own process with one card (``CUDA_VISIBLE_DEVICES``), started as a node of a 2-node job, as in
``tests/resilience/test_faults.py``.
"""

import os
import signal

import pytest

from tests.resilience.test_faults import FAULT_BATCH, _assert_failed_fast, _run_job

# Counted without initialising CUDA here; the ranks are spawned anyway (another test may have initialised it).
pytestmark = pytest.mark.gpu(2)

TIMEOUT = 20.0  # NCCL communicators take seconds to set up


@pytest.mark.parametrize(("fault", "expected"), [
    ("exception", f"failed while in forward/backward at step {FAULT_BATCH}, batch {FAULT_BATCH}: RuntimeError"),
    ("sigkill", "stopped responding"),
    ("stuck", "is stuck while in forward/backward"),
])
def test_gpu_fault_ends_both_ranks_naming_rank_1(tmp_path, fault, expected):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    job = _run_job(str(tmp_path), fault, accelerator="gpu", timeout=TIMEOUT, start_method="spawn")
    _assert_failed_fast(job, budget=TIMEOUT + 30)
    if fault == "sigkill":
        assert job["codes"][1] == -signal.SIGKILL
    text = job["stderr"][0]
    assert "rank 1 (host " in text and "device NVIDIA" in text and expected in text, text[-3000:]
    print(f"GPU time to fail ({fault}): {job['time_to_fail']:.1f} s")
