"""Profiling at the start of training: time the user's model on every rank and write the measured shares into the plan.

:class:`ShareProfiler` runs :func:`~lightning_hetero.plan.profiling.profile_lightning_module` once, before the training
loader's first batch, on samples of that loader's own epoch order, and writes the measured capacities and memory caps
into the :class:`~lightning_hetero.plan.shares.SharePlan` (their one owner). It keeps the measurement as ``profile``:
a record of what was measured (shown in the lab table, saved in checkpoints), never read back as the capacities in
force.

Example::

    profiler = ShareProfiler(view, plan, lab, enabled=True, steps=4, memory_headroom=0.1, max_batch_per_rank=None,
                             measure=None)  # or a layout's own measurement (a pipeline timed as one replica)
    profiler.plan_shares(train_sampler, train_loader)  # a collective: every rank measures, all adopt the result
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hetero._compat import BatchNormBase
from lightning_hetero.lab.rehearsal import rehearsal
from lightning_hetero.plan.profiling import ProfileResult, profile_lightning_module, table_columns
from lightning_hetero.plan.shares import LabView, PlannedSampler, SharePlan
from lightning_hetero.plan.subset_check import check_profile, job_link
from lightning_hetero.view import StrategyView
from lightning_hetero.view import running_strategy


# How a layout measures its replicas when they are not single ranks: (sampler, loader) -> the profile, or None.
Measure = Callable[[PlannedSampler, Any], Optional[ProfileResult]]


class ShareProfiler:
    """The profiling run of one training job and its record (``profile``: measured, not the capacities in force)."""

    def __init__(self, view: StrategyView, plan: SharePlan, lab: LabView, enabled: bool, steps: int,
                 memory_headroom: float, max_batch_per_rank: Optional[int], sharded: bool = False,
                 measure: Optional[Measure] = None) -> None:
        self.view = view
        self.plan = plan
        self.lab = lab
        self.enabled = enabled
        self.steps = steps
        self.memory_headroom = memory_headroom
        self.max_batch_per_rank = max_batch_per_rank
        # A sharded step waits at every block for all ranks' all-gathers: its time is the slowest rank's, so the
        # profile gives memory caps only, and capacities stay the published rates.
        self.sharded = sharded
        self.profile: Optional[ProfileResult] = None
        # A layout whose replicas are not single ranks (a pipeline) measures its own way: (sampler, loader) -> result.
        self.measure = measure

    def plan_shares(self, sampler: PlannedSampler, dataloader: Any) -> None:
        """Profile once if asked (a collective) and adopt the measured capacities and caps; else the fixed caps."""
        plan = self.plan
        # One rank has nobody to share with: profiling it would only delay the first step. A rehearsed rank's
        # others do not exist (lab/rehearsal.py): it keeps the published rates its lab's cards would start from.
        # A sharded profile measures memory only, which exists on CUDA alone.
        measurable = not self.sharded or self.view.root_device.type == "cuda"
        if self.enabled and self.profile is None and sampler.world_size > 1 and rehearsal() is None and measurable:
            self.profile = (self.measure or self._run)(sampler, dataloader)
            if self.profile is not None:
                # A sharded profile gives memory caps only: its capacities stay the ones in force.
                if self.sharded:
                    plan.adopt(plan.capacities, plan.source, caps=self.profile.caps, epoch=sampler.sampler.epoch)
                else:
                    plan.adopt(self.profile.capacities, "profile", caps=self.profile.caps, epoch=sampler.sampler.epoch)
                    if self.measure is None:  # one rank per replica: the ranks' rates are the replicas'
                        self._warn_if_slow_ranks()
        if plan.caps is None and self.max_batch_per_rank is not None:
            plan.adopt(plan.capacities, plan.source, caps=(self.max_batch_per_rank,) * sampler.world_size,
                       epoch=sampler.sampler.epoch)

    def _warn_if_slow_ranks(self) -> None:
        """Say once, on rank 0, which ranks the measured rates say cost this job more than they add."""
        assert self.profile is not None and self.view.lightning_module is not None
        devices = self.lab.lab.devices
        emulated = self.lab.emulation.link if self.lab.emulation is not None else None
        grads = sum(p.numel() * p.element_size() for p in self.view.lightning_module.parameters() if p.requires_grad)
        found = check_profile(self.profile, [d.name for d in devices], grads,
                              job_link(self.view.root_device.type, [d.name for d in devices], emulated),
                              "gpu" if self.view.root_device.type == "cuda" else "cpu")
        if found:
            rank_zero_warn(f"{running_strategy()}: {found}")

    def table_columns(self) -> dict[str, list[str]]:
        """The lab table's columns of the measurement (or of the memory caps in force without one)."""
        if self.profile is not None:
            columns = table_columns(self.profile)
            if self.sharded:
                columns.pop("samples/s")  # timed in lockstep: not this rank's rate
            return columns
        if self.plan.caps is not None:
            return {"mem cap": [str(c) for c in self.plan.caps]}
        return {}

    # -- checkpoint (part of the share state, plan/state.py) ---------------------------------------------------------
    def state_dict(self) -> Optional[dict[str, Any]]:
        return None if self.profile is None else self.profile.state_dict()

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        self.profile = None if state is None else ProfileResult.from_state_dict(state)

    def _run(self, sampler: PlannedSampler, dataloader: Any) -> Optional[ProfileResult]:
        view = self.view
        module = view.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            rank_zero_warn(f"{running_strategy()}: manual optimization cannot be profiled; keeping "
                           f"'{self.plan.source}' capacities.")
            return None
        indices = sample_indices(sampler)
        emulator = self.lab.emulation
        result = profile_lightning_module(
            module,
            dataloader.dataset,
            dataloader.collate_fn,
            indices,
            sampler.global_batch_size,
            view.root_device,
            forward_context=view.precision_plugin.forward_context,
            steps=1 if self.sharded else self.steps,  # sharded: its times are not used, one step gives the peak
            headroom=self.memory_headroom,
            max_batch_per_rank=self.max_batch_per_rank,
            optimizers=view.optimizers,
            step_context=emulator.work if emulator is not None else _nothing,
            classes=[d.device_class for d in self.lab.lab.devices],
            lockstep=self.sharded,
            # A sharded model's step runs through its root, which gathers the root's own parameters.
            training_step=view.training_step if self.sharded else None,
            # Profiling trains BatchNorm layers on this rank's batch alone (never synced), which needs 2 samples.
            min_batch=2 if any(isinstance(m, BatchNormBase) for m in module.modules()) else 1,
            min_share=self.plan.min_share,
        )
        if result is None:
            rank_zero_warn(f"{running_strategy()}: `training_step` returned no loss to time; keeping "
                           f"'{self.plan.source}' capacities.")
            return None
        caps = f"memory caps {list(result.caps)}" if result.caps else "no memory caps (CPU)"
        if self.sharded:
            rank_zero_info(f"{running_strategy()} profiled the model in {result.cost_s:.2f} s: {caps}; capacities stay "
                           f"'{self.plan.source}' (a sharded step's time is the slowest rank's)")
            return result
        rates = ", ".join(f"{c:.4g}" for c in result.capacities)
        # Forward + backward only: the monitor's solo/s also counts the optimizer and per-step overhead.
        rank_zero_info(f"{running_strategy()} profiled the model in {result.cost_s:.2f} s: forward + backward "
                       f"samples/s at the planned split [{rates}]" + (f", {caps}" if result.caps else ""))
        return result


def sample_indices(sampler: PlannedSampler) -> list[int]:
    """The samples this rank times: up to a whole global batch (a refinement pass may time it at its possibly large
    share) of the epoch's order, from its own generator (nothing global advances)."""
    order = list(sampler.sampler)
    need = sampler.global_batch_size
    offset = sampler.rank * max(1, need // sampler.world_size)
    return [order[(offset + i) % len(order)] for i in range(need)]


@contextmanager
def _nothing() -> Iterator[None]:
    yield
