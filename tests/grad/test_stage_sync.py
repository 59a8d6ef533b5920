"""lightning_hetero/grad/stage_sync.py on one process joined to a fake 3-rank group (collectives return at once):
what an overlapped backward refuses."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_hetero._compat as _compat
from lightning_hetero.grad.stage_sync import StageSync
from lightning_hetero.plan.layout import HybridLayout


@pytest.fixture
def rank_0_of_3():
    """Rank 0 (data-parallel) of 3, ranks 1 and 2 a pipeline, in the fake process group (restored after)."""
    broadcast_object_list = dist.broadcast_object_list
    _compat.init_fake_process_group(0, 3)
    try:
        yield HybridLayout.from_pipelines([[1, 2]], 3)
    finally:
        dist.destroy_process_group()
        dist.broadcast_object_list = broadcast_object_list


class TwiceCheckpointed(nn.Module):
    """Stage 0 ``first``; stage 1 ``shared``, used in two reentrant checkpointed segments: each segment's own
    backward accumulates into ``shared``'s gradient, the second after stage 1 is complete."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        h = self.first(x)
        h = checkpoint(self.shared, h, use_reentrant=True)
        return checkpoint(self.shared, h, use_reentrant=True)


def test_a_second_gradient_after_the_stage_exchange_began_names_the_way_out(rank_0_of_3):
    model = TwiceCheckpointed()
    sync = StageSync(rank_0_of_3, rank=0)
    sync.partition = [["first.weight", "first.bias"], ["shared.weight", "shared.bias"]]
    sync.overlap = True
    with pytest.raises(RuntimeError, match=r"overlap_stage_exchange=False") as refused:
        with sync.overlapped(model):
            model(torch.randn(4, 2)).sum().backward()
    assert "stage 1" in str(refused.value) and "use_reentrant=False" in str(refused.value)


def test_without_the_overlap_the_same_model_is_exchanged_late(rank_0_of_3):
    model = TwiceCheckpointed()
    sync = StageSync(rank_0_of_3, rank=0)
    sync.partition = [["first.weight", "first.bias"], ["shared.weight", "shared.bias"]]
    model(torch.randn(4, 2)).sum().backward()
    sync.all_reduce_grads(model)
    assert all(p.grad is not None for p in model.parameters())


class TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("overlap", [False, True], ids=["late", "overlapped"])
def test_the_exchange_counts_each_stage_buffer_once_a_step(rank_0_of_3, overlap):
    """A data-parallel rank hands each stage group its stage's gradients and one presence flag per parameter (fp32):
    2 stages x (6 + 2) x 4 bytes a step, whether the exchange began in the backward or after it, and not summed over
    steps."""
    model = TwoStages()
    sync = StageSync(rank_0_of_3, rank=0)
    sync.partition = [["first.weight", "first.bias"], ["second.weight", "second.bias"]]
    sync.overlap = overlap
    assert sync.bytes_last_step is None
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with sync.overlapped(model) if overlap else contextlib.nullcontext():
            model(torch.randn(4, 2)).sum().backward()
        assert bool(sync._early) == overlap  # both stages began in the backward, or none
        sync.all_reduce_grads(model)
        assert sync.bytes_last_step == 2 * (6 + 2) * 4
