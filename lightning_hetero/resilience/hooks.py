"""The resilience of one strategy: the fault watchdog's phases, per-rank checkpoint state, preemption, teardown.

:class:`ResilienceHooks` is owned by :class:`~lightning_hetero.strategies.core.HeteroCore` and reads the Lightning
strategy through a :class:`~lightning_hetero.view.StrategyView`.

Example::

    hooks = ResilienceHooks(view, resilience_options)
    hooks.enter("forward/backward", batch=3)
"""

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import lightning_hetero._compat as _compat
from lightning_hetero.config import Resilience
from lightning_hetero.resilience.checkpoint import check_trainer_checkpoint, reopen_interrupted_epoch
from lightning_hetero.resilience.preemption import PreemptionHandler
from lightning_hetero.resilience.state import RandomState, RankStates
from lightning_hetero.resilience.watchdog import FaultMonitor
from lightning_hetero.view import StrategyView

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_hetero"


class ResilienceHooks:
    """Watchdog phases, the per-rank state in checkpoints (shares, RNG, ...), SIGTERM handling, teardown."""

    def __init__(self, view: StrategyView, options: Resilience) -> None:
        self.view = view
        self.options = options
        self.rank_states = RankStates()
        self.rng = RandomState()
        self.faults: Optional[FaultMonitor] = None
        # SIGTERM / SLURM requeue: every rank stops after the same step, saves, exits. A
        # callback: the batch end (where ModelCheckpoint saves, resumed exactly) has no strategy hook.
        self.preemption = PreemptionHandler(resume=options.resume, before_stop=self.stop_watchdog)

    def start_watchdog(self, host: str, device_name: str) -> None:
        """The fault watchdog of a multi-rank job (it names a rank that stops making progress, its host and device)."""
        view = self.view
        if view.world_size > 1:
            self.faults = FaultMonitor(view.global_rank, view.world_size, host, device_name, self.options.timeout)
            self.faults.start()
        self.rank_states.register("rng", self.rng)

    # -- phases ----------------------------------------------------------------------------------------------------
    def enter(self, phase: str, batch: Optional[int] = None, next_step: bool = False) -> None:
        """Tell the watchdog what this rank is doing (a new phase is progress)."""
        if self.faults is not None:
            trainer = _compat.trainer_of(self.view.lightning_module)
            step = trainer.global_step + int(next_step) if trainer is not None else None
            self.faults.enter(phase, step, batch)

    def in_phase(self, phase: str) -> AbstractContextManager[Any]:
        return self.faults.phase(phase) if self.faults is not None else nullcontext()

    def on_exception(self, exception: BaseException) -> None:
        # The others learn of it; the exception gets the job's cause as a note.
        if self.faults is not None:
            try:
                self.faults.on_exception(exception)
            # Never hide the user's exception behind the watchdog's.
            except Exception as err:
                log.warning(f"lightning_hetero: could not report the failure to the other ranks: {err!r}")

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def on_load(self, checkpoint: dict[str, Any], path: Any) -> None:
        # A clear error for a foreign file, not a KeyError.
        check_trainer_checkpoint(checkpoint, path)
        # Earlier releases kept the per-rank state as a callback's state.
        state = checkpoint.get(CHECKPOINT_KEY) or checkpoint.get("callbacks", {}).get("lightning_hetero.RankState")
        if state is not None:
            self.rank_states.load_state_dict(state)

    def on_save(self, checkpoint: dict[str, Any], sampler_epoch: Optional[int], position: int) -> None:
        """Every rank's state into the checkpoint (a collective: Lightning saves on every rank)."""
        checkpoint[CHECKPOINT_KEY] = self.rank_states.state_dict()
        trainer = _compat.trainer_of(self.view.lightning_module)
        if sampler_epoch is not None and trainer is not None:
            # The sampler knows where the epoch stood; Lightning may have recorded it as finished.
            reopen_interrupted_epoch(checkpoint, sampler_epoch, position, trainer.num_training_batches)

    # -- teardown --------------------------------------------------------------------------------------------------
    def stop_watchdog(self) -> None:
        """Before a signal's agreed exit: the other ranks must not take it for a fault."""
        if self.faults is not None:
            self.faults.stop()

    def teardown(self) -> None:
        # First in the strategy's teardown: rank 0 keeps the store up until every rank got here.
        self.stop_watchdog()
        self.faults = None
