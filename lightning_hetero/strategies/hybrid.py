"""``HeteroHybridStrategy``: pipelined replicas of slow cards beside data-parallel fast cards, exact.

Some ranks form a pipelined replica (``pipelines=[[2, 3]]``: ranks 2 and 3 are stages 0 and 1 of one replica, run by
``torch.distributed.pipelining``, :mod:`~lightning_hetero.strategies.pipelined`); every other rank is a
data-parallel replica holding the whole model. The composition, in the order a fit meets it:

1. the loaders split each global batch by rank as the other strategies do; a pipeline trains on the union of its
   ranks' slices (gathered in the pipeline's group), so its share of the global batch is the sum of its ranks'
   capacities (:meth:`~lightning_hetero.plan.layout.HybridLayout.replica_sizes`);
2. no DDP wrapper; a stage rank trains its stage's parameters only, and its device holds only those, their
   gradients and optimizer state (:mod:`~lightning_hetero.strategies.stage_memory`): the model waits in host
   memory until the first step's trace splits it;
3. each replica weights its loss by b_replica / G (a pipeline per micro-batch), and one SUM all-reduce per stage
   group (:class:`~lightning_hetero.grad.stage_sync.StageSync`) gives each parameter Σ_replicas (b / G) g, begun
   during the backward where it can be (:mod:`~lightning_hetero.strategies.stage_exchange`);
4. with ``pipelined_evaluation=True``, validation during a fit runs through the pipeline, a stage rank's device
   keeping its stage's parameters alone (:mod:`~lightning_hetero.strategies.stage_evaluation`); otherwise, and for
   test, predict and the end of training, a stage rank gets the whole model's weights again (re-broadcast from the
   ranks that train them) and evaluates as a data-parallel replica; the next training step frees them again. Every
   rank evaluates with rank 0's buffers (no DDP wrapper re-syncs them). Rank 0 (a data-parallel rank, holding every
   trained parameter and the whole optimizer state) writes a full, layout-free checkpoint.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_hetero.config import (DataSplit, Observation, Profiling, Resilience, StartMethod,
                                     from_flat_arguments)
from lightning_hetero.grad.clipping import clipping_by_whole_norm
from lightning_hetero.grad.precision import PrecisionPolicyArg
from lightning_hetero.grad.stage_compression import StageCompressionArg, parse_stage_compression
from lightning_hetero.grad.compression import warn_double_momentum
from lightning_hetero.grad.stage_sync import StageSync
from lightning_hetero.grad.weighting import loss_weight
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.plan.capacity import CapacitiesArg
from lightning_hetero.plan.layout import HybridLayout
from lightning_hetero.strategies.arguments import parallel_arguments
from lightning_hetero.strategies.core import core_from_arguments
from lightning_hetero.strategies.hybrid_plan import (broadcast_start, check_hybrid_arguments, check_pipeline_modes,
                                                    check_pipelined_run, plan_layout, split_points_for)
from lightning_hetero.strategies.hybrid_profile import profile_layout
from lightning_hetero.strategies.facade import HeteroFacade
from lightning_hetero.strategies.lifecycle import HeteroLifecycle, StepName, attached_trainer, connected_module
from lightning_hetero.strategies.pipelined import PipelinedReplica
from lightning_hetero.strategies.pipelined_step import PipelinedStep
from lightning_hetero.strategies.stage_evaluation import StageEvaluation
from lightning_hetero.strategies.stage_memory import StageHolding
from lightning_hetero.strategies.stage_exchange import StageExchange

ScheduleName = Literal["gpipe", "1f1b"]


class _UnwrappedDDP(HeteroLifecycle):
    """The lifecycle without DDP's wrapper (gradients are exchanged per stage group), whose training step on a stage
    rank is the pipeline's (inside the precision's autocast, as Lightning runs a step)."""

    replica: Optional[PipelinedReplica] = None
    runner: Optional[PipelinedStep] = None  # a stage rank's step

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @override
    def _register_ddp_hooks(self) -> None:
        pass

    @override
    def run_step(self, name: StepName, *args: Any, **kwargs: Any) -> Any:
        if self.runner is None or name != "training_step":
            return super().run_step(name, *args, **kwargs)
        accumulate = attached_trainer(connected_module(self)).accumulate_grad_batches
        with self.precision_plugin.train_step_context():  # Lightning passes (batch, batch_idx) by position
            return self.runner.run(connected_module(self), args[0], args[1], accumulate)


class WholeModelAtTrainEnd(Callback):
    """Before any other callback's ``on_train_end`` (Lightning's ``EMAWeightAveraging`` copies its average into the
    parameters there), a stage rank's released parameters get storage again; the strategy's own ``on_train_end``,
    which Lightning runs after the callbacks', then fills them from the ranks that train them."""

    def __init__(self, holding: StageHolding) -> None:
        self.holding = holding

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.holding.hold_whole()


class HeteroHybridStrategy(_UnwrappedDDP):
    """Data-parallel ranks and pipelined replicas in one job, with the math of one device on the global batch.

    Args:
        pipelines: the global ranks of each pipelined replica, in stage order, which is ascending rank order
            (``[[2, 3]]``); all of the same length (2+); every other rank is a data-parallel replica. Rank 0 must be
            data-parallel (it writes the checkpoint). ``"auto"``: the cards that cannot hold the model, its gradients
            and Adam's state (less ``profiling.memory_headroom``) form pipelines of consecutive ranks of similar speed
            (:func:`~lightning_hetero.plan.layout.choose_pipelines`); the choice and its reasons are logged.
        micro_batches: the most micro-batches a pipeline's step runs (``None``: 2 × stages, or with measured
            capacities the fastest of stages, 2 × and 4 × stages); the count used divides
            the replica's share (:func:`~lightning_hetero.plan.layout.micro_batch_count`).
        schedule: ``"gpipe"`` (``ScheduleGPipe``) or ``"1f1b"`` (``Schedule1F1B``).
        stage_compression: the per-stage gradient exchange between hosts compressed (inside a host: full
            precision): ``"bf16"``, ``"fp16"``, ``"powersgd"``, ``"topk"`` or the config classes of
            ``HeteroDDPStrategy(compression=...)`` with ``hierarchical=True``
            (:mod:`~lightning_hetero.grad.stage_compression`); ``None``: exact.
        overlap_stage_exchange: begin each stage's gradient exchange during the backward, as soon as the stage's
            gradients are complete (``True``; exact on CPU, not yet checked on GPUs), or after the whole backward
            (``False``, the default). A LightningModule that
            overrides ``backward`` or ``on_after_backward``, or a callback that overrides ``on_after_backward``,
            keeps it after the backward (:mod:`~lightning_hetero.strategies.stage_exchange`), as does a stage
            group compressed across hosts.
        pipelined_evaluation: validation during a fit runs through the pipelines, a stage rank's device keeping its
            stage's parameters alone, and logs one device's metrics
            (:mod:`~lightning_hetero.strategies.stage_evaluation`; its ``validation_step`` calls ``self(x, ...)`` as
            ``training_step`` does). ``False`` (the default): a stage rank gets the whole model for validation and
            evaluates as a data-parallel replica. Test, predict and the end of training give it the whole model
            either way.
        split_points: module names (``"blocks.6"``) where each stage after the first begins. Default: the model's
            repeated blocks (:func:`~lightning_hetero.plan.blocks.default_blocks`) cut in proportion to the stage
            ranks' capacities.
        capacities: relative speed of each rank (a list, a device-name mapping, ``"equal"`` or ``"peak"``); a
            pipeline's share of the global batch is the sum of its ranks'. Measured (``"profile"``, and the default
            ``"auto"`` when fitting, as for the other strategies): each replica is timed as it trains, a pipeline as
            one replica (:mod:`~lightning_hetero.strategies.hybrid_profile`). Published rates misjudge a pipeline:
            ``"peak"`` gave a BERT-base pipeline of two emulated 3090s 16 of 160 samples, and the data-parallel
            ranks waited 82 of a 232 ms step for it (``benchmarks/RESULTS.md``, 2026-11-27).
        global_batch_size: samples per optimizer step over all replicas (default: the loader's ``batch_size`` ×
            world size).
        profiling: as for :class:`~lightning_hetero.HeteroDDPStrategy` (``steps``; no memory caps are measured).
        data: as for ``HeteroDDPStrategy``; ``micro_batch`` is refused (the pipeline has its own micro-batches), and so
            is ``loss_denominator="tokens"`` (a pipeline weights its micro-batches by samples).
        precision_policy: per-rank precision (fp32 or bf16; fp16's loss scaling is refused).
        emulate: emulate a mixed lab on identical devices, one entry per rank (as for ``HeteroDDPStrategy``).
        resilience: fault timeout, ``resume``, ``nonfinite`` (:class:`~lightning_hetero.config.Resilience`).
        observation: the lab table (:class:`~lightning_hetero.config.Observation`).
        start_method: ``"popen"``, ``"spawn"``, ``"fork"``, ...
        process_group_backend: ``"nccl"``, ``"gloo"`` ... (default: by device).
        accelerator: as for Lightning's ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        checkpoint_io: as for ``DDPStrategy``; default: atomic writes with a ``.sha256`` sidecar, verified on load.
        precision_plugin: as for ``DDPStrategy`` (``precision_policy`` or this, not both).
    """

    strategy_name = "hetero_hybrid"
    stage_sync: Optional[StageSync] = None
    stage_exchange: Optional[StageExchange] = None
    evaluation: Optional[StageEvaluation] = None  # built with the layout

    def __init__(
        self,
        pipelines: Union[list[list[int]], Literal["auto"], None] = None,
        micro_batches: Optional[int] = None,
        schedule: ScheduleName = "gpipe",
        stage_compression: Optional[StageCompressionArg] = None,
        overlap_stage_exchange: bool = False,
        pipelined_evaluation: bool = False,
        split_points: Optional[list[str]] = None,
        capacities: CapacitiesArg = "auto",
        global_batch_size: Optional[int] = None,
        profiling: Optional[Profiling] = None,
        data: Optional[DataSplit] = None,
        precision_policy: Optional[PrecisionPolicyArg] = None,
        emulate: Optional[list[Union[str, dict[str, Any], None]]] = None,
        resilience: Optional[Resilience] = None,
        observation: Optional[Observation] = None,
        start_method: StartMethod = "popen",
        process_group_backend: Optional[str] = None,
        accelerator: Optional[Union[str, Accelerator]] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        compression = parse_stage_compression(stage_compression)
        options = from_flat_arguments(profiling, None, data, resilience, observation, flat={})
        check_hybrid_arguments(pipelines, micro_batches, schedule, overlap_stage_exchange, pipelined_evaluation,
                               split_points, options.data)
        super().__init__(**parallel_arguments(options, start_method, process_group_backend, accelerator,
                                              parallel_devices, cluster_environment, checkpoint_io, precision_plugin))
        # Measured capacities time a pipeline as one replica; the plan splits training batches over replicas.
        self.core = core_from_arguments(self, capacities, global_batch_size, options, emulate, precision_policy,
                                        precision_plugin, measure=self._profile_layout,
                                        replicas_of=self._layout_replicas)
        self.pipelines, self.micro_batches, self.schedule = pipelines, micro_batches, schedule
        self.split_points, self.stage_compression = split_points, compression
        self.overlap_stage_exchange, self.pipelined_evaluation = overlap_stage_exchange, pipelined_evaluation
        self.layout: Optional[HybridLayout] = None
        self.hetero = HybridFacade(self)

    def _profile_layout(self, sampler: Any, dataloader: Any) -> Any:  # a method: the spawn launcher pickles it
        return profile_layout(self, sampler, dataloader)

    # -- set-up: the layout, its groups, this rank's stage --------------------------------------------------------
    def _layout_replicas(self, devices: Sequence[DeviceInfo],
                         capacities: Sequence[float]) -> tuple[tuple[int, ...], ...]:
        """The job's layout, chosen when the plan has resolved the capacities (it asks, in ``setup_environment``;
        a method: the spawn launcher pickles it), and its replicas for the plan: a pipeline is one replica, its
        least share one sample, not one per stage rank."""
        assert self.pipelines is not None
        layout = self.layout = plan_layout(self.pipelines, connected_module(self), devices, capacities,
                                           float(self.core.options.profiling.memory_headroom), self.world_size)
        self.pipelines = [list(p) for p in layout.pipelines]
        return layout.replicas

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the plan resolves the capacities, then `_layout_replicas` picks the layout
        layout = self.layout
        assert layout is not None
        check_pipeline_modes(self.core.precision.modes, layout.pipelines)
        # `new_group` is collective: every rank builds every group, in the same order.
        groups = [dist.new_group(list(p)) for p in layout.pipelines]
        hosts = [d.host for d in self.core.lab.lab.devices]
        sync = self.stage_sync = StageSync(layout, self.global_rank, hosts, self.stage_compression)
        pipeline = layout.pipeline_of(self.global_rank)
        if pipeline is not None:
            module = connected_module(self)
            split = self.split_points or split_points_for(module, [self.plan.capacities[r] for r in pipeline])
            self.replica = PipelinedReplica(module, pipeline, groups[layout.pipelines.index(pipeline)],
                                            self.root_device, split, self.schedule, self.micro_batches,
                                            self.core.lab.emulation)
            self.runner = PipelinedStep(self.replica, self.core.step, self.core.loaders, self.root_device,
                                        len(layout.replicas))
        self.exchange = self.stage_exchange = StageExchange(sync, self.replica, self.core.step,
                                                            self.overlap_stage_exchange)
        self.evaluation = StageEvaluation(self.replica, sync, self.pipelined_evaluation)

    @override
    def setup(self, trainer: Any) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        check_pipelined_run(self.precision_plugin, connected_module(self), fitting and self.layout is not None
                            and bool(self.layout.pipelines))
        # Lightning clips by norm in the precision plugin, by this rank's gradients: a stage rank's are one stage's.
        # The strategy's own plugin (a copy of the one it was given) clips by the whole model's norm.
        self.precision_plugin = clipping_by_whole_norm(self.precision_plugin, self._clip_by_whole_norm)
        super().setup(trainer)
        if fitting and self.stage_exchange is not None:
            self.stage_exchange.agree_overlap(connected_module(self), trainer.callbacks, self.root_device)
            if self.stage_exchange.sync.compresses:  # on one host every stage stays exact: no momentum correction
                warn_double_momentum(self.stage_exchange.sync.compression, self.optimizers)
        if self.replica is not None:
            # A BatchNorm layer that trains on per-replica statistics gets them from at least `min_share` samples.
            self.replica.least_micro_batch = self.plan.min_share
        if fitting and self.replica is not None:
            trainer.callbacks[:] = [WholeModelAtTrainEnd(self.replica.holding),
                                    *(c for c in trainer.callbacks if not isinstance(c, WholeModelAtTrainEnd))]
        parked = self.replica.holding.host_values() if self.replica is not None else {}
        broadcast_start(connected_module(self), parked, self.root_device)
        if self.replica is not None:
            self.replica.optimizers = self.optimizers

    def _clip_by_whole_norm(self, params: list[Tensor], max_norm: float) -> None:
        """Lightning's clipping by norm, by the whole model's norm: a stage rank's own gradients are one stage's."""
        assert self.stage_sync is not None
        self.stage_sync.clip_grad_norm(connected_module(self), params, max_norm, self.root_device)

    @property
    def overlapping(self) -> bool:
        """Whether this fit's stage exchanges begin during the backward (agreed at set-up by every rank)."""
        return self.stage_sync is not None and self.stage_sync.overlap

    @override
    def model_to_device(self) -> None:
        if self.replica is not None and attached_trainer(connected_module(self)).state.fn == TrainerFn.FITTING:
            self.replica.holding.park()  # the device gets placeholders; the first step's split places the stage
        super().model_to_device()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.replica is None or not self.replica.holding.parked:
            return super().load_optimizer_state_dict(checkpoint)
        self.replica.holding.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"])

    # -- evaluation: the whole model, or a stage through its pipeline (strategies/stage_evaluation.py) -----------
    def _gather_model(self) -> None:
        if self.evaluation is not None:
            self.evaluation.gather_model(connected_module(self), self.root_device)

    @override
    def on_validation_start(self) -> None:
        if self.evaluation is not None:
            self.evaluation.before_validation(connected_module(self), self.root_device)
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._gather_model()  # test and predict: every rank a whole-model replica
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._gather_model()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._gather_model()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        evaluation, module = self.evaluation, connected_module(self)
        if evaluation is None or evaluation.replica is None or not evaluation.in_pipeline(module):
            return super().validation_step(*args, **kwargs)
        return evaluation.validation_step(module, self.root_device, args, kwargs, self._evaluation_step,
                                          self.precision_plugin, self.core.resilience)

    # -- steps ----------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.runner is not None and self.core.step.share is not None:
            self.runner.hold_stage(self.optimizers)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.runner is not None:
            self.runner.log_own_view(connected_module(self))
        return output

    def weigh_loss(self, loss: Tensor) -> Tensor:
        """A data-parallel rank's loss times b_r / G (the stage groups sum); a stage rank's is already weighted."""
        share = self.core.step.share
        if self.replica is not None or share is None:
            return loss
        return loss * loss_weight(share[0], share[1], world_size=1)

    def batchnorm_sync_refusal(self) -> Optional[str]:
        return "a pipelined replica's stages hold different layers; BatchNorm cannot sync across them."


class HybridFacade(HeteroFacade):
    """The façade of :class:`HeteroHybridStrategy`: its pipelines, and a stage rank's steps to time."""

    # A stage rank holds one stage's gradients: the non-finite check agrees over every rank before it acts.
    holds_partial_gradients = True
    owner: HeteroHybridStrategy

    @property
    def pipeline_ranks(self) -> Optional[list[list[int]]]:
        layout = self.owner.layout
        return [list(p) for p in layout.pipelines] if layout is not None else None

    def observe_pipeline_stage(self, timer: Optional[Any]) -> bool:
        """Time this rank's pipeline steps with the monitor's ``timer`` (``None``: stop); False: no stage here."""
        replica = self.owner.replica
        if replica is None:
            return False
        replica.timer = timer
        return True
