"""BatchNorm under uneven shares on CUDA: ``Trainer(sync_batchnorm=True)`` with both strategies against one process on
the same GPU at shares [3, 1], parameters and running statistics (FSDP also with rank 0 recomputing its BatchNorm
blocks); without sync far from it. On 2 GPUs (NCCL) also
torch's own ``SyncBatchNorm`` with unequal per-rank counts (6 + 2) against ``BatchNorm2d`` on all 8.

    python -m pytest -q -s tests/gpu/test_gpu_batchnorm.py -m gpu   # the 2-GPU test is skipped on one GPU
"""

import pytest
from gpu_common import run_worker

# fp32 (TF32 off): the ranks sum their shares in another order than one process.
TOLERANCE = 2e-5


def check(result: dict, strategies: tuple[str, ...] = ("HeteroDDPStrategy", "HeteroFSDPStrategy")) -> None:
    runs = result["runs"]
    for strategy in strategies:
        synced, plain = runs[f"{strategy} sync=True"], runs[f"{strategy} sync=False"]
        assert "error" not in synced, synced.get("error")
        assert "error" not in plain, plain.get("error")
        assert synced["steps"] == [synced["reference_steps"]] * 2
        assert synced["params"] <= TOLERANCE and synced["buffers"] <= TOLERANCE, (strategy, synced)
        assert plain["params"] > 1e-2, (strategy, plain)
    if "HeteroFSDPStrategy" not in strategies:
        return
    recomputed = runs["HeteroFSDPStrategy sync=True checkpoint rank 0"]
    assert "error" not in recomputed, recomputed.get("error")
    assert recomputed["params"] <= TOLERANCE and recomputed["buffers"] <= TOLERANCE, recomputed


@pytest.mark.gpu
def test_sync_batchnorm_equals_one_process_with_two_ranks_on_one_gpu(tmp_path):
    """DDP only: FSDP2 over gloo with CUDA tensors in fork-launched ranks dies with SIGSEGV (see the worker)."""
    result = run_worker("batchnorm_worker.py", tmp_path, "--mode", "shared", timeout=500)
    print("\n", result["runs"])
    check(result, ("HeteroDDPStrategy",))


@pytest.mark.gpu(2)
def test_sync_batchnorm_equals_one_process_over_nccl(tmp_path):
    result = run_worker("batchnorm_worker.py", tmp_path, "--mode", "nccl", timeout=500)
    print("\n", result["runs"], "\n torch SyncBatchNorm:", result["torch_sync_batchnorm"])
    check(result)
    for rank, errors in result["torch_sync_batchnorm"].items():
        assert isinstance(errors, dict), errors
        assert max(errors.values()) <= 1e-5, (rank, errors)
