"""Where a stage rank of the hybrid layout evaluates: through its pipeline, its device holding its own stage's
parameters alone (validation during a fit, with ``pipelined_evaluation=True``), or as a data-parallel replica
holding the whole model (test, predict, ``trainer.validate``, the end of training, and validation without the option:
the other stages' parameters re-broadcast from the ranks that train them).

A pipelined validation step, on every rank of a pipeline alike:

1. the pipeline's ranks join their validation slices in stage order (a padding slice adds nothing), as training
   joins its batches (:func:`~lightning_hetero.strategies.pipelined.gather_batch`): the pipeline evaluates the
   union of its ranks' shares, one replica's; where every slice is padding, the first stage's slice runs, counting
   nowhere;
2. the joined batch runs forward through the stages (a forward-only schedule of training's micro-batch count) and
   the last stage runs the user's ``validation_step`` on the whole joined batch, ``self(...)`` returning the
   pipeline's output (:meth:`~lightning_hetero.strategies.pipelined.PipelinedReplica.evaluate`);
3. its ``self.log`` calls reach the pipeline's other ranks, and every rank of the pipeline logs them: the last stage
   weighted by the joined batch's samples (``batch_size``, unless the user's call names one), the other stage ranks
   as a padding step (weight 0, :func:`~lightning_hetero.observe.metrics.discard_padding_step`). A ``sync_dist``
   mean is then one device's over the evaluation set, and every rank logs the same keys (no collective is left
   unmatched). An unsynced value is each rank's own mean: on every stage rank the replica's (the other stage ranks
   log it after the padding step, :func:`~lightning_hetero.strategies.pipelined.own_view`).

Before validation, rank 0's buffers reach every rank, as for whole-model evaluation (no DDP wrapper re-syncs them);
no parameter is re-broadcast. Data-parallel ranks evaluate as before.

Example (the strategy owns one, built once its layout is known, and calls it from its own overrides)::

    evaluation = StageEvaluation(replica, sync, pipelined=True)
    evaluation.before_validation(module, device)  # in on_validation_start: collective over all ranks
    if evaluation.in_pipeline(module):  # in validation_step
        output = evaluation.validation_step(module, device, args, kwargs, strategy._evaluation_step, precision,
                                            resilience)
"""

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.data import extract_batch_size

import lightning_hetero._compat as _compat
from lightning_hetero.grad.stage_sync import StageSync, broadcast_buffers
from lightning_hetero.observe.metrics import evaluation_padding, step_indices
from lightning_hetero.resilience.hooks import ResilienceHooks
from lightning_hetero.strategies.lifecycle import StepRuns
from lightning_hetero.strategies.pipelined import (PipelinedReplica, gather_batch, log_shared, own_view,
                                                   share_logs)

# The strategy's context around an evaluation step (`HeteroLifecycle._evaluation_step`): phase, loaders' name,
# the step's arguments, what it runs; yields whether it is a padding step.
EvaluationStep = Callable[[str, str, Sequence[Any], Mapping[str, Any], Optional[StepRuns]],
                          AbstractContextManager[bool]]


class StageEvaluation:
    """A rank's evaluation in the hybrid layout (see the module docstring), owned by the strategy: its overrides of
    ``on_validation_start`` / ``on_test_start`` / ``on_predict_start`` / ``on_train_end`` and ``validation_step``
    call it. ``replica`` is this rank's pipeline stage (``None`` on a data-parallel rank), ``sync`` the job's stage
    groups, ``pipelined`` the constructor's ``pipelined_evaluation``."""

    def __init__(self, replica: Optional[PipelinedReplica], sync: StageSync, pipelined: bool) -> None:
        self.replica, self.sync, self.pipelined = replica, sync, pipelined

    def in_pipeline(self, module: LightningModule) -> bool:
        """Whether this job's validation runs through its pipelines now (the same answer on every rank)."""
        trainer = _compat.trainer_of(module)
        return self.pipelined and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    # -- the whole model where every rank needs it ------------------------------------------------------------------
    def gather_model(self, module: LightningModule, device: torch.device) -> None:
        """Every rank holds the whole model: a stage rank's other stages from the ranks that train them, and every
        buffer from rank 0 (a data-parallel rank: it ran every stage's buffers). Collective over all ranks."""
        if self.replica is not None:
            self.replica.holding.hold_whole()
        partition = self.replica.partition if self.replica is not None else None
        if self.sync.share_partition_once_split(partition, module, device):
            self.sync.broadcast_params(module)
        broadcast_buffers(module, src=0)

    def hold_own_stage(self, module: LightningModule) -> None:
        """A stage rank's device keeps its stage's parameters alone (once the split is known: else the first trace
        releases the others), every rank rank 0's buffers. Collective over all ranks."""
        replica = self.replica
        if replica is not None and replica.partition is not None:
            replica.holding.keep_only(replica.partition[replica.stage], replica.optimizers)
        broadcast_buffers(module, src=0)

    def before_validation(self, module: LightningModule, device: torch.device) -> None:
        """Each rank's device holds what its validation runs: its own stage in a pipeline, else the whole model."""
        if self.in_pipeline(module):
            self.hold_own_stage(module)
        else:
            self.gather_model(module, device)

    # -- the pipelined validation step ------------------------------------------------------------------------------
    def validation_step(self, module: LightningModule, device: torch.device, args: Sequence[Any],
                        kwargs: Mapping[str, Any], evaluation_step: EvaluationStep, precision: Precision,
                        resilience: ResilienceHooks) -> Any:
        """A stage rank's validation step through its pipeline (only where :meth:`in_pipeline`)."""
        replica = self.replica
        assert replica is not None, "a data-parallel rank validates as a whole-model replica"
        resilience.enter("validation")
        batch = args[0] if args else kwargs["batch"]
        batch_idx, dataloader_idx = step_indices(args, kwargs)
        assert batch_idx is not None
        step_args = [dataloader_idx] if len(args) > 2 or "dataloader_idx" in kwargs else []
        trainer = _compat.trainer_of(module)
        assert trainer is not None
        real = not evaluation_padding(trainer.val_dataloaders, batch_idx, dataloader_idx)
        joined, any_real = gather_batch(batch, real, replica.group, device)
        if not any_real:  # every slice re-reads a sample: the first stage's runs on every rank (the same shapes)
            box = [move_data_to_device(batch, "cpu")]
            dist.broadcast_object_list(box, src=replica.ranks[0], group=replica.group)
            joined = move_data_to_device(box[0], device)
        size = extract_batch_size(joined)
        # The last stage logs for the replica; the other stage ranks count nowhere.
        runs = (not (any_real and replica.is_last), size)
        with evaluation_step("validation", "val_dataloaders", args, kwargs, runs):
            with precision.val_step_context():
                output, calls = replica.evaluate(joined, batch_idx, step_args)
            shared, _ = share_logs(calls, replica.ranks[-1], replica.group, "validation_step")
            later = own_view(shared, mirrors=any_real and not replica.is_last)
            log_shared(module, [call for call in shared if call not in later], size, device)
        log_shared(module, later, size, device)
        return output
