"""The hybrid layout's stage exchange compressed between hosts: what ``stage_compression`` takes, and the hook the
hosts' leaders run on a stage's sum.

``stage_compression`` takes what ``HeteroDDPStrategy(compression=...)`` takes for a cast, PowerSGD or top-k (a name
or the config dataclass), always on the hop between hosts: each stage group sums in full precision inside a host,
the hosts' leaders run the compressed hook on their sums, and each leader broadcasts the result inside its host
(:class:`~lightning_hetero.grad.stage_sync.StageSync`). The hooks and their state are the data-parallel strategy's
(:mod:`~lightning_hetero.grad.compress_hooks`, :mod:`~lightning_hetero.grad.powersgd_hook`), one state per stage
(its own error feedback, PowerSGD's P and Q), built the first time the stage is exchanged.

Example::
    >>> HeteroHybridStrategy(pipelines=[[2, 3]], stage_compression=TopKCompression(ratio=0.05, hierarchical=True))
    >>> HeteroHybridStrategy(pipelines=[[2, 3]], stage_compression="powersgd")
"""

from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hetero.config import check
from lightning_hetero.grad.bucket_state import CommCounter, nbytes
from lightning_hetero.grad.compress_hooks import CastState, FlatBucket, TopKState, cast_hook, topk_hook
from lightning_hetero.grad.compression_config import (CastCompression, NoCompression, PowerSGDCompression,
                                                      TopKCompression)
from lightning_hetero.grad.powersgd_hook import PowerSGDHookState, powersgd_hook

StageCompressionName = Literal["none", "fp16", "bf16", "powersgd", "topk"]
StageCompressionArg = Union[StageCompressionName, NoCompression, CastCompression, PowerSGDCompression, TopKCompression]
StageCompressionConfig = Union[CastCompression, PowerSGDCompression, TopKCompression]


def parse_stage_compression(value: Any) -> Optional[StageCompressionConfig]:
    """The typed config for ``stage_compression`` (``None``: exact); a name means that method between hosts. A config
    must say ``hierarchical=True`` and ``group_by="host"``: the stage exchange is compressed between hosts only."""
    field = "stage_compression"
    if value is None or value == "none" or isinstance(value, NoCompression):
        return None
    if value in ("fp16", "bf16"):
        return CastCompression(dtype=value, hierarchical=True)
    if value == "powersgd":
        return PowerSGDCompression(hierarchical=True)
    if value == "topk":
        return TopKCompression(hierarchical=True)
    if not isinstance(value, (CastCompression, PowerSGDCompression, TopKCompression)):
        raise ValueError(
            f"`{field}`={value!r} must be None, 'none', 'fp16', 'bf16', 'powersgd', 'topk', or a NoCompression / "
            "CastCompression / PowerSGDCompression / TopKCompression (the stage exchange has no 'auto').")
    check(field, "hierarchical", value.hierarchical, value.hierarchical is True,
          "True: the stage exchange is compressed only between hosts (full precision inside a host)")
    check(field, "group_by", value.group_by, value.group_by == "host",
          "'host': the stage exchange is compressed between hosts (device classes are not its groups)")
    return value


class LeadersState:
    """A stage's compressed exchange among the hosts' leaders: the config, the leaders' group, where bytes are counted,
    and the hook state (top-k's residuals, PowerSGD's error / P / Q), built for the stage's parameters on first use."""

    def __init__(self, config: Union[PowerSGDCompression, TopKCompression], group: Optional[dist.ProcessGroup],
                 counter: CommCounter) -> None:
        self.config = config
        self.group = group
        self.counter = counter
        self.hook: Callable = powersgd_hook if isinstance(config, PowerSGDCompression) else topk_hook
        self.state: Any = None

    def state_for(self, bucket: FlatBucket, device: torch.device) -> Any:
        if self.state is None:
            kind = PowerSGDHookState if isinstance(self.config, PowerSGDCompression) else TopKState
            self.state = kind(self.config, self.group, bucket.parameters(), device, self.counter, "inter")
        return self.state


def leaders_hook(state: LeadersState, bucket: FlatBucket) -> torch.futures.Future[Tensor]:
    """Average a stage's buffer over the leaders: its gradients through the compressed hook, its presence flags (one
    per parameter, at the end) exactly, in full precision (top-k would drop some, PowerSGD blur them).

    Example::
        >>> state = HierarchicalState(host_group, leader, leaders_group, num_leaders, members, leaders_hook,
        ...                           LeadersState(TopKCompression(hierarchical=True), leaders_group, counter), counter)
        >>> hierarchical_hook(state, FlatBucket(flat, params)).wait()
    """
    buffer, params = bucket.buffer(), bucket.parameters()
    grads, flags = FlatBucket(buffer[:-len(params)], params), buffer[-len(params):]
    # Issued first on every leader: the collectives on the leaders' group keep one order.
    work = dist.all_reduce(flags, group=state.group, async_op=True)
    state.counter.add("inter", nbytes(flags))
    out = state.hook(state.state_for(grads, buffer.device), grads).wait()
    if out.data_ptr() != grads.buffer().data_ptr():
        grads.buffer().copy_(out)
    work.wait()
    flags.div_(dist.get_world_size(state.group))
    fut: torch.futures.Future[Tensor] = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    fut.set_result(buffer)
    return fut


def leaders_exchange(config: StageCompressionConfig, group: Optional[dist.ProcessGroup],
                     counter: CommCounter) -> tuple[Callable, Any]:
    """The hook and state the leaders of a stage group spanning hosts run (the inner hook of
    :func:`~lightning_hetero.grad.compress_hooks.hierarchical_hook`): a cast of the whole buffer (the presence flags
    are rounded with it, scaled by L / W, but only read against 0.5), or :func:`leaders_hook`."""
    if isinstance(config, CastCompression):
        return cast_hook, CastState(config.dtype, group, counter, "inter")
    return leaders_hook, LeadersState(config, group, counter)
