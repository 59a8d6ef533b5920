"""The plain comm hooks, as torch's ``default_hooks.py``: a counted all-reduce, a counted fp16 / bf16 cast, and the
two-level exchange that runs any inner hook among group leaders only; plus the byte counter they all add to.

Every hook here (and in :mod:`~lightning_hetero.grad.powersgd_hook`, :mod:`~lightning_hetero.grad.topk_hook`) is an
*averaging* hook: the weighting hook (:mod:`~lightning_hetero.grad.weighting`) hands it the bucket already scaled by
b_r · W / G, so dividing the sum by W gives the global mean.
"""

from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

def nbytes(tensor: Tensor) -> int:
    """The bytes ``tensor`` holds."""
    return tensor.numel() * tensor.element_size()


class CommCounter:
    """Bytes this rank handed to collectives since the last optimizer step, by hop ("all", "intra", "inter")."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def add(self, hop: str, nbytes: int) -> None:
        self.pending[hop] = self.pending.get(hop, 0) + nbytes

    def take(self) -> dict[str, int]:
        out, self.pending = self.pending, {}
        return out



class CastState:
    """The process group a plain or cast all-reduce runs on (``None``: all ranks), and where its bytes are counted."""

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
        # An emulated inter-host link (link_pacing.LinkPacer) on the leaders' hop, or None.
        self.pacer = pacer
        # CUDA: the side stream the two-level exchange runs on.
        self.stream: Optional[torch.cuda.Stream] = None


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average over all ranks with the inner (compressed) hook on the slow hop only.

    Group sums S_g are scaled by L / W before the inner hook averages over the L leaders: Σ_g S_g / W, the right
    mean for groups of any size. Each step waits for the previous one before issuing the next collective, so the
    order of collectives on every group is the same on all its ranks (with NCCL the waits are stream waits). On CUDA
    the three steps run on a side stream, so the backward pass goes on while a bucket crosses the hosts.

    Example::
        >>> inner = CastState("bf16", groups.leaders["host"], counter, "inter")
        >>> state = HierarchicalState(groups.groups["host"], members[0], groups.leaders["host"], num_leaders=2,
        ...                           world_size=4, inner_hook=cast_hook, inner_state=inner, counter=counter)
        >>> ddp_model.register_comm_hook(state, hierarchical_hook)
    """
    buffer = bucket.buffer()
    stream = None
    if buffer.is_cuda:
        if state.stream is None:
            state.stream = torch.cuda.Stream(device=buffer.device)
        stream = state.stream
        # The bucket's gradients are ready on the current stream.
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
                    # Before the broadcast: the group waits for what crossed the slow link.
                    state.pacer.settle()
        state.counter.add("intra", nbytes(buffer))
        dist.broadcast(buffer, src=state.leader, group=state.group)
        # A CUDA result needs a device-aware future: set here, it records the side stream, which DDP then waits on.
        fut: torch.futures.Future[Tensor] = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        fut.set_result(buffer)
    return fut
