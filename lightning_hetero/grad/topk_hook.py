"""Top-k sparsification as a comm hook: the largest ``ratio`` of entries by magnitude, sent as values + indices with
``all_gather`` (any world size, gloo or NCCL), with error feedback, Deep Gradient Compression's momentum correction
and a ratio warm-up."""

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hetero.grad.bucket_states import BucketStates, elementwise
from lightning_hetero.grad.comm_hooks import CommCounter, nbytes
from lightning_hetero.grad.compression_config import TopKCompression

class TopKState:
    """Residuals and momentum-correction velocities (per bucket, checkpointed per parameter) and the step counter of
    the ratio warm-up."""

    def __init__(self, config: TopKCompression, process_group: Optional[dist.ProcessGroup],
                 params: Sequence[Tensor], device: torch.device, counter: CommCounter, hop: str) -> None:
        self.config = config
        self.process_group = process_group
        self.residuals: dict[int, Tensor] = {}
        self.velocities: dict[int, Tensor] = {}
        self.buckets = BucketStates(params, device, {"residual": (lambda: self.residuals, elementwise, True),
                                                     "velocity": (lambda: self.velocities, elementwise, True)})
        self.steps = 0
        self.counter = counter
        self.hop = hop

    def k_for(self, numel: int) -> int:
        return max(1, int(numel * self.config.ratio_at(self.steps)))

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "buckets": self.buckets.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.buckets.load_state_dict(state["buckets"])


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the ``k`` largest-magnitude entries of every rank (values + indices through ``all_gather``).

    With error feedback, what is not sent is added to the next step's bucket. With ``momentum`` the bucket first goes
    into this rank's velocity, and the velocity is what accumulates and is sent (see :class:`TopKCompression`). A
    non-finite bucket is selected first (so every rank receives the inf / NaN and skips the step alike) and leaves
    the residual and the velocity as they were.

    Example::
        >>> state = TopKState(TopKCompression(ratio=0.01), None, list(model.parameters()), device, CommCounter(), "all")
        >>> ddp_model.register_comm_hook(state, topk_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    state.buckets.observe(bucket)
    idx = bucket.index()
    buffer = bucket.buffer()
    config = state.config
    acc = buffer
    velocity = state.velocities.get(idx)
    # New tensors, never in place: a non-finite step restores the previous ones.
    if config.momentum > 0:
        acc = velocity * config.momentum + buffer if velocity is not None else buffer.clone()
        updated_velocity = acc
    if config.error_feedback:
        residual = state.residuals.get(idx)
        acc = acc + residual if residual is not None else acc
    k = state.k_for(buffer.numel())
    inf = float("inf")
    _, indices = torch.topk(acc.abs().nan_to_num(nan=inf, posinf=inf), k, sorted=False)
    values = acc[indices]
    if config.error_feedback or config.momentum > 0:
        finite = torch.isfinite(acc).all()
    if config.error_feedback:
        unsent = acc.index_fill(0, indices, 0)
        state.residuals[idx] = torch.where(finite, unsent, residual if residual is not None else 0.0)
    if config.momentum > 0:
        if config.momentum_masking:
            updated_velocity = updated_velocity.index_fill(0, indices, 0)
        state.velocities[idx] = torch.where(finite, updated_velocity, velocity if velocity is not None else 0.0)
    indices = indices.to(torch.int32 if buffer.numel() < 2**31 else torch.int64)
    all_values = values.new_empty(world * k)
    all_indices = indices.new_empty(world * k)
    # Both collectives are issued here, in the caller's thread, so every rank issues them in the same order.
    values_fut = dist.all_gather_into_tensor(all_values, values, group=group, async_op=True).get_future()
    indices_fut = dist.all_gather_into_tensor(all_indices, indices, group=group, async_op=True).get_future()
    state.counter.add(state.hop, nbytes(values) + nbytes(indices))
    if bucket.is_last():
        state.steps += 1

    def decompress(_: Any) -> Tensor:
        # Chained on a collective's own future, so a CUDA result keeps its stream semantics.
        values_fut.wait()
        buffer.zero_()
        # One rank at a time: a rank's indices are distinct, so each index_add_ is free of races (deterministic).
        for v, i in zip(all_values.view(world, k), all_indices.view(world, k)):
            buffer.index_add_(0, i.long(), v)
        return buffer.div_(world)

    return indices_fut.then(decompress)
