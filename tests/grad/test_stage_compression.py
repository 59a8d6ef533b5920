"""lightning_hetero/grad/stage_compression.py: the leaders' hook of a stage is the data-parallel strategy's hook on
the stage's gradients, and its presence flags cross exactly (2 forked gloo ranks, each its host's leader)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_hetero import PowerSGDCompression, TopKCompression
from lightning_hetero.grad.bucket_state import CommCounter
from lightning_hetero.grad.compress_hooks import FlatBucket, TopKState, topk_hook
from lightning_hetero.grad.powersgd_hook import PowerSGDHookState, powersgd_hook
from lightning_hetero.grad.stage_compression import LeadersState, leaders_hook
from tests.helpers import free_port

CONFIGS = {"topk": TopKCompression(ratio=0.05, hierarchical=True),
           "powersgd": PowerSGDCompression(rank=1, start_iter=2, hierarchical=True)}


def _worker(rank: int, port: int, out_dir: str, method: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        config, cpu = CONFIGS[method], torch.device("cpu")
        params = [torch.zeros(16, 8), torch.zeros(16)]
        counter = CommCounter()
        stage = LeadersState(config, None, counter)
        # The same hook and config on the gradients alone: what the leaders' hook must give
        alone = (TopKState(config, None, params, cpu, CommCounter(), "inter") if method == "topk" else
                 PowerSGDHookState(config, None, params, cpu, CommCounter(), "inter"))
        hook = topk_hook if method == "topk" else powersgd_hook
        g = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(4):
            grads = torch.randn(144, generator=g) * 10
            flags = torch.tensor([1.0, float(rank)])  # the bias's gradient on rank 1 only
            out = leaders_hook(stage, FlatBucket(torch.cat([grads, flags]), params)).wait().clone()
            expected = hook(alone, FlatBucket(grads.clone(), params)).wait().clone()
            steps.append((out, expected, counter.take()))
        torch.save(steps, os.path.join(out_dir, f"{method}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", list(CONFIGS))
def test_the_leaders_hook_is_the_strategys_hook_with_exact_flags(tmp_path, method):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path), method), nprocs=2, start_method="fork")
    ranks = [torch.load(os.path.join(tmp_path, f"{method}{r}.pt")) for r in range(2)]
    for (out, expected, hops), (other, _, _) in zip(*ranks):
        assert torch.equal(out[:-2], expected)  # the same hook, its own state per stage
        assert out[-2:].tolist() == [1.0, 0.5]  # the flags' mean over the two leaders, exactly
        assert torch.equal(out, other)  # every leader gets the same bits
        assert set(hops) == {"inter"} and hops["inter"] <= 146 * 4
    # Past PowerSGD's plain steps: fewer bytes than the fp32 buffer
    assert ranks[0][-1][2]["inter"] < 146 * 4
