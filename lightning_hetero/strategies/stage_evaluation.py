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

    class HeteroHybridStrategy(StageEvaluation, HeteroLifecycle, _UnwrappedDDP): ...
"""

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero.grad.stage_sync import StageSync, broadcast_buffers
from lightning_hetero.observe.metrics import evaluation_padding, step_indices
from lightning_hetero.strategies.pipelined import (PipelinedReplica, gather_batch, log_shared, own_view,
                                                   share_logs)


class StageEvaluation:
    """A stage rank's evaluation (see the module docstring). Mixed in first: its ``validation_step`` runs a stage
    rank's pipelined step inside :class:`~lightning_hetero.strategies.lifecycle.HeteroLifecycle`'s evaluation step
    and hands every other step on."""

    replica: Optional[PipelinedReplica] = None
    stage_sync: Optional[StageSync] = None
    # The constructor's option: validation during a fit runs through the pipelines.
    pipelined_evaluation: bool = False

    def validates_in_pipeline(self) -> bool:
        """Whether this job's validation runs through its pipelines now (the same answer on every rank)."""
        trainer = _compat.trainer_of(self.lightning_module)  # type: ignore[attr-defined]
        return self.pipelined_evaluation and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    # -- the whole model where every rank needs it ------------------------------------------------------------------
    def gather_model(self) -> None:
        """Every rank holds the whole model: a stage rank's other stages from the ranks that train them, and every
        buffer from rank 0 (a data-parallel rank: it ran every stage's buffers). Collective over all ranks."""
        if self.replica is not None:
            self.replica.holding.hold_whole()
        sync, module = self.stage_sync, self.lightning_module  # type: ignore[attr-defined]
        if sync is not None and sync.share_partition_once_split(self.replica and self.replica.partition, module,
                                                                self.root_device):  # type: ignore[attr-defined]
            sync.broadcast_params(module)
        broadcast_buffers(module, src=0)

    def hold_own_stage(self) -> None:
        """A stage rank's device keeps its stage's parameters alone (once the split is known: else the first trace
        releases the others), every rank rank 0's buffers. Collective over all ranks."""
        replica = self.replica
        if replica is not None and replica.partition is not None:
            replica.holding.keep_only(replica.partition[replica.stage], replica.optimizers)
        broadcast_buffers(self.lightning_module, src=0)  # type: ignore[attr-defined]

    @override
    def on_validation_start(self) -> None:
        if self.validates_in_pipeline():
            self.hold_own_stage()
        else:
            self.gather_model()
        super().on_validation_start()  # type: ignore[misc]

    @override
    def on_test_start(self) -> None:
        self.gather_model()
        super().on_test_start()  # type: ignore[misc]

    @override
    def on_predict_start(self) -> None:
        self.gather_model()
        super().on_predict_start()  # type: ignore[misc]

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        self.gather_model()

    # -- the pipelined validation step ------------------------------------------------------------------------------
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.replica
        if replica is None or not self.validates_in_pipeline():
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]
        self.core.resilience.enter("validation")  # type: ignore[attr-defined]
        module, device = self.lightning_module, self.root_device  # type: ignore[attr-defined]
        batch = args[0] if args else kwargs["batch"]
        batch_idx, dataloader_idx = step_indices(args, kwargs)
        assert batch_idx is not None
        step_args = [dataloader_idx] if len(args) > 2 or "dataloader_idx" in kwargs else []
        trainer = _compat.trainer_of(module)
        real = not evaluation_padding(trainer.val_dataloaders, batch_idx, dataloader_idx)
        joined, any_real = gather_batch(batch, real, replica.group, device)
        if not any_real:  # every slice re-reads a sample: the first stage's runs on every rank (the same shapes)
            box = [move_data_to_device(batch, "cpu")]
            dist.broadcast_object_list(box, src=replica.ranks[0], group=replica.group)
            joined = move_data_to_device(box[0], device)
        size = extract_batch_size(joined)
        # The last stage logs for the replica; the other stage ranks count nowhere.
        runs = (not (any_real and replica.is_last), size)
        evaluation_step = self._evaluation_step  # type: ignore[attr-defined]
        with evaluation_step("validation", "val_dataloaders", args, kwargs, runs=runs):
            with self.precision_plugin.val_step_context():  # type: ignore[attr-defined]
                output, calls = replica.evaluate(joined, batch_idx, step_args)
            shared, _ = share_logs(calls, replica.ranks[-1], replica.group, "validation_step")
            later = own_view(shared, mirrors=any_real and not replica.is_last)
            log_shared(module, [call for call in shared if call not in later], size, device)
        log_shared(module, later, size, device)
        return output
