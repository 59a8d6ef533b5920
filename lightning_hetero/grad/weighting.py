"""Exact capacity weighting of gradients, inside DDP's communication hook.

With unequal per-rank batches, the gradient of the mean loss over the global batch is

    g = Σ_r (b_r / G) · g_r        (g_r: rank r's gradient of its own mean loss over b_r samples)

while plain DDP computes (1/W) Σ_r g_r, which over-weights the small batches of slow ranks. Each micro-step's loss is
multiplied by its own weight (:attr:`WeightingState.loss_factor`): b_r / G when the hook here sums over ranks, or
b_r · W / G when it hands the bucket to an averaging torch comm hook (all of torch's ``ddp_comm_hooks`` average).

The weight goes on the loss, not on the bucket, because of gradient accumulation: the hook fires once per optimizer
step, on the sum of the micro-steps' gradients, and one factor for that sum is exact only when every micro-step has
the same b_rk / G_k. A window holding an epoch's short last batch (split unlike a full one, or a padding step) or a
share change does not.
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


def scaled(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """``loss * factor``, skipped when the factor is 1 (equal shares): the same value and gradient, one kernel and one
    autograd node less per micro-step."""
    return loss if factor == 1.0 else loss * factor


class WeightingState:
    """This rank's gradient weight in the current micro-step, plus the hook it hands the gradient to.

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
        # b_r / G of the current batch; None until the first is counted. It holds for every backward of the batch
        # (manual optimization may step several optimizers in one) until the next batch's replaces it.
        self.step_weight: Optional[float] = None
        self.bucket_observers: list[Callable[[], None]] = []

    def observe(self, observer: Callable[[], None], observe: bool = True) -> None:
        """Call ``observer`` as each bucket enters the hook (``observe=False``: stop)."""
        if observe and observer not in self.bucket_observers:
            self.bucket_observers.append(observer)
        elif not observe and observer in self.bucket_observers:
            self.bucket_observers.remove(observer)

    def add_step(self, local_samples: float, global_samples: float) -> None:
        """Count the next micro-step (a training batch): this rank's samples, all ranks' (its weight). A micro-step
        without samples anywhere is averaged, as plain DDP."""
        self.step_weight = local_samples / global_samples if global_samples > 0 else 1.0 / self.world_size

    @property
    def loss_factor(self) -> float:
        """What the current micro-step's loss is multiplied by: b_r / G for the hook's sum, b_r · W / G for an
        averaging inner hook; 1 before any step was counted (the hook then averages, as plain DDP)."""
        if self.step_weight is None:
            return 1.0
        return self.step_weight * self.world_size if self.inner_hook is not None else self.step_weight


def weighted_allreduce_hook(state: WeightingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum the weighted gradients over ranks, or hand them to an averaging inner hook.

    Example::
        >>> state = WeightingState(world_size=dist.get_world_size())
        >>> ddp_model.register_comm_hook(state, weighted_allreduce_hook)
        >>> # each micro-step: state.add_step(local_batch, global_batch); (loss * state.loss_factor).backward()
    """
    for observe in state.bucket_observers:
        observe()
    buffer = bucket.buffer()
    if state.inner_hook is None:
        if state.step_weight is None:  # nothing weighted the losses: average, as plain DDP
            buffer.div_(state.world_size)
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        # The all-reduce works in place, so the buffer is the result (a rehearsal's fake group's future holds none).
        return (
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
            .get_future()
            .then(lambda fut: buffer)
        )
    return state.inner_hook(state.inner_state, bucket)
