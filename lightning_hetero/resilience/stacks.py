"""Where a rank's training thread is, read off its stack: the phase (a DataLoader's fetch, a Lightning hook) and the
line it runs, from the watchdog thread or from an exception's traceback.

Example::

    >>> reader = PhaseReader.of_lightning()
    >>> reader.phase_of(frames(tb=error.__traceback__))      # "data", "on_train_epoch_end", or None
    >>> where(thread_frame(trainer_thread), phase="forward/backward")
    ('/job/model.py:71 in training_step: time.sleep(600)', False)
"""

import os
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Optional

# Frames that mean "waiting for the other ranks": their collective timeout, not the watchdog, ends the wait.
_PEER_WAIT_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep, os.sep + os.path.join("torch", "autograd"))
_PEER_WAIT_PHASES = ("collective",)
# A DataLoader's own frames: the rank is loading data, whatever phase it announced last.
_DATA_FILES = os.sep + os.path.join("torch", "utils", "data") + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"]


def lightning_hooks() -> frozenset[str]:
    """Names of the Lightning hooks (module, data module, callback) that name a phase when they fail or hang; the
    ``*_step`` hooks are left to the strategy's finer phases (``forward/backward``, ``validation`` ...)."""
    try:
        from lightning.pytorch import Callback
        from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
    except ImportError:
        return frozenset()
    names = {n for c in (Callback, ModelHooks, DataHooks, CheckpointHooks) for n in vars(c) if not n.startswith("_")}
    return frozenset(names - {"state_dict", "load_state_dict", "state_key"})


def _hook_owners() -> tuple[type, ...]:
    try:
        from lightning.pytorch import Callback, LightningDataModule, LightningModule
    except ImportError:
        return ()
    return (Callback, LightningDataModule, LightningModule)


@dataclass(frozen=True)
class PhaseReader:
    """Reads the phase a stack shows. ``hooks``: names that label a phase; ``owners``: the classes whose methods of
    those names count (a user's own ``setup`` function does not)."""

    hooks: frozenset[str]
    owners: tuple[type, ...]

    @classmethod
    def of_lightning(cls, hooks: Optional[frozenset[str]] = None) -> "PhaseReader":
        return cls(lightning_hooks() if hooks is None else hooks, _hook_owners())

    def phase_of(self, stack: Sequence[FrameType]) -> Optional[str]:
        """The phase the stack shows, innermost frame first: a DataLoader's code is ``data``; a Lightning hook of a
        module, data module or callback is its own name (``on_train_epoch_end``)."""
        for frame in reversed(stack):
            if _DATA_FILES in frame.f_code.co_filename:
                return "data"
            name = frame.f_code.co_name
            if name in self.hooks and isinstance(frame.f_locals.get("self"), self.owners):
                return name
        return None


def frames(tb: Optional[TracebackType] = None, frame: Optional[FrameType] = None) -> list[FrameType]:
    """Frames outermost first: of a traceback (down to where it was raised) or of a live stack."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    while frame is not None:
        out.insert(0, frame)
        frame = frame.f_back
    return out


def thread_frame(thread_id: int) -> Optional[FrameType]:
    """The innermost frame a thread runs now (``None``: the thread has ended)."""
    return sys._current_frames().get(thread_id)


def where(frame: Optional[FrameType], phase: str) -> tuple[str, bool]:
    """Where a thread is (its innermost frame outside the standard library) and whether it waits for the other ranks
    there (in a collective, or in torch's distributed or autograd code)."""
    if frame is None:
        return "", False
    stack = traceback.extract_stack(frame)
    top = next((f for f in reversed(stack) if not _is_stdlib(f.filename)), stack[-1])
    waiting = phase in _PEER_WAIT_PHASES or any(s in top.filename for s in _PEER_WAIT_FILES)
    return f"{top.filename}:{top.lineno} in {top.name}" + (f": {top.line}" if top.line else ""), waiting


def last_lines(frame: Optional[FrameType], depth: int = 8) -> str:
    """The innermost ``depth`` entries of a live stack, formatted as a traceback."""
    return "".join(traceback.format_stack(frame)[-depth:]) if frame is not None else ""


def _is_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "-packages" not in filename
