"""HeteroMonitor's stage breakdown on 3 GPUs: ``python -m pytest -q tests/gpu/test_gpu_stage_monitor.py -m gpu``
(skipped without them)."""

import pytest
from gpu_common import run_worker

pytestmark = pytest.mark.gpu(3)


@pytest.mark.parametrize(("schedule", "overlap"), [("gpipe", False), ("1f1b", True)],
                         ids=["gpipe-late-exchange", "1f1b-overlapped-exchange"])
def test_a_quarter_sm_stage_computes_longer_and_its_neighbour_idles(tmp_path, schedule, overlap):
    """Ranks 1 and 2 a pipeline, rank 2 (stage 1) with a quarter of the SMs: each stage's compute, send/recv and
    bubble (CUDA events on the compute stream) add up to its schedule's step; stage 1 computes longer, stage 0
    idles in the bubble. Each rank hands the stage exchange its stages' buffers (rank 0 both) and waits in it for a
    part of its sync (events around the exchange: the stream's stall on NCCL)."""
    r = run_worker("stage_monitor_worker.py", tmp_path, "--schedule", schedule, *(["--overlap"] if overlap else []),
                   timeout=500)
    print(f"\n{schedule}, overlap {r['overlap']}: " + ", ".join(
        f"{k} {[round(1000 * v, 2) for v in r[k]]}" for k in ("stage_span", "stage_compute", "sendrecv", "bubble",
                                                                "exchange"))
          + f", MB {[round(b / 1e6, 3) for b in r['comm_bytes']]}")
    assert r["overlap"] == overlap
    # float32 on the wire of the monitor's exchange (CUDA): exact to 1e-7
    assert r["comm_bytes"] == pytest.approx(r["expected_bytes"], rel=1e-6)
    for rank in range(3):
        assert 0.0 < r["exchange"][rank] <= r["comm"][rank] + r["wait"][rank] + 1e-6, rank
    assert r["pipelines"] == [[1, 2]]
    fast, slow = 1, 2
    for rank in (fast, slow):
        parts = r["stage_compute"][rank] + r["sendrecv"][rank] + r["bubble"][rank]
        assert parts == pytest.approx(r["stage_span"][rank], rel=0.1), rank
        assert r["sendrecv"][rank] > 0.0
    assert r["stage_compute"][slow] > 2.0 * r["stage_compute"][fast]
    assert r["bubble"][fast] > 0.3 * r["stage_span"][fast]
    assert r["bubble"][fast] > 2.0 * r["bubble"][slow]
