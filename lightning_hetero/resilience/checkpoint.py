"""Checkpoint files that survive crashes, clear errors for bad ones, and finding the newest one to resume from.

* :class:`AtomicCheckpointIO` (the strategy's default ``CheckpointIO``): a local checkpoint is written to a temporary
  file *in the same directory*, flushed to disk (``fsync``) and renamed over the target (``os.replace``), so a crash
  during a save leaves the previous file whole. Lightning's own ``TorchCheckpointIO`` writes through an fsspec
  transaction whose temporary file lives in ``$TMPDIR``: the final move is a copy (not atomic) when that is another
  file system, and nothing is synced.
* Loading a truncated, damaged or foreign file raises :class:`CheckpointError` naming the file and what is wrong.
* :func:`newest_checkpoint`: the most recent readable ``*.ckpt`` in some directories (``resume="auto"``).

Example::

    trainer = Trainer(strategy=HeteroDDPStrategy(resume="auto"),
                      callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_top_k=-1)])
    trainer.fit(model)  # the same command after a crash (or under `torchrun --max-restarts`) goes on from ckpts/
"""

import os
import tempfile
import zipfile
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_hetero._compat import PathType as _PATH
from lightning_hetero._compat import is_local_path as _is_local_file_protocol
from lightning_hetero._compat import weights_only_argument

_PICKLE_PROTOCOL_2 = b"\x80"  # torch's legacy (non-zip) format starts with a pickle protocol opcode


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from: truncated, damaged, or not a Lightning checkpoint."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe local writes and readable errors on load."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        _fsync_dir(directory)  # the rename itself is durable only once the directory entry is on disk

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        load_options = weights_only_argument(super().load_checkpoint, weights_only)  # Lightning 2.5: no weights_only
        if not _is_local_file_protocol(path) or not os.path.exists(path):  # Lightning's FileNotFoundError
            return super().load_checkpoint(path, map_location=map_location, **load_options)
        problem = check_checkpoint_file(path)
        if problem is not None:
            raise CheckpointError(f"cannot resume from {os.fspath(path)!r}: {problem}")
        try:
            return super().load_checkpoint(path, map_location=map_location, **load_options)
        except RuntimeError as err:  # torch's zip reader on a damaged archive
            raise CheckpointError(f"cannot resume from {os.fspath(path)!r}: the file is damaged ({err}).") from err


def check_trainer_checkpoint(checkpoint: Any, path: _PATH) -> None:
    """:class:`CheckpointError` unless ``checkpoint`` (read from ``path``) is a Lightning trainer checkpoint.

    Not part of :class:`AtomicCheckpointIO`: Lightning's launchers pass bare state dicts through the same IO.
    """
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        keys = sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(
            f"{os.fspath(path)!r} is not a Lightning checkpoint (it holds {keys}, no 'state_dict'). A bare model "
            "state_dict loads with `model.load_state_dict(torch.load(path))` before `fit`, without `ckpt_path`."
        )


def check_checkpoint_file(path: _PATH) -> Optional[str]:
    """Why the local file at ``path`` cannot be a readable torch checkpoint, or ``None`` if it looks whole.

    Cheap: torch writes a zip archive whose directory sits at the end, so a truncated file has none.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return "it is a directory, not a checkpoint file."
    if not os.path.isfile(path):
        return "the file does not exist."
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty (0 bytes): a save was interrupted before any data was written."
    if zipfile.is_zipfile(path):
        return None
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == _PICKLE_PROTOCOL_2:
        return None  # torch's legacy format: let torch read it
    if head[:2] == b"PK":
        return f"the file is truncated ({size} bytes, the zip archive has no end): a save was interrupted."
    return f"not a torch checkpoint ({size} bytes starting with {head!r})."


def newest_checkpoint(directories: Iterable[_PATH], exclude: Iterable[_PATH] = ()) -> Optional[str]:
    """The most recently written readable ``*.ckpt`` file in ``directories`` (``None`` if there is none).

    Unreadable files (truncated by a writer that is not atomic) are skipped with a warning naming them.
    """
    skip = {os.path.abspath(os.fspath(p)) for p in exclude}
    candidates = []
    for directory in directories:
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            path = os.path.abspath(os.path.join(directory, name))
            if name.endswith(".ckpt") and not name.startswith(".") and path not in skip and os.path.isfile(path):
                candidates.append((os.path.getmtime(path), path))
    for _, path in sorted(candidates, reverse=True):
        problem = check_checkpoint_file(path)
        if problem is None:
            return path
        rank_zero_warn(f"HeteroDDPStrategy resume: skipping {path!r}: {problem}")
    return None


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def reopen_interrupted_epoch(checkpoint: dict[str, Any], epoch: int, position: int, batches: int) -> bool:
    """Make a checkpoint of a fit that stopped inside an epoch resume inside it; ``True`` if it was changed.

    When ``fit`` stops mid-epoch (``max_steps``, ``should_stop``), Lightning closes the epoch, and a checkpoint taken
    then (``trainer.save_checkpoint`` after ``fit``, or at ``on_train_epoch_end``) resumes at the *next* epoch with
    the batch index of this one: the rest of the epoch and as many batches of the next are skipped. ``position``
    batches of ``epoch`` have run (of ``batches``); the loop counters are rewritten to what a checkpoint taken at
    that batch's ``on_train_batch_end`` holds, which Lightning resumes from exactly.
    """
    if not 0 < position < batches:
        return False
    try:
        loop = checkpoint["loops"]["fit_loop"]
        epochs = loop["epoch_progress"]
        batch = loop["epoch_loop.batch_progress"]
        if epochs["current"]["processed"] != epoch + 1:
            return False  # the epoch is still open: Lightning resumes it by itself
        if batch["current"]["ready"] != position:
            raise KeyError("batch position")
    except (KeyError, TypeError) as err:
        raise RuntimeError(
            f"HeteroDDPStrategy: this checkpoint is taken after training stopped inside epoch {epoch} (at batch "
            f"{position} of {batches}), and its loop state has an unexpected layout ({err}); a resume from it would "
            "skip the rest of the epoch. Save from a `ModelCheckpoint(every_n_train_steps=...)` instead."
        ) from err
    closed = epochs["current"]["processed"] - epoch
    for tracker in (epochs["current"], epochs["total"]):
        tracker["processed"] -= closed
        tracker["completed"] = min(tracker["completed"], tracker["processed"])
    if batch["current"]["completed"] == position:  # the last batch counted as completed: undo as at batch end
        batch["current"]["completed"] -= 1
        batch["total"]["completed"] -= 1
        state = loop.get("epoch_loop.state_dict", {})
        if "_batches_that_stepped" in state:
            state["_batches_that_stepped"] -= 1
    checkpoint["epoch"] = epoch
    return True
