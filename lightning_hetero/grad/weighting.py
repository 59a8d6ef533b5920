"""Exact capacity weighting of gradients, inside DDP's communication hook.

With unequal per-rank batches, the gradient of the mean loss over the global batch is

    g = Σ_r (b_r / G) · g_r        (g_r: rank r's gradient of its own mean loss over b_r samples)

while plain DDP computes (1/W) Σ_r g_r, which over-weights the small batches of slow ranks. The hook here scales
each rank's bucket by b_r / G before a sum all-reduce. Any torch comm hook that *averages* (all of torch's
``ddp_comm_hooks`` do) composes: the bucket is scaled by b_r · W / G and the inner hook divides by W.

With gradient accumulation the hook fires once per optimizer step, on the sum of the micro-steps' gradients
(Lightning divides each by the number of micro-steps); the weight is then Σ_k b_rk / Σ_k G_k over the window,
exact whenever the micro-batches are full.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def loss_weight(local_samples: float, global_samples: float, world_size: int) -> float:
    """Factor for this rank's mean loss so that an average over ``world_size`` ranks is the global batch's mean:
    b_r · W / G (DDP's built-in all-reduce, FSDP's reduce-scatter). A step without samples anywhere keeps the loss;
    a rank with none (a padding step) contributes nothing.

    Example::

        loss * loss_weight(6, 8, world_size=2)  # rank 0 trains on 6 of the 8 samples: its mean loss times 1.5
    """
    if global_samples <= 0:
        return 1.0
    return local_samples * world_size / global_samples


class WeightingState:
    """This rank's share of the current optimizer step, plus the hook it hands the weighted bucket to.

    ``inner_hook`` is any averaging comm hook (``None``: a plain sum all-reduce on ``process_group``).
    ``bucket_observers`` are called as each bucket enters the hook: DDP calls it once the bucket's gradients are all
    accumulated, in bucket order, so the last call of a backward marks where the local backward ended (the
    monitor's timer reads it there at no extra Python call inside the backward).
    """

    def __init__(
        self,
        world_size: int,
        process_group: Optional[dist.ProcessGroup] = None,
        inner_hook: Optional[CommHook] = None,
        inner_state: Any = None,
    ) -> None:
        self.world_size = world_size
        self.process_group = process_group
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.local_samples = 0
        self.global_samples = 0
        self.bucket_observers: list[Callable[[], None]] = []

    def observe(self, observer: Callable[[], None], observe: bool = True) -> None:
        """Call ``observer`` as each bucket enters the hook (``observe=False``: stop)."""
        if observe and observer not in self.bucket_observers:
            self.bucket_observers.append(observer)
        elif not observe and observer in self.bucket_observers:
            self.bucket_observers.remove(observer)

    def add_step(self, local_samples: int, global_samples: int) -> None:
        """Count one micro-step's samples (this rank's, all ranks') into the current optimizer step."""
        self.local_samples += local_samples
        self.global_samples += global_samples

    def reset(self) -> None:
        """Start a new optimizer step (called after each optimizer step)."""
        self.local_samples = 0
        self.global_samples = 0

    @property
    def weight(self) -> float:
        """b_r / G of the current optimizer step; 1 / W before any step was counted (plain DDP averaging)."""
        if self.global_samples == 0:
            return 1.0 / self.world_size
        return self.local_samples / self.global_samples


def weighted_allreduce_hook(state: WeightingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scale this rank's gradient by b_r / G and sum over ranks, or hand it to an averaging inner hook.

    Example::
        >>> state = WeightingState(world_size=dist.get_world_size())
        >>> ddp_model.register_comm_hook(state, weighted_allreduce_hook)
        >>> # before each backward: state.add_step(local_batch, global_batch); after each optimizer step: reset()
    """
    for observe in state.bucket_observers:
        observe()
    buffer = bucket.buffer()
    if state.inner_hook is None:
        buffer.mul_(state.weight)
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        # The all-reduce works in place, so the buffer is the result (a rehearsal's fake group's future holds none).
        return (
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
            .get_future()
            .then(lambda fut: buffer)
        )
    buffer.mul_(state.weight * state.world_size)
    return state.inner_hook(state.inner_state, bucket)
