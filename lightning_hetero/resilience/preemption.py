"""SIGTERM and pre-emption: every rank stops after the same optimizer step, saves, and exits.

A signal reaches the ranks of a job at different times, or only some of them (the launcher's parent, one host). Each
rank's handler only notes it; after every optimizer step the ranks take the maximum of their notes in one small
all-reduce, and read it one optimizer step later, so all of them see the stop at the same step. The one-step lag
keeps the check off the critical path on GPUs: the all-reduce is queued behind the step's work and its result read
once that step's work is done (by then the GPU is busy with the next step), instead of the host waiting for the
GPU at every step's end, which left the GPU idle while the host prepared the next step. Then, on every rank: the
fault watchdog is stopped (an exit is not a fault), a checkpoint is written to ``preempted.ckpt`` in the ``resume``
directory or the first ``ModelCheckpoint`` directory (if there is none, no checkpoint), and the process exits with
``128 + signal`` (143 for SIGTERM): ``torchrun --max-restarts`` or a requeued job runs the same command again and
``resume`` goes on from it.

With ``SLURMEnvironment(auto_requeue=True)``, its requeue signal (SIGUSR1 unless configured) is handled the same way,
and at the agreed step Lightning's own SLURM requeue runs on every rank (HPC checkpoint, ``scontrol requeue``).
Lightning's own SIGTERM handler is replaced while training runs: it broadcasts from inside the handler, a collective
that the other ranks do not join. With it replaced, Lightning's SIGTERM flag stays unset, so the flag's broadcast that
Lightning's training loop makes before every batch (a device tensor read back with ``.item()``: on GPUs the host
waits for the device at every step) is turned off too while this handler is installed.

The fork/spawn launcher's parent is no rank: :func:`forwarding_signals` makes it pass the signal on to its ranks and
exit with their code.

Example::

    # HeteroDDPStrategy adds the handler to the trainer's callbacks
    trainer = Trainer(strategy=HeteroDDPStrategy(resilience=Resilience(resume="auto")),
                      callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500)])
    trainer.fit(model)   # `kill -TERM <pid>`: ckpts/preempted.ckpt, exit 143; run again: goes on from it
"""

import atexit
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer

import lightning_hetero._compat as _compat
from lightning_hetero._compat import slurm_requeue

CHECKPOINT_NAME = "preempted.ckpt"
FORWARD_DEADLINE_S = 30.0  # after passing a signal on, the launching process kills the ranks still running


class Preempted(SystemExit):
    """Raised on every rank after a signal stopped training (and the checkpoint is written): exit code 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def _exit_codes(signals: tuple[int, ...]) -> set[int]:
    return {128 + s for s in signals}


def stop_signals(environment: Any) -> tuple[int, ...]:
    """SIGTERM, and the SLURM requeue signal when Lightning's SLURM auto-requeue is on."""
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return signal.SIGTERM, int(environment.requeue_signal)
    return (signal.SIGTERM,)


class PreemptionHandler(Callback):
    """Stops every rank after the same optimizer step once any rank got a stop signal (see the module docstring).

    Args:
        resume: the strategy's ``resume`` (a directory: the checkpoint goes there; else the first ``ModelCheckpoint``
            directory).
        before_stop: called on every rank once the stop is agreed, before the save (stops the fault watchdog).
    """

    def __init__(self, resume: Optional[str] = None, before_stop: Optional[Callable[[], None]] = None) -> None:
        self.resume, self.before_stop = resume, before_stop
        self.received: Optional[int] = None  # the first stop signal this process got
        self.requeue_signal: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._checked_step = -1
        self._rank = 0
        # The notes all-reduced after the last optimizer step, on their way to the host (read after the next one).
        self._pending: Optional[_Notes] = None
        # Puts Lightning's per-step SIGTERM-flag broadcast back (see the module docstring).
        self._restore_broadcast: Callable[[], None] = _nothing

    # -- signal handling (main thread) --------------------------------------------------------------------------
    def install(self, signals: tuple[int, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only: nothing to install from here
        for signum in signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        restore, self._restore_broadcast = self._restore_broadcast, _nothing
        restore()
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # No collective and no I/O here: the main thread may be anywhere, even inside a collective. Nothing is printed
        # yet either: a launcher also sends SIGTERM when a peer died, and then the fault report must come first.
        if self.received is None:
            self.received = signum

    # -- Lightning hooks ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning registered its handlers (they run in `Trainer._run`, after the strategy's setup).
        signals = stop_signals(trainer.strategy.cluster_environment)
        self.requeue_signal = signals[1] if len(signals) > 1 else None
        self._checked_step, self._rank = trainer.global_step, trainer.global_rank
        self._pending = None
        self.install(signals)
        if signal.SIGTERM in self._previous and trainer.world_size > 1:
            # Lightning's SIGTERM handler is replaced: its flag stays 0, its per-step broadcast is a host wait only.
            self._restore_broadcast = _compat.skip_sigterm_broadcast(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._checked_step:
            return  # accumulating gradients: stop only where an optimizer step ended (every rank steps together)
        self._checked_step = trainer.global_step
        agreed = self.agree(trainer)
        if agreed is not None:
            self.stop(trainer, agreed)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._pending = None
        self.uninstall()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.uninstall()

    # -- the stop -------------------------------------------------------------------------------------------------
    def agree(self, trainer: Trainer) -> Optional[int]:
        """The stop signal any rank got (the requeue signal first), the same on every rank; ``None``: go on.

        With several ranks the answer is that of the previous optimizer step's notes: this step's are all-reduced on
        the device now and read at the next call, so the host never waits here for the step it just queued."""
        received = self.received
        if trainer.world_size == 1 or not dist.is_initialized():  # nobody to agree with: no device work, no sync
            return None if received is None else int(received)
        device = trainer.strategy.root_device
        # Filled on the device: a tensor made from a Python list would be copied from the host, which waits for the
        # CUDA stream.
        notes = torch.zeros(2, dtype=torch.int32, device=device)
        if received is not None:  # a fill kernel (item assignment would copy a host scalar: a stream wait)
            notes[1 if received == self.requeue_signal else 0].fill_(1)
        dist.all_reduce(notes, op=dist.ReduceOp.MAX)  # one collective (the strategy's `reduce` adds a barrier)
        pending, self._pending = self._pending, _Notes.copy_to_host(notes)
        if pending is None:
            return None
        term, requeue = pending.read()
        if requeue:
            return self.requeue_signal
        return int(signal.SIGTERM) if term else None

    def checkpoint_path(self, trainer: Trainer) -> Optional[str]:
        """Where the stop's checkpoint goes: the ``resume`` directory, else the first ``ModelCheckpoint``'s."""
        if self.resume not in (None, "auto"):
            return os.path.join(self.resume, CHECKPOINT_NAME)
        directory = next((cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)), None)
        return os.path.join(directory, CHECKPOINT_NAME) if directory else None

    def stop(self, trainer: Trainer, signum: int) -> None:
        """On every rank at once: save (if asked for), requeue (SLURM), exit with ``128 + signum``."""
        began = time.monotonic()
        if self.received is not None:
            _say(self._rank, f"received {signal.Signals(self.received).name}: every rank stops after this step")
        if self.before_stop is not None:
            self.before_stop()
        path = None
        if signum == self.requeue_signal:
            slurm_requeue(trainer, signum)  # saves Lightning's HPC checkpoint, which a requeued job restores
        else:
            path = self.checkpoint_path(trainer)
            if path is not None:
                trainer.save_checkpoint(path)  # every rank calls it: barriers around rank 0's write
        if trainer.is_global_zero:
            saved = f", saved {path}" if path else (", requeued" if signum == self.requeue_signal else "")
            _say(self._rank, f"stopped after step {trainer.global_step} on {signal.Signals(signum).name}{saved} "
                 f"({time.monotonic() - began:.1f} s); exiting with {128 + signum}")
        self.uninstall()
        _exit_quickly()
        raise Preempted(signum)


def _nothing() -> None:
    pass


class _Notes:
    """All-reduced stop notes on their way to the host: a non-blocking copy and, on CUDA, the event that ends it."""

    def __init__(self, values: torch.Tensor, done: Optional[Any]) -> None:
        self.values, self.done = values, done

    @classmethod
    def copy_to_host(cls, notes: torch.Tensor) -> "_Notes":
        if notes.device.type != "cuda":  # CPU: the values are there; other devices: read them as they come
            return cls(notes, None)
        values = notes.to("cpu", non_blocking=True)  # into pinned memory, behind the all-reduce on the stream
        done = torch.cuda.Event()
        done.record()
        return cls(values, done)

    def read(self) -> tuple[bool, bool]:
        """(SIGTERM noted, requeue signal noted) on any rank. Waits for the copy only (a step ago on CUDA)."""
        if self.done is not None:
            self.done.synchronize()
        term, requeue = self.values.tolist()
        return bool(term), bool(requeue)


@contextmanager
def forwarding_signals(launcher: Any) -> Iterator[None]:
    """While Lightning's fork/spawn ``launcher`` runs: its launching process (no rank) passes SIGTERM (and the SLURM
    requeue signal) on to its ranks, and exits with their code once they stopped on it. Without it the parent dies
    and the ranks train on."""
    signals = stop_signals(_compat.launcher_strategy(launcher).cluster_environment)
    # Ranks that do not end within the deadline (stuck in C code, a hung collective) are killed, as torchrun does.
    deadline = threading.Timer(FORWARD_DEADLINE_S, lambda: launcher.kill(signal.SIGKILL))
    deadline.daemon = True

    def forward(signum: int, frame: Optional[FrameType]) -> None:
        launcher.kill(signum)
        if deadline.ident is None:  # the first signal starts the clock
            deadline.start()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            previous[signum] = signal.signal(signum, forward)
    _FORWARDING.update(previous)
    try:
        yield
    except torch.multiprocessing.ProcessExitedException as err:
        if err.exit_code in _exit_codes(signals):  # the ranks stopped on a signal (and said so)
            _exit_quickly()
            raise Preempted(err.exit_code - 128) from None
        raise
    finally:
        deadline.cancel()
        _FORWARDING.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


# Signal -> the handler before a launcher's forwarding, while a launch runs. A forked rank must not inherit the
# forwarding: it would pass its own SIGTERM to its siblings, and (a Python handler) could not end it while it is
# inside C code before its own handlers are installed.
_FORWARDING: dict[int, Any] = {}


def _drop_forwarding_in_child() -> None:
    for signum, handler in _FORWARDING.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _FORWARDING.clear()


os.register_at_fork(after_in_child=_drop_forwarding_in_child)


def _exit_quickly() -> None:
    """Skip the interpreter's final garbage collection at exit: over every object of torch and Lightning it took
    seconds of CPU on a loaded host (0.4-0.8 s with it skipped), time a pre-empted job does not have. Registered at
    exit, so a caller that catches the ``SystemExit`` keeps a normal collector."""
    atexit.register(gc.freeze)  # the last one registered runs first: the user's exit handlers still run after it


def _say(rank: int, message: str) -> None:
    sys.stderr.write(f"[rank {rank}] lightning_hetero: {message}\n")
    sys.stderr.flush()
