"""The training progress a checkpoint records (global step, epoch), read without loading its tensors or running code.

``resume="auto"`` orders checkpoints by it: file times are the copy's after ``cp -r``, ``rsync`` without ``-t`` or a
download, and would send a resume back to whichever file happened to be copied last.

A ``torch.save`` file is a zip archive whose ``<name>/data.pkl`` holds the pickled object, tensors as references to
the archive's other records (torch's documented serialization layout). Only that pickle is read, by an unpickler that
imports nothing: every class or function it names becomes an inert placeholder and every tensor ``None``. A
checkpoint of many gigabytes costs the read of its small pickle; a file from anywhere cannot run code.

Example::

    progress = recorded_progress("ckpts/epoch=3-step=1200.ckpt")  # Progress(global_step=1200, epoch=3), or None
"""

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hetero._compat import PathType

# The name Lightning's sharded checkpoints use for the non-tensor part (resilience.sharded writes it; defined here, as
# that module imports torch's distributed checkpointing, which choosing a checkpoint does not need).
META_FILENAME = "meta.pt"


@dataclass(frozen=True, order=True)
class Progress:
    """Where training stood when a checkpoint was saved; compares as (``global_step``, ``epoch``)."""

    global_step: int
    epoch: int

    def __str__(self) -> str:
        return f"global step {self.global_step}, epoch {self.epoch}"


def recorded_progress(path: PathType) -> Optional[Progress]:
    """The progress a Lightning checkpoint at ``path`` records: a ``torch.save`` file, or a sharded checkpoint
    directory (its ``meta.pt``). ``None`` when it cannot be read (truncated, damaged, not a Lightning checkpoint)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, META_FILENAME)
    try:
        checkpoint = _load_pickle(path)
    except Exception:  # anything a damaged or foreign file makes the reader raise
        return None
    if not isinstance(checkpoint, dict):
        return None
    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    if type(step) is not int or type(epoch) is not int:
        return None
    return Progress(global_step=step, epoch=epoch)


def _load_pickle(path: str) -> Any:
    with zipfile.ZipFile(path) as archive:
        records = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
        if len(records) != 1:
            return None
        data = archive.read(records[0])
    return _InertUnpickler(io.BytesIO(data)).load()


class _Inert:
    """What any class or function named in the pickle becomes: takes any arguments and state, holds nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _InertUnpickler(pickle.Unpickler):
    """Imports nothing; tensors (persistent references to the archive's records) read as ``None``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict  # state dicts: keep them dicts
        return _Inert

    def persistent_load(self, pid: Any) -> None:
        return None
