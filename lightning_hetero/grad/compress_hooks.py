"""The averaging DDP comm hooks: full precision, fp16 / bf16 cast, top-k, and the two-level (hierarchical) exchange.

Each is a tiny function of ``(state, bucket)`` with a state object, registered with ``register_comm_hook`` (as torch's
``ddp_comm_hooks/default_hooks.py``); PowerSGD has its own module, :mod:`~lightning_hetero.grad.powersgd_hook`. Every
hook *averages*: the bucket arrives already scaled by b_r · W / G (each micro-step's loss carried its weight, see
weighting.py), so the residuals of error feedback hold weighted gradients and dividing by W gives the global mean.
"""

from contextlib import nullcontext
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_hetero.grad.bucket_state import BucketStates, CommCounter, elementwise_segments, nbytes
from lightning_hetero.grad.compression_config import TopKCompression


class FlatBucket:
    """A flat gradient tensor as the hooks read a DDP bucket (``dist.GradBucket``: its buffer, the step's only
    bucket, and the parameters whose gradients it holds, in order): to run a hook on gradients no DDP bucket holds
    (the hybrid layout's per-stage exchange)."""

    def __init__(self, buffer: Tensor, params: Sequence[Tensor] = ()) -> None:
        self._buffer, self._params = buffer, list(params)

    def buffer(self) -> Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[Tensor]:
        return self._params

    def gradients(self) -> list[Tensor]:
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views


class CastState:
    """The process group, the wire dtype (``"fp16"`` / ``"bf16"``) and where the bytes are counted."""

    def __init__(self, dtype: str, process_group: Optional[dist.ProcessGroup], counter: CommCounter, hop: str) -> None:
        self.dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
        self.process_group = process_group
        self.counter = counter
        self.hop = hop


def allreduce_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's averaging all-reduce hook, counted (``state.dtype`` unused).

    Example::
        >>> ddp_model.register_comm_hook(CastState("fp16", None, CommCounter(), "all"), allreduce_hook)
    """
    state.counter.add(state.hop, nbytes(bucket.buffer()))
    return default_hooks.allreduce_hook(state.process_group, bucket)


def cast_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16 / bf16 compress hook, counted.

    Example::
        >>> ddp_model.register_comm_hook(CastState("bf16", None, CommCounter(), "all"), cast_hook)
    """
    state.counter.add(state.hop, bucket.buffer().numel() * state.dtype.itemsize)
    hook = default_hooks.fp16_compress_hook if state.dtype == torch.float16 else default_hooks.bf16_compress_hook
    return hook(state.process_group, bucket)


class TopKState:
    """Residuals and momentum-correction velocities (per bucket, checkpointed per parameter) and the step counter of
    the ratio warm-up."""

    def __init__(self, config: TopKCompression, process_group: Optional[dist.ProcessGroup],
                 params: Sequence[Tensor], device: torch.device, counter: CommCounter, hop: str) -> None:
        self.config = config
        self.process_group = process_group
        self.residuals: dict[int, Tensor] = {}
        self.velocities: dict[int, Tensor] = {}
        self.buckets = BucketStates(params, device, {"residual": (lambda: self.residuals, elementwise_segments, True),
                                                     "velocity": (lambda: self.velocities, elementwise_segments, True)})
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
    if config.momentum > 0:
        # New tensors, never in place: a non-finite step restores the previous ones
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
        # Chained on a collective's own future, so a CUDA result keeps its stream semantics
        values_fut.wait()
        buffer.zero_()
        # One rank at a time: a rank's indices are distinct, so each index_add_ is free of races (deterministic).
        for v, i in zip(all_values.view(world, k), all_indices.view(world, k)):
            buffer.index_add_(0, i.long(), v)
        return buffer.div_(world)

    return indices_fut.then(decompress)


class HierarchicalState:
    """Full-precision sum inside this rank's group; ``inner_hook`` among the group leaders; broadcast back."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        leader: int,
        leaders: Optional[dist.ProcessGroup],
        num_leaders: int,
        world_size: int,
        inner_hook: Callable,
        inner_state: Any,
        counter: CommCounter,
        pacer: Any = None,
    ) -> None:
        self.group = group
        self.leader = leader
        self.leaders = leaders
        self.num_leaders = num_leaders
        self.world_size = world_size
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.counter = counter
        # An emulated inter-host link (lab.link_pacing.LinkPacer) on the leaders' hop, or None
        self.pacer = pacer
        # CUDA: the side stream the two-level exchange runs on
        self.stream: Optional[torch.cuda.Stream] = None


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average over all ranks with the inner (compressed) hook on the slow hop only.

    Group sums S_g are scaled by L / W before the inner hook averages over the L leaders: Σ_g S_g / W, the right
    mean for groups of any size. Each step waits for the previous one before issuing the next collective, so the
    order of collectives on every group is the same on all its ranks (with NCCL the waits are stream waits). On CUDA
    the three steps run on a side stream, so the backward pass goes on while a bucket crosses the hosts.

    Example::
        >>> counter = CommCounter()
        >>> inner = CastState("bf16", leaders_group, counter, "inter")
        >>> state = HierarchicalState(host_group, host_members[0], leaders_group, len(leader_ranks), world_size,
        ...                           cast_hook, inner, counter)
        >>> ddp_model.register_comm_hook(state, hierarchical_hook)
    """
    buffer = bucket.buffer()
    stream = None
    if buffer.is_cuda:
        if state.stream is None:
            state.stream = torch.cuda.Stream(device=buffer.device)
        stream = state.stream
        # The bucket's gradients are ready there
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        state.counter.add("intra", nbytes(buffer))
        dist.all_reduce(buffer, group=state.group)
        if state.leaders is not None:
            buffer.mul_(state.num_leaders / state.world_size)
            sent = state.counter.pending.get("inter", 0)
            out = state.inner_hook(state.inner_state, bucket).wait()
            if out.data_ptr() != buffer.data_ptr():
                buffer.copy_(out)
            if state.pacer is not None:
                state.pacer.transfer(state.counter.pending.get("inter", 0) - sent)
                if bucket.is_last():
                    # Before the broadcast: the group waits for what crossed the slow link
                    state.pacer.settle()
        state.counter.add("intra", nbytes(buffer))
        dist.broadcast(buffer, src=state.leader, group=state.group)
        # A CUDA result needs a device-aware future: set here, it records the side stream, which DDP then waits on.
        fut: torch.futures.Future[Tensor] = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        fut.set_result(buffer)
    return fut

