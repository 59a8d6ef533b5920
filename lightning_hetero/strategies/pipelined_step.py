"""A stage rank's training step in the hybrid layout: the pipeline's joined batch through the stages, weighted
exactly, its gradients set aside for Lightning's backward, its logs shared over the pipeline.

One step, on every rank of a pipeline alike:

1. the ranks join their slices of the global batch in stage order
   (:func:`~lightning_hetero.strategies.pipelined.gather_batch`);
2. the replica runs forward and backward of the joined batch (:meth:`PipelinedReplica.step`), each sample's loss
   weighted by :func:`~lightning_hetero.grad.weighting.loss_weight` ``(1, G)``, the weight a data-parallel rank's
   ``b_r`` samples get together: the stage groups then sum Σ_replicas (b / G) g
   (:class:`~lightning_hetero.grad.stage_sync.StageSync`);
3. the stage's gradients wait (:class:`~lightning_hetero.data.microbatch.PendingGrads`) while Lightning zeroes them
   and back-propagates the returned loss, which reaches no parameter, and are put back before its backward;
4. the last stage's ``self.log`` calls reach the other stage ranks and every rank logs them for the joined batch
   (:func:`~lightning_hetero.strategies.pipelined.share_logs`): the last stage for the replica, the others as a
   padding step; a value computed from another stage's parameters (a weight norm) counts nowhere on the pipeline.

Example::

    runner = PipelinedStep(replica, strategy.core.step, strategy.core.loaders, device, replicas=3)
    loss = runner.run(module, batch, batch_idx, accumulate=1)  # inside Lightning's training step
    runner.log_own_view(module)  # after it
"""

from typing import Any, Callable

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn

from lightning_hetero.data.microbatch import PendingGrads
from lightning_hetero.data.split import LoaderSplit
from lightning_hetero.strategies.step import StepState
from lightning_hetero.grad.weighting import loss_weight
from lightning_hetero.strategies.pipelined import PipelinedReplica, gather_batch, log_shared, own_view, share_logs


class PipelinedStep:
    """The training step of ``replica``'s stage rank (``replicas``: how many replicas the job trains)."""

    def __init__(self, replica: PipelinedReplica, step: StepState, loaders: LoaderSplit, device: torch.device,
                 replicas: int) -> None:
        self.replica = replica
        self.step = step
        self.loaders = loaders
        self.device = device
        self.replicas = replicas
        # What this rank logs after its step: its own view of the replica's (calls, joined batch size).
        self._after: tuple[list, int] = ([], 0)

    def hold_stage(self, optimizers: Any) -> None:
        """Before a training step: evaluation may have given this rank the whole model; training keeps its stage's."""
        replica = self.replica
        if replica.partition is not None:
            replica.holding.keep_only(replica.partition[replica.stage], optimizers)

    def _timed(self) -> Callable[..., Any]:
        # The pipeline's collectives are sync to the monitor, as the strategy's own are.
        monitor = self.step.monitor
        return monitor.timed_collective if monitor is not None else (lambda collective, *a: collective(*a))

    def run(self, module: nn.Module, batch: Any, batch_idx: int, accumulate: int) -> Tensor:
        """The replica's step on this rank; the returned loss (the replica's mean on the last stage, else 0) is for
        Lightning's backward, which reaches no parameter."""
        replica, timed = self.replica, self._timed()
        sampler = self.loaders.train_sampler
        sizes = sampler.rank_sizes_at(batch_idx) if sampler is not None else None
        real = sizes is None or sizes[replica.ranks[replica.stage]] > 0
        joined, any_real = timed(gather_batch, batch, real, replica.group, self.device)
        # Per sample: a data-parallel rank's b_r samples weigh loss_weight(b_r, G) together.
        weight = loss_weight(1, sum(sizes) if sizes else self.replicas, world_size=1)
        weight = weight * float(any_real) / accumulate
        params = replica.stage_parameters() if replica.partition is not None else []
        held = [p.grad for p in params]  # earlier accumulation steps' gradients, set aside while the stage runs
        for p in params:
            p.grad = None
        loss, calls = replica.step(joined, batch_idx, weight)
        params = replica.stage_parameters()
        held = held if len(held) == len(params) else [None] * len(params)
        self.step.pending_grads = PendingGrads(params, [p.grad for p in params])
        for p, g in zip(params, held):
            p.grad = g
        self._log(module, calls, extract_batch_size(joined), any_real)
        value = loss if loss is not None else torch.zeros((), device=self.device)
        return value.detach().clone().requires_grad_()

    def _log(self, module: nn.Module, calls: list, size: int, any_real: bool) -> None:
        """The replica's logs, for its joined batch (an epoch mean weights each step by it); the other stage ranks
        count nowhere, their unsynced values logged after the step, as the pipelined validation does."""
        replica = self.replica
        shared, uncounted = self._timed()(share_logs, calls, replica.ranks[-1], replica.group, "training_step",
                                          replica.uncounted if replica.is_last else ())
        # A value computed from another stage's parameters (placeholders here: a weight norm) counts nowhere on the
        # pipeline; the data-parallel ranks, which hold the whole model, give it.
        counted = [call for call in shared if call[0] not in uncounted]
        later = own_view(counted, mirrors=any_real and not replica.is_last)
        log_shared(module, [call for call in counted if call not in later], size, self.device)
        with self.step.weighing(0.0):
            log_shared(module, [call for call in shared if call[0] in uncounted], 0, self.device)
        self._after = (later, size)

    def log_own_view(self, module: nn.Module) -> None:
        """After the step: this rank's own view of its replica's step (`own_view`), logged past its padding step."""
        (later, size), self._after = self._after, ([], 0)
        log_shared(module, later, size, self.device)
