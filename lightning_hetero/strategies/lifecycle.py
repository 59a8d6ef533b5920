"""The Lightning strategy overrides every heterogeneous strategy shares: each calls a collaborator of the
:class:`HeteroCore` (``core.lab``, ``core.plan``, ``core.shares``, ``core.loaders``, ``core.step``,
``core.resilience``).

A strategy is ``class HeteroXStrategy(HeteroLifecycle, XStrategy)``: Python's method order runs these overrides
first, and each hands on to the parallelism's own (``super()``).
"""

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero.grad.batchnorm import sync_for_strategy, synced_statistics
from lightning_hetero.lab.environments import PerNodeTorchElasticEnvironment
from lightning_hetero.observe.metrics import discard_padding_step, evaluation_padding, reduce_logged, step_indices
from lightning_hetero.view import name_running_strategy
from lightning_hetero.registry import entry
from lightning_hetero.resilience.resume import ResumingMultiProcessingLauncher, ResumingSubprocessLauncher
from lightning_hetero.strategies.core import HeteroCore
from lightning_hetero.strategies.facade import HeteroFacade


# The lifecycle is mixed in before Lightning's DDPStrategy or a subclass of it (the concrete strategy supplies it at
# run time): a type checker checks its `super()` calls against DDPStrategy.
if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _Parallel
else:
    _Parallel = object


# What an evaluation step logs for where it runs a batch not its own (a pipeline's joined batch): whether that is a
# padding step, and its samples.
StepRuns = tuple[bool, Optional[int]]


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


class HeteroLifecycle(HeteroFacade, _Parallel):
    """Lightning strategy overrides that call the :class:`HeteroCore` (``self.core``) at each lifecycle point.

    Mixed in before a Lightning parallel strategy: ``class HeteroDDPStrategy(HeteroLifecycle, DDPStrategy)``. The
    concrete strategy provides :meth:`weigh_loss` (its exact gradient weighting, if done on the loss) and
    :meth:`no_sync` (accumulation without gradient communication, for micro-batches).
    """

    strategy_name: str  # the name of the strategy's line in lightning_hetero/registry.py
    _stepping: bool = False  # inside the optimizer step's closure, whose backward the step's exchange follows

    # -- what the parallelism supplies ------------------------------------------------------------------------------
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

    # -- registration --------------------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the names of this strategy's line in :mod:`lightning_hetero.registry` (its ``strategy_name``)
        with Lightning's registry, one per launcher variant."""
        listed = entry(cls.strategy_name)
        for name, start_method in listed.variants():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, start_method=start_method,
                                           description=f"{listed.description}, start '{start_method}'")

    # -- launch and process group ------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        # Hosts with unequal GPU counts (2 + 1): torchrun's ranks are right, Lightning's devices × nodes check is not.
        if type(self.cluster_environment) is TorchElasticEnvironment:
            self.cluster_environment = PerNodeTorchElasticEnvironment()
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
            devices = self.parallel_devices or []
            if local and devices and all(d.type == "cpu" for d in devices) and len(devices) != local:
                # CPU processes have no device to count: this node runs what torchrun started (--nproc-per-node).
                self.parallel_devices = [torch.device("cpu")] * local
        # Lightning's launchers, resolving `resilience.resume` to the trainer's `ckpt_path` before `fit` starts.
        resume = self.core.options.resilience.resume
        if self._start_method == "popen":
            self._launcher = ResumingSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                                        resume=resume)
        else:
            self._launcher = ResumingMultiProcessingLauncher(self, start_method=self._start_method, resume=resume)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The cluster's world size, not num_nodes × devices (unequal hosts); the batch sampler replaces it anyway.
        trainer = _compat.trainer_of(self.lightning_module) if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING):
            # Lightning's prediction sampler (replaced too) asserts that every rank has a sample: one sample on two
            # ranks would fail there, before the batch sampler gives the sampleless rank a padding step. And for a
            # standalone validate / test it warns that a DistributedSampler replicates samples: not so here, the
            # batch sampler evaluates each sample once.
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

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

    # -- data -------------------------------------------------------------------------------------------------------
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
                return super().training_step(*args, **kwargs)
            optimizer = self.optimizers[0] if self.optimizers else None
            return step.run_micro_batches(
                sizes, args[0] if args else kwargs["batch"],
                forward=lambda chunk: super(HeteroLifecycle, self).training_step(chunk, *args[1:], **kwargs),
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
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluation_step("test", "test_dataloaders", args, kwargs):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluation_step("predict", "predict_dataloaders", args, kwargs) as padding:
            output = super().predict_step(*args, **kwargs)
        # A padding step runs for the collectives only: its sample is another rank's prediction.
        batch_idx, dataloader_idx = step_indices(args, kwargs)
        if batch_idx is not None:
            self.core.predictions.step(batch_idx, dataloader_idx, padding)
        return None if padding else output

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
        load = super().load_checkpoint
        checkpoint = load(checkpoint_path, **_compat.weights_only_argument(load, weights_only))
        self.core.resilience.on_load(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.core.on_save(checkpoint)
        with self.core.resilience.in_phase("checkpoint"):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def teardown(self) -> None:
        self.core.resilience.teardown()
        super().teardown()
        self.core.after_teardown()
