"""The hetero core: what makes data-parallel training heterogeneous, whatever the parallelism.

:class:`HeteroCore` is a composition root: it builds, for one strategy instance, a few collaborators that each own
one job and read the Lightning strategy through one typed :class:`~lightning_hetero.view.StrategyView`:

- ``plan`` (:class:`~lightning_hetero.plan.shares.SharePlan`): capacities, memory caps, the schedule of share changes;
- ``lab`` (:class:`~lightning_hetero.lab.setup.LabSetup`): emulation, the process group, devices, groups;
- ``precision`` (:class:`~lightning_hetero.grad.precision.RankPrecision`): every rank's precision, this rank's plugin;
- ``profiler`` (:class:`~lightning_hetero.plan.profile_run.ShareProfiler`): profiling at start, its record;
- ``shares`` (:class:`~lightning_hetero.plan.rebalance.ShareController`): live rebalancing;
- ``share_state`` (:class:`~lightning_hetero.plan.state.ShareState`): the checkpointed share state, the resume;
- ``loaders`` (:class:`~lightning_hetero.data.split.LoaderSplit`): every loader split by the plan, micro-batching;
- ``step`` (:class:`~lightning_hetero.strategies.step.StepState`): this step's (b_r, G), micro-batches, the weighted mean;
- ``resilience`` (:class:`~lightning_hetero.resilience.hooks.ResilienceHooks`): watchdog, checkpoint state, teardown;
- ``predictions`` (:class:`~lightning_hetero.strategies.predictions.PaddingPredictions`): a predict's padding steps
  kept out of what prediction writers and ``trainer.predict`` receive;

and adds the callbacks the options ask for (pre-emption, monitor, non-finite check).

:class:`~lightning_hetero.strategies.lifecycle.HeteroLifecycle` is the thin layer of Lightning strategy overrides
that calls them at each lifecycle point; a strategy is ``class HeteroXStrategy(HeteroLifecycle)`` plus what its
parallelism needs.
"""

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_hetero._compat as _compat
from lightning_hetero.config import Options, check, is_int, sharded_refusals
from lightning_hetero.data.split import LoaderSplit
from lightning_hetero.grad.nonfinite import NonFiniteCheck
from lightning_hetero.grad.precision import PrecisionPolicy, RankPrecision, parse_precision_policy
from lightning_hetero.strategies.step import StepState
from lightning_hetero.lab.emulation_spec import EmulationSpec, parse_emulate
from lightning_hetero.lab.setup import LabSetup
from lightning_hetero.observe.monitor import HeteroMonitor
from lightning_hetero.observe.notices import restore_inexact_resume_warning
from lightning_hetero.plan.capacity import CapacitySpec, parse_capacities
from lightning_hetero.plan.profile_run import Measure, ShareProfiler
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.plan.shares import ReplicasOf, SharePlan
from lightning_hetero.plan.state import ShareState
from lightning_hetero.resilience.hooks import ResilienceHooks
from lightning_hetero.strategies.predictions import PaddingPredictions
from lightning_hetero.view import StrategyView


class HeteroCore:
    """The collaborators of one heterogeneous job (see the module docstring), wired once."""

    def __init__(self, view: StrategyView, capacity_spec: CapacitySpec, global_batch_size: Optional[int],
                 options: Options, emulate: Optional[list[Optional[EmulationSpec]]],
                 precision_policy: Optional[PrecisionPolicy], sharded: bool = False,
                 measure: Optional[Measure] = None, replicas_of: Optional[ReplicasOf] = None) -> None:
        self.view = view
        self.options = options
        self.sharded = sharded  # the model's forward and backward issue collectives: steps are timed in lockstep
        self.plan = SharePlan(capacity_spec, global_batch_size, replicas_of)
        self.lab = LabSetup(view, options, emulate)
        self.precision = RankPrecision(view, precision_policy)
        self.resilience = ResilienceHooks(view, options.resilience)
        profiling, rebalancing = options.profiling, options.rebalance
        self.profiler = ShareProfiler(
            view, self.plan, self.lab,
            enabled=capacity_spec.source in ("profile", "auto"),
            steps=profiling.steps,
            memory_headroom=float(profiling.memory_headroom),
            max_batch_per_rank=profiling.max_batch_per_rank,
            sharded=sharded,
            measure=measure,
        )
        self.shares = ShareController(
            view, self.plan, self.lab, self.profiler,
            rebalance=rebalancing is not None,
            every=rebalancing.every if rebalancing else 20,
            threshold=float(rebalancing.threshold) if rebalancing else 0.05,
            smoothing=float(rebalancing.smoothing) if rebalancing else 0.5,
        )
        self.share_state = ShareState(view, self.plan, self.lab, self.profiler, self.shares)
        self.loaders = LoaderSplit(view, self.plan, self.lab, self.share_state, self.resilience, options)
        self.step = StepState(view, self.loaders, self.shares, self.share_state, self.lab, self.resilience)
        self.predictions = PaddingPredictions()

    # -- the lifecycle points that involve several collaborators ----------------------------------------------------
    def after_process_group(self) -> None:
        """Every rank's device, the precision plugin, capacities, the lab and its groups (collectives)."""
        local = self.lab.describe_local()
        self.resilience.start_watchdog(local.host, local.name)
        devices = self.lab.gather(local)
        self.precision.install(devices)
        self.plan.resolve(devices, self.precision.compute_dtype())
        self.lab.build(devices, self.precision.table_columns(devices))
        self._add_callbacks()

    def _add_callbacks(self) -> None:
        """The callbacks the options ask for, added to the trainer once."""
        trainer = _compat.trainer_of(self.view.lightning_module)
        if trainer is None:
            return
        owner, options = type(self.view).__name__, self.options
        if self.resilience.preemption not in trainer.callbacks:
            trainer.callbacks.append(self.resilience.preemption)
        if options.observation.monitor and not any(isinstance(c, HeteroMonitor) for c in trainer.callbacks):
            trainer.callbacks.append(HeteroMonitor())
            rank_zero_info(f"{owner}(observation={{'monitor': True}}): added a HeteroMonitor callback to the trainer.")
        nonfinite = options.resilience.nonfinite
        if nonfinite != "ignore" and not any(isinstance(c, NonFiniteCheck) for c in trainer.callbacks):
            trainer.callbacks.append(NonFiniteCheck(nonfinite, [d.host for d in self.lab.lab.devices]))
            rank_zero_info(f"{owner}(resilience={{'nonfinite': '{nonfinite}'}}): added a NonFiniteCheck callback to "
                           "the trainer.")

    def on_save(self, checkpoint: dict[str, Any]) -> None:
        sampler = self.loaders.train_sampler
        epoch = sampler.sampler.epoch if sampler is not None else None
        self.resilience.on_save(checkpoint, epoch, self.share_state.position)

    def after_teardown(self) -> None:
        restore_inexact_resume_warning()
        self.shares.teardown()
        self.lab.restore()


def core_from_arguments(view: StrategyView, capacities: Any, global_batch_size: Optional[int], options: Options,
                        emulate: Any, precision_policy: Any, precision_plugin: Any,
                        sharded: bool = False, measure: Optional[Measure] = None,
                        replicas_of: Optional[ReplicasOf] = None) -> HeteroCore:
    """A strategy's core from its user-facing arguments, each checked with the argument named (``sharded``: the
    model's parameters are sharded, so its forward and backward issue collectives; ``measure``: how a layout whose
    replicas are not single ranks profiles them, :class:`~lightning_hetero.plan.profile_run.ShareProfiler`;
    ``replicas_of``: how such a layout groups its ranks, :class:`~lightning_hetero.plan.shares.SharePlan`)."""
    check("", "global_batch_size", global_batch_size, global_batch_size is None or (
        is_int(global_batch_size) and global_batch_size >= 1), "a positive integer or None")
    policy = parse_precision_policy(precision_policy)
    if policy is not None and precision_plugin is not None:
        raise ValueError("`precision_policy` and `precision_plugin` both set the precision: pass only one.")
    spec = parse_capacities(capacities)
    refused = sharded_refusals(spec.source, options.rebalance) if sharded else {}
    if refused:
        raise ValueError(next(iter(refused.values())))
    return HeteroCore(view, spec, global_batch_size, options, parse_emulate(emulate), policy, sharded,
                      measure, replicas_of)
