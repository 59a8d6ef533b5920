"""The share state of one training run: restored from a checkpoint, or planned anew, before the first batch.

:class:`ShareState` is the part the strategy saves in checkpoints under ``"shares"`` (every rank's copy is the same):
the profiling record, the memory caps, the training sampler's share schedule, the rebalancer's moving average and
counters, the position in the epoch and the lab's device classes. When the training loader is built (before its first
batch is drawn) it restores that state, or has the profiler plan shares when there is none to keep (a fresh run, a
changed lab, another world size), and starts the rebalancer; the sampler's position is Lightning's restored batch
progress (checked against the saved one at the first batch).

Example::

    state = ShareState(view, plan, lab, profiler, controller)
    rank_states.register("shares", state)
    state.on_train_loader(train_sampler, train_loader)
"""

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hetero.plan.profile_run import ShareProfiler
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.plan.shares import LabView, PlannedSampler, SharePlan
from lightning_hetero.view import StrategyView
from lightning_hetero.view import running_strategy


class ShareState:
    """The checkpointed share state and the resume of one training run (see the module docstring)."""

    def __init__(self, view: StrategyView, plan: SharePlan, lab: LabView, profiler: ShareProfiler,
                 controller: ShareController) -> None:
        self.view = view
        self.plan = plan
        self.lab = lab
        self.profiler = profiler
        self.controller = controller
        self.sampler: Optional[PlannedSampler] = None
        self.position = 0  # batches of the current epoch whose step has run
        self._restored: Optional[dict[str, Any]] = None
        self._expect_batch: Optional[int] = None
        self._devices: Optional[list[str]] = None  # the lab's device classes, saved to detect changed cards

    # -- checkpoint ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        caps = self.plan.caps
        return {
            "profile": self.profiler.state_dict(),
            "caps": None if caps is None else list(caps),
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            **self.controller.state_dict(),
            "position": self.position,
            "devices": self._devices,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Applied when the training loader is built (Lightning restores callbacks before that).
        self._restored = dict(state)

    def reshard(self, states: list[Optional[dict[str, Any]]], rank: int, world_size: int) -> Optional[dict[str, Any]]:
        """A checkpoint of another world size: keep the global position (epoch, global batch index, global batch
        size) and plan shares anew for the ranks that are here. Every rank's saved copy is the same."""
        state = next((s for s in states if s is not None), None)
        if state is None:
            return None
        sampler = state.get("sampler")
        return {
            "position": state.get("position", 0),
            "sampler": None if sampler is None else {**sampler, "changes": None},
            "replan": f"the checkpoint was written by {len(states)} ranks, this job has {world_size}",
        }

    # -- start of training -----------------------------------------------------------------------------------------
    def on_train_loader(self, sampler: PlannedSampler, dataloader: Any) -> None:
        """Before the loader's first batch is drawn: restore a resumed run's shares, or profile (a collective)."""
        self.sampler = sampler
        plan = self.plan
        trainer = self._trainer()
        restored, self._restored = self._restored, None
        if restored is None and trainer.fit_loop.restarting:  # e.g. a checkpoint of Lightning's `DDPStrategy`
            restored = {"replan": "the checkpoint holds no share state (another strategy wrote it)"}
        self._devices = [d.device_class for d in self.lab.lab.devices]
        replan = None if restored is None else _replan_reason(restored, self._devices)
        if restored is not None:
            self._restore(restored, sampler, trainer, replan is not None)
            if replan is not None:
                rank_zero_info(f"{running_strategy()} resume: {replan}; shares are planned for this lab "
                               f"(capacities '{plan.source}').")
        if restored is None or replan is not None:
            # The loader's schedule starts from the shares in force (profiled, or rebalanced before a loader reload).
            self.profiler.plan_shares(sampler, dataloader)
        self.lab.add_columns(self.profiler.table_columns())
        self.controller.start(sampler)

    def on_train_batch_start(self, batch_idx: int) -> None:
        """The first batch after a resume is the saved position; later ones count it on."""
        if self._expect_batch is not None:
            expected, self._expect_batch = self._expect_batch, None
            if batch_idx != expected:
                raise RuntimeError(
                    f"{running_strategy()} resumed its sampler at global batch {expected} but Lightning resumed at "
                    f"batch_idx {batch_idx}; samples would be lost or repeated."
                )
        self.position = batch_idx + 1

    def _trainer(self) -> Any:
        module = self.view.lightning_module
        assert module is not None
        return module.trainer

    def _restore(self, state: dict[str, Any], sampler: PlannedSampler, trainer: Any, replan: bool) -> None:
        if not replan:  # measurements of other devices (or another world size) say nothing about these
            self.profiler.load_state_dict(state.get("profile"))
            self.controller.load_state_dict(state)
        saved_g = (state.get("sampler") or {}).get("global_batch_size")
        explicit_g = self.plan.global_batch_size
        if saved_g is not None and explicit_g is not None and saved_g != explicit_g:
            raise ValueError(
                f"`global_batch_size`={explicit_g} but the checkpoint was trained with a global batch of {saved_g}: "
                "the position in the epoch and the optimizer's hyper-parameters refer to it. Leave "
                "`global_batch_size` unset (the checkpoint's is kept) or start a new run."
            )
        if saved_g is not None and saved_g != sampler.global_batch_size:
            rank_zero_info(f"{running_strategy()} resume: keeping the checkpoint's global batch of {saved_g} samples "
                           f"(the loader's batch_size x {sampler.world_size} ranks would give "
                           f"{sampler.global_batch_size}).")
            sampler.global_batch_size = int(saved_g)  # before counting the epoch's batches below
        fit_loop = trainer.fit_loop
        # Lightning restarts a map-style loader from its first batch but continues batch_idx from its restored
        # progress (`ready`); the sampler skips exactly those batches so index k is still global batch k.
        start = fit_loop.epoch_loop.batch_progress.current.ready if fit_loop.restarting else 0
        epoch = fit_loop.epoch_progress.current.processed
        limit = trainer.limit_train_batches
        batches = len(sampler) if isinstance(limit, float) and limit == 1.0 else (
            min(len(sampler), limit) if isinstance(limit, int) else int(len(sampler) * limit))
        # A stream without a length knows its last batch only from Lightning's saved `is_last_batch`.
        if start >= batches or (start and fit_loop.epoch_loop.batch_progress.is_last_batch):
            # Saved after the epoch's last batch: Lightning closes that epoch and draws the next one from the
            # iterator it creates now, so that iterator must already be the next epoch's, from its first batch.
            start, epoch = 0, epoch + 1
        if state.get("sampler") is not None:
            sampler.load_state_dict(state["sampler"], start_batch=start)
        else:
            sampler.start_batch = start
            if start:
                rank_zero_warn(
                    f"{running_strategy()} resume: the checkpoint stopped at batch {start} of epoch {epoch} but holds "
                    "no "
                    "sampler state of this strategy, so which samples that epoch had drawn is unknown. The epoch goes "
                    f"on from global batch {start} of this strategy's order: some of its samples may repeat or be "
                    "missed. From the next epoch on every sample is seen once."
                )
        if not replan:
            # On a changed lab the saved shares are dropped: this lab's are planned after this.
            self._restore_shares(state, sampler)
        sampler.sampler.set_epoch(epoch)
        self.position = start
        self._expect_batch = start if start else None

    def _restore_shares(self, state: dict[str, Any], sampler: PlannedSampler) -> None:
        """The saved schedule of the saved epoch, change by change, through the plan's one writer."""
        changes = (state.get("sampler") or {}).get("changes") or [(0, self.plan.capacities, state.get("caps"))]
        for first_batch, capacities, caps in changes:
            self.plan.adopt(capacities, "restored", caps=caps or None, first_batch=int(first_batch),
                            epoch=sampler.sampler.epoch)


def _replan_reason(state: dict[str, Any], devices: list[str]) -> Optional[str]:
    """Why a restored share state cannot be kept on this lab (``None``: same world size and cards)."""
    if state.get("replan"):
        return str(state["replan"])
    saved = state.get("devices")
    if saved is not None and list(saved) != devices:
        return f"the devices changed ({', '.join(saved)} -> {', '.join(devices)})"
    return None
