"""One strategy's training step state: this batch's immutable :class:`StepContext` (this rank's (b, G), per-sample
weights), micro-batches, the batch-size weighted mean of ``reduce``.

:class:`StepState` is owned by :class:`~lightning_hetero.strategies.core.HeteroCore`. At every training batch it
reads the split the sampler used for it (hence the plan's schedule, replica-aware: a pipeline counts as one replica)
and builds a :class:`StepContext` that nothing changes afterwards; a strategy turns its ``(b, G)`` into exact
gradient weighting on each micro-step's loss (:func:`~lightning_hetero.grad.weighting.loss_weight`, or the factor of
a DDP comm hook's :class:`~lightning_hetero.grad.weighting.WeightingState`); inside a step, means over ranks are
weighted by each rank's batch size.

Example::

    context = step.on_train_batch_start(batch_idx=0)  # StepContext(samples=6, total=8): 6 of the 8 samples here
    loss * loss_weight(*context.share, world_size=2)  # lightning_hetero.grad.weighting.loss_weight
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hetero.data.microbatch import PendingGrads, chunk_sizes, run_micro_batches
from lightning_hetero.data.split import LoaderSplit
from lightning_hetero.lab.setup import LabSetup
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.plan.state import ShareState
from lightning_hetero.resilience.hooks import ResilienceHooks
from lightning_hetero.view import StrategyView


@dataclass(frozen=True)
class StepContext:
    """One training batch as this rank counts it, built once when the batch starts.

    Args:
        samples: this rank's samples (or token weight) in the batch, as its replica counts them: a pipeline's last
            stage its replica's joined batch, its other stage ranks 0.
        total: all ranks' samples (or token weight) in the batch, G.
        weights: per sample of this rank's slice (micro-batches with costs), or ``None``: each sample weighs 1.
    """

    samples: float
    total: float
    weights: Optional[tuple[float, ...]] = None

    @property
    def share(self) -> tuple[float, float]:
        """``(b, G)``."""
        return self.samples, self.total


class StepState:
    """This rank's current :class:`StepContext`, its micro-batches, and the batch-size weighted mean of ``reduce``."""

    def __init__(self, view: StrategyView, loaders: LoaderSplit, shares: ShareController, share_state: ShareState,
                 lab: LabSetup, resilience: ResilienceHooks) -> None:
        self.view = view
        self.loaders = loaders
        self.shares = shares
        self.share_state = share_state
        self.lab = lab
        self.resilience = resilience
        # The HeteroMonitor timing in-step collectives, while it watches.
        self.monitor: Optional[Any] = None
        self.pending_grads: Optional[PendingGrads] = None
        # The current training batch (None without a split).
        self.context: Optional[StepContext] = None
        # Set while a step runs, for `reduce`.
        self.logging_batch_size: Optional[float] = None

    @property
    def share(self) -> Optional[tuple[float, float]]:
        """(b, G) of the current training batch; ``None`` without a split."""
        return self.context.share if self.context is not None else None

    def on_train_batch_start(self, batch_idx: int) -> Optional[StepContext]:
        """This batch's :class:`StepContext` (``None`` without a split)."""
        # Resumed mid-epoch: the generators as they stood after the saved step.
        self.resilience.rng.apply()
        self.resilience.enter("forward/backward", batch_idx)
        sampler = self.loaders.train_sampler
        if sampler is None:
            self.context = None
            self.logging_batch_size = None
            return None
        local, total = sampler.sizes_at(batch_idx)
        weights = None
        # Micro-batch shares of the loss.
        if sampler.costs is not None and self.loaders.micro_limit is not None:
            costs = tuple(sampler.batch_shares(batch_idx).costs[self.view.global_rank])
            weights = costs if sampler.weight_by_cost else (1.0,) * len(costs)
        self.context = StepContext(self._replica_share(batch_idx, local), total, weights)
        # Rebalancing measures the unit the split balances: tokens/s or samples/s.
        work = sampler.sizes_at(batch_idx, by_cost=sampler.balance_by_cost)[0] if sampler.costs is not None else local
        # The position in the epoch first (checked after a resume); a share change may then be keyed to a later batch.
        self.share_state.on_train_batch_start(batch_idx)
        self.shares.on_train_batch_start(batch_idx, work)
        return self.context

    def _replica_share(self, batch_idx: int, local: float) -> float:
        """This rank's samples as its replica counts them: a pipeline's last stage logs and weighs for the replica's
        joined batch, its other stage ranks count nowhere (the plan's ``replicas``)."""
        rank, replicas = self.view.global_rank, self.loaders.plan.replicas or ()
        replica = next((r for r in replicas if rank in r), (rank,))
        if len(replica) == 1:
            return local
        assert self.loaders.train_sampler is not None
        sizes = self.loaders.train_sampler.rank_sizes_at(batch_idx)
        return sum(sizes[r] for r in replica) if rank == replica[-1] else 0

    def train_step_size(self) -> Optional[float]:
        """This rank's real samples in the current training batch (the monitor's count)."""
        return None if self.share is None else self.share[0]

    @contextmanager
    def step(self, batch_size: Optional[float]) -> Iterator[None]:
        """Around a step: `reduce` weights means by this rank's ``batch_size``; the emulator's caps apply."""
        self.logging_batch_size = batch_size
        try:
            with self.lab.emulated_work():
                yield
        finally:
            self.logging_batch_size = None

    @contextmanager
    def weighing(self, weight: Optional[float]) -> Iterator[None]:
        """Inside a step, `reduce` weights this rank's values by ``weight`` instead (0: they count nowhere)."""
        before, self.logging_batch_size = self.logging_batch_size, weight
        try:
            yield
        finally:
            self.logging_batch_size = before

    # -- micro-batches ---------------------------------------------------------------------------------------------
    def micro_batch_sizes(self, batch_size: Optional[int]) -> Optional[list[int]]:
        """The micro-batches of this rank's share, or ``None`` when it runs whole."""
        limit = self.loaders.micro_limit
        if not limit:
            return None
        sizes = chunk_sizes(batch_size or 1, limit, self.loaders.plan.min_share)
        return sizes if len(sizes) > 1 else None

    def run_micro_batches(self, sizes: list[int], batch: Any, forward: Callable[[Any], Any],
                          backward: Callable[[Tensor], Any], no_sync: Callable[[], Any]) -> Any:
        """The first micro-batches forward and backward without sync; the last one's backward is Lightning's."""
        module = self.view.lightning_module
        assert module is not None
        weights = self.context.weights if self.context is not None else None
        output, self.pending_grads = run_micro_batches(
            batch, sizes, list(weights or [1.0] * sum(sizes)), forward=forward, backward=backward,
            no_sync=no_sync, params=[p for p in module.parameters() if p.requires_grad], module=module,
        )
        return output

    # -- backward and optimizer step -------------------------------------------------------------------------------
    def before_backward(self, loss: Tensor) -> None:
        # After Lightning zeroed the gradients: the earlier micro-batches' gradients go back in before the last one's.
        if self.pending_grads is not None:
            pending, self.pending_grads = self.pending_grads, None
            pending.restore()
        self.shares.backward_started(loss)

    def after_backward(self) -> None:
        if self.lab.emulation is not None:
            self.lab.emulation.backward_returned()
        self.resilience.enter("optimizer")

    def after_optimizer_step(self) -> None:
        # Lightning counts the step only after this hook; next: the following batch is loaded.
        self.resilience.enter("data", next_step=True)

    # -- the weighted mean -----------------------------------------------------------------------------------------
    def reduce_weighted_mean(self, tensor: Tensor, group: Optional[Any]) -> Tensor:
        """A mean over ranks weighted by each rank's batch size (ranks see unequal batches)."""
        values = tensor.detach().to(torch.float64 if tensor.device.type == "cpu" else torch.float32).reshape(-1)
        weight = float(self.logging_batch_size or 0)
        # Filled on the device: a tensor made from a Python list would be copied from the host, which waits for the
        # CUDA stream (a synchronization every logged step).
        packed = torch.cat([values * weight, values.new_full((1,), weight)])
        # Waiting for other ranks is not this rank's compute (rebalancing, the CPU emulator); it is sync (monitor).
        emulator = self.lab.emulation
        began = emulator.collective_began() if emulator is not None else None
        with self.shares.excluded():
            if self.monitor is None:
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            else:
                self.monitor.timed_collective(dist.all_reduce, packed, op=dist.ReduceOp.SUM, group=group)
        if began is not None:
            emulator.collective_ended(began)
        mean = packed[:-1] / packed[-1].clamp_min(1e-12)
        return mean.reshape(tensor.shape).to(tensor.dtype)
