"""The Lightning strategy overrides every heterogeneous strategy shares: each calls a collaborator of the
:class:`HeteroCore` (``core.lab``, ``core.plan``, ``core.shares``, ``core.loaders``, ``core.step``,
``core.resilience``).

One chain of single inheritance: ``HeteroLifecycle(DDPStrategy)``, then a strategy's own class (or a class that
gives another parallelism's Lightning overrides, then the strategy's). Where a parallelism runs a step or reads and
writes checkpoints in its own way, it overrides the hook this layer calls there (:meth:`HeteroLifecycle.run_step`,
:meth:`~HeteroLifecycle.read_checkpoint`, :meth:`~HeteroLifecycle.write_checkpoint`; DDP's by default).
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Literal, Optional, Union

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero.grad.batchnorm import sync_for_strategy, synced_statistics
from lightning_hetero.grad.exchange import GradExchange, InBackward
from lightning_hetero.lab.emulator import Emulator
from lightning_hetero.lab.groups import HeteroLab
from lightning_hetero.lab.environments import per_node_environment
from lightning_hetero.observe.metrics import discard_padding_step, evaluation_padding, reduce_logged, step_indices
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.plan.shares import SharePlan
from lightning_hetero.view import name_running_strategy
from lightning_hetero.registry import register_with_lightning
from lightning_hetero.resilience.resume import resuming_launcher
from lightning_hetero.strategies.core import HeteroCore
from lightning_hetero.strategies.facade import FromFacade, HeteroFacade


# What an evaluation step logs for where it runs a batch not its own (a pipeline's joined batch): whether that is a
# padding step, and its samples.
StepRuns = tuple[bool, Optional[int]]
# The strategy methods through which Lightning runs the LightningModule's steps.
StepName = Literal["training_step", "validation_step", "test_step", "predict_step"]


def _batch_size_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[int]:
    batch = args[0] if args else kwargs.get("batch")
    try:
        return extract_batch_size(batch)
    except Exception:  # an odd batch type: fall back to Lightning's unweighted mean
        return None


def connected_module(strategy: Strategy) -> LightningModule:
    """The strategy's model (Lightning's ``lightning_module`` is ``None`` until a ``Trainer`` connects one)."""
    assert strategy.lightning_module is not None, "the strategy has no model connected"
    return strategy.lightning_module


def attached_trainer(module: LightningModule) -> Trainer:
    """The trainer running ``module`` (inside a ``Trainer`` call: a step, a hook)."""
    trainer = _compat.trainer_of(module)
    assert trainer is not None, "the model is attached to no trainer"
    return trainer


class HeteroLifecycle(DDPStrategy):
    """Lightning strategy overrides that call the :class:`HeteroCore` (``self.core``) at each lifecycle point.

    A strategy subclasses it (``class HeteroDDPStrategy(HeteroLifecycle)``), builds ``self.core`` and its façade
    ``self.hetero`` in its constructor, and overrides what its parallelism does otherwise: :meth:`weigh_loss` (its
    exact gradient weighting, if done on the loss), :meth:`no_sync` (accumulation without gradient communication, for
    micro-batches), :meth:`run_step` and the checkpoint hooks.
    """

    strategy_name: str  # the name of the strategy's line in lightning_hetero/registry.py
    sharded: bool = False  # parameters sharded across ranks: a fact of the class (the rehearsal reads it)
    core: HeteroCore
    hetero: HeteroFacade  # the public, read-only face (strategies/facade.py)
    exchange: GradExchange = InBackward()  # how the gradients cross ranks in a step (called in one place below)
    _stepping: bool = False  # inside the optimizer step's closure, whose backward the step's exchange follows

    # The public names the docs give on the strategy, each read off the façade.
    lab: FromFacade[HeteroLab] = FromFacade()
    plan: FromFacade[SharePlan] = FromFacade()
    share_controller: FromFacade[ShareController] = FromFacade()
    emulation: FromFacade[Optional[Emulator]] = FromFacade()
    comm_bytes_last_step: FromFacade[Optional[int]] = FromFacade()

    # -- what the parallelism supplies (DDP's by default) ----------------------------------------------------------
    def run_step(self, name: StepName, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's step ``name`` as the parallelism does (DDP: through its wrapper)."""
        return getattr(super(), name)(*args, **kwargs)

    def read_checkpoint(self, path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        """The checkpoint at ``path`` as the parallelism stores it (DDP: one file)."""
        load = super().load_checkpoint
        return load(path, **_compat.weights_only_argument(load, weights_only))

    def write_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Write ``checkpoint`` as the parallelism stores it (DDP: rank 0 writes one file)."""
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def weigh_loss(self, loss: Tensor) -> Tensor:
        """The loss this rank back-propagates for exact weighting (identity when the weighting happens elsewhere)."""
        return loss

    def no_sync(self) -> Any:
        return nullcontext()

    def batchnorm_sync_refusal(self) -> Optional[str]:
        """Why this job's BatchNorm layers cannot sync across ranks (``None``: they can)."""
        if self.core.loaders.micro_batch is not None:
            return ("`data.micro_batch` runs a share in a number of pieces that differs between ranks, so their "
                    "BatchNorm collectives would not pair up; use one or the other.")
        return None

    # -- registration and launch ----------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_with_lightning(cls, strategy_registry)  # its line in lightning_hetero/registry.py

    @override
    def _configure_launcher(self) -> None:
        # Hosts with unequal GPU counts (2 + 1): torchrun's ranks are right, Lightning's devices × nodes check is not.
        self.cluster_environment, self.parallel_devices = per_node_environment(self.cluster_environment,
                                                                               self.parallel_devices)
        self._launcher = resuming_launcher(self, self._start_method, self.core.options.resilience.resume)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.core.loaders.sampler_kwargs()

    @override
    def setup_environment(self) -> None:
        name_running_strategy(self)
        self.core.lab.before_process_group()
        super().setup_environment()
        self.core.after_process_group()

    @override
    def setup_distributed(self) -> None:
        if dist.is_initialized():
            super().setup_distributed()
        else:
            self.core.lab.init_process_group()

    # -- the model ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        # Before Lightning's setup applies the layer sync and then wraps (DDP) or shards (FSDP2) the model.
        if trainer.state.fn == TrainerFn.FITTING:
            plan = self.core.plan
            uneven = (len(set(plan.capacities)) > 1 or self.core.options.rebalance is not None
                      or self.core.profiler.enabled)
            plugin, plan.min_share = sync_for_strategy(_compat.layer_sync(self), connected_module(self),
                                                       self.world_size, uneven, self.batchnorm_sync_refusal())
            _compat.set_layer_sync(self, plugin)
        super().setup(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.core.loaders.process_dataloader(dataloader)

    # -- steps ------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.core.step.on_train_batch_start(batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = self.core.step
        self.core.shares.step_started()
        trainer = _compat.trainer_of(self.lightning_module)
        size = step.train_step_size()
        padding = size == 0
        layer_sync = _compat.layer_sync(self)
        with (
            step.step(size),
            discard_padding_step(trainer, self.lightning_module, padding=padding),
            synced_statistics(layer_sync, padding),
        ):
            micro = self.core.loaders.micro_limit
            sizes = step.micro_batch_sizes(_batch_size_of(args, kwargs)) if micro else None
            if sizes is None:
                return self.run_step("training_step", *args, **kwargs)
            optimizer = self.optimizers[0] if self.optimizers else None
            return step.run_micro_batches(
                sizes, args[0] if args else kwargs["batch"],
                forward=lambda chunk: self.run_step("training_step", chunk, *args[1:], **kwargs),
                # Lightning divides the step's loss by the accumulation window; the micro-batches' losses likewise.
                backward=lambda loss: super(HeteroLifecycle, self).backward(
                    self.weigh_loss(loss / trainer.accumulate_grad_batches), optimizer),
                no_sync=self.no_sync,
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        self.core.step.before_backward(closure_loss)
        # Only the stepping closure's backward begins the step's exchange (no `finish` follows any other).
        with self.exchange.during_backward(connected_module(self)) if self._stepping else nullcontext():
            out = super().backward(self.weigh_loss(closure_loss), optimizer, *args, **kwargs)
            self.core.step.after_backward()
        return out

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def exchanged() -> Any:  # the closure runs forward and backward; the step's exchange completes after it
            self._stepping = True
            try:
                out = closure()
            finally:
                self._stepping = False
            self.exchange.finish(connected_module(self))
            return out

        step, weight = self.core.step, self.core.step.logging_batch_size  # an exchange may reweigh the step's logs
        try:
            with self.core.lab.emulated_work():
                out = super().optimizer_step(optimizer, exchanged, model, **kwargs)
        finally:
            step.pending_grads, step.logging_batch_size = None, weight
        step.after_optimizer_step()
        return out

    @contextmanager
    def _evaluation_step(self, phase: str, loaders: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                         runs: Optional[StepRuns] = None) -> Iterator[bool]:
        """Around a validation / test / predict step; yields whether it is a padding step (weight 0, counts nowhere)."""
        self.core.resilience.enter(phase)
        trainer = _compat.trainer_of(self.lightning_module)
        padding = evaluation_padding(getattr(trainer, loaders, None), *step_indices(args, kwargs))
        padding, size = runs or (padding, _batch_size_of(args, kwargs))
        with self.core.step.step(0 if padding else size), discard_padding_step(
                trainer, self.lightning_module, padding):
            yield padding

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluation_step("validation", "val_dataloaders", args, kwargs):
            return self.run_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluation_step("test", "test_dataloaders", args, kwargs):
            return self.run_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluation_step("predict", "predict_dataloaders", args, kwargs) as padding:
            output = self.run_step("predict_step", *args, **kwargs)
        return self.core.predictions.step(step_indices(args, kwargs), padding, output)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.core.predictions.start(_compat.trainer_of(self.lightning_module))

    @override
    def on_predict_end(self) -> None:
        self.core.predictions.end(_compat.trainer_of(self.lightning_module))
        super().on_predict_end()

    @override
    def reduce(self, tensor: Tensor, group: Optional[Any] = None,
               reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Tensor:
        """What one process would compute: inside a step a mean over ranks is weighted by each rank's batch size;
        an epoch's sample count is averaged without truncation; a padding step counts nowhere
        (:func:`~lightning_hetero.observe.metrics.reduce_logged`)."""
        if self.world_size == 1:  # any reduction over one rank is its own value: no collective, as on a single device
            return tensor
        parallel_reduce = super().reduce
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return parallel_reduce(tensor, group=group, reduce_op=reduce_op)
        step = self.core.step
        return reduce_logged(tensor, reduce_op, step.logging_batch_size,
                             weighted_mean=lambda t: step.reduce_weighted_mean(t, group),
                             reduce=lambda t, op: parallel_reduce(t, group=group, reduce_op=op))

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        with self.core.resilience.in_phase("collective"):
            super().barrier(name)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.core.resilience.on_exception(exception)

    # -- checkpoints and teardown -----------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = self.read_checkpoint(checkpoint_path, weights_only)
        self.core.resilience.on_load(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.core.on_save(checkpoint)
        with self.core.resilience.in_phase("checkpoint"):
            self.write_checkpoint(checkpoint, filepath, storage_options)

    @override
    def teardown(self) -> None:
        self.core.resilience.teardown()
        super().teardown()
        self.core.after_teardown()
