"""Checkpoint files that survive crashes, clear errors for bad ones, and the one to resume from (the furthest).

* :class:`AtomicCheckpointIO` (the strategy's default ``CheckpointIO``): a local checkpoint is written to a temporary
  file *in the same directory*, flushed to disk (``fsync``) and renamed over the target (``os.replace``), so a crash
  during a save leaves the previous file whole. Lightning's own ``TorchCheckpointIO`` writes through an fsspec
  transaction whose temporary file lives in ``$TMPDIR``: the final move is a copy (not atomic) when that is another
  file system, and nothing is synced.
* Loading a truncated, damaged or foreign file raises :class:`CheckpointError` naming the file and what is wrong.
* Every local save also writes ``<file>.sha256`` (``sha256sum -c`` reads it), hashed while the bytes are written and
  renamed into place with the file; a load verifies it, so a bit flip anywhere, a truncation or a lost checksum file is
  found before the weights are used. :func:`write_manifest` / :func:`verify_manifest` do the same for a checkpoint
  *directory* (sharded checkpoints).
* Files are created with the process's umask (as Lightning's are), and temporaries that a killed save left behind are
  removed by the next save or resume.
* :func:`choose_checkpoint`: the verified ``*.ckpt`` in some directories (``resume="auto"``) that records the most
  training progress (global step, then epoch: file times are a copy's after ``cp -r``); a damaged one is skipped with
  a warning naming it.

Example::

    trainer = Trainer(strategy=HeteroDDPStrategy(resilience=Resilience(resume="auto")),
                      callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_top_k=-1)])
    trainer.fit(model)  # the same command after a crash (or under `torchrun --max-restarts`) goes on from ckpts/
"""

import hashlib
import os
import re
import socket
import time
import zipfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero._compat import PathType
from lightning_hetero._compat import weights_only_argument
from lightning_hetero.resilience.progress import Progress, recorded_progress
from lightning_hetero.view import running_strategy

_PICKLE_PROTOCOL_2 = b"\x80"  # torch's legacy (non-zip) format starts with a pickle protocol opcode
CHECKSUM_SUFFIX = ".sha256"  # the checksum file next to each checkpoint file, in `sha256sum` format
MANIFEST_NAME = "checksums.sha256"  # a checkpoint directory's checksums, one line per file
_CHUNK = 8 << 20
# Our temporaries: ".<target>.<host>-<pid>-<8 hex>.tmp"; and "<target>.<8 chars>.tmp" from `tempfile.mkstemp`, which
# earlier versions used. The owner's host and pid tell a killed save's leftover from a save in progress.
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<host>[A-Za-z0-9-]*)-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$")
_LEGACY_TEMP = re.compile(r"^\.(?P<target>.+\.ckpt)\.[a-z0-9_]{8}\.tmp$")
# A temporary of another host (or of a live pid here) untouched this long is left over: a save rewrites it constantly.
STALE_AFTER_S = 600.0
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from: truncated, damaged, or not a Lightning checkpoint."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe, checksummed local writes, and verified loads with readable errors."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathType,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _compat.is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(directory)
        with _temporary(path) as (data_tmp, data), _temporary(path + CHECKSUM_SUFFIX) as (sum_tmp, sums):
            writer = _HashingWriter(data)
            torch.save(checkpoint, writer)
            _sync(data)
            sums.write(_checksum_line(writer.hexdigest(), os.path.basename(path)).encode())
            _sync(sums)
            os.replace(data_tmp, path)
            # A crash between the two renames leaves a file whose checksum does not match: found at load.
            os.replace(sum_tmp, path + CHECKSUM_SUFFIX)
        _fsync_dir(directory)  # the renames are durable only once the directory entries are on disk
        _remember_verified(path, writer.hexdigest())

    @override
    def load_checkpoint(
        self,
        path: PathType,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        load_options = weights_only_argument(super().load_checkpoint, weights_only)  # Lightning 2.5: no weights_only
        if not _compat.is_local_path(path) or not os.path.exists(path):  # Lightning's FileNotFoundError
            return super().load_checkpoint(path, map_location=map_location, **load_options)
        problem = check_checkpoint_file(path)
        if problem is not None and problem.startswith(_NO_CHECKSUM):
            rank_zero_warn(f"loading {os.fspath(path)!r} unverified: {problem}")  # e.g. written by plain Lightning
        elif problem is not None:
            raise CheckpointError(f"cannot resume from {os.fspath(path)!r}: {problem}")
        try:
            return super().load_checkpoint(path, map_location=map_location, **load_options)
        except RuntimeError as err:  # torch's zip reader on a damaged archive
            raise CheckpointError(f"cannot resume from {os.fspath(path)!r}: the file is damaged ({err}).") from err

    @override
    def remove_checkpoint(self, path: PathType) -> None:
        super().remove_checkpoint(path)
        if _compat.is_local_path(path) and os.path.isfile(os.fspath(path) + CHECKSUM_SUFFIX):
            os.remove(os.fspath(path) + CHECKSUM_SUFFIX)


def check_trainer_checkpoint(checkpoint: Any, path: PathType) -> None:
    """:class:`CheckpointError` unless ``checkpoint`` (read from ``path``) is a Lightning trainer checkpoint.

    Not part of :class:`AtomicCheckpointIO`: Lightning's launchers pass bare state dicts through the same IO.
    """
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        keys = sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(
            f"{os.fspath(path)!r} is not a Lightning checkpoint (it holds {keys}, no 'state_dict'). A bare model "
            "state_dict loads with `model.load_state_dict(torch.load(path))` before `fit`, without `ckpt_path`."
        )


_NO_CHECKSUM = "no checksum file"


def check_checkpoint_file(path: PathType) -> Optional[str]:
    """Why the local file at ``path`` cannot be used as a checkpoint, or ``None`` if it is whole and verified.

    The answer starts with ``"no checksum file"`` for a file that looks whole but has no ``<file>.sha256`` next to it
    (written by another ``CheckpointIO``, or its checksum file was lost): it cannot be verified.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return "it is a directory, not a checkpoint file."
    if not os.path.isfile(path):
        return "the file does not exist."
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty (0 bytes): a save was interrupted before any data was written."
    if not zipfile.is_zipfile(path):  # torch writes a zip archive whose directory sits at the end
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:2] == b"PK":
            return f"the file is truncated ({size} bytes, the zip archive has no end): a save was interrupted."
        if head[:1] != _PICKLE_PROTOCOL_2:  # torch's legacy format is a pickle
            return f"not a torch checkpoint ({size} bytes starting with {head!r})."
    expected = _read_checksum(path + CHECKSUM_SUFFIX, os.path.basename(path))
    if expected is None:
        return f"{_NO_CHECKSUM} {os.path.basename(path) + CHECKSUM_SUFFIX!r} next to it: it cannot be verified."
    if _verified.get(_identity(path)) == expected:
        return None
    actual = file_checksum(path)
    if actual != expected:
        return (f"the file is damaged: its SHA-256 is {actual[:12]}..., its checksum file says {expected[:12]}... "
                "(bytes changed after the save, or a save was cut between its two renames).")
    _remember_verified(path, actual)
    return None


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a resume goes on from, and why: the training ``progress`` it records (``None`` when unreadable),
    among ``candidates`` checkpoints; ``latest_written``: the most recently modified one when it records less."""

    path: str
    progress: Optional[Progress]
    candidates: int
    latest_written: Optional[tuple[str, Progress]] = None

    def describe(self, resume: str) -> str:
        """The one line a resume says."""
        if self.progress is None:
            line = (f"resume={resume!r}: going on from {self.path!r} (its progress cannot be read: the most recently "
                    f"modified of {self.candidates} found)")
        else:
            line = (f"resume={resume!r}: going on from {self.path!r} at {self.progress} (chosen by the progress each "
                    f"checkpoint records, not by file time; {self.candidates} found)")
        if self.latest_written is not None:
            path, progress = self.latest_written
            line += f"; the most recently modified, {path!r}, records {progress}"
        return line


@dataclass(frozen=True)
class _Candidate:
    path: str
    mtime: float
    progress: Optional[Progress]


def newest_checkpoint(directories: Iterable[PathType], exclude: Iterable[PathType] = ()) -> Optional[str]:
    """The path of :func:`choose_checkpoint`'s choice, or ``None``."""
    choice = choose_checkpoint(directories, exclude)
    return None if choice is None else choice.path


def choose_checkpoint(directories: Iterable[PathType], exclude: Iterable[PathType] = ()) -> Optional[ResumeChoice]:
    """The verified ``*.ckpt`` file (or sharded ``*.ckpt`` directory with its checksum manifest) in ``directories``
    that records the most training progress (global step, then epoch; the file time breaks ties), or ``None``.

    Progress is read from the checkpoint itself (:mod:`~lightning_hetero.resilience.progress`), not from file times,
    which are the copy's after ``cp -r``, ``rsync`` without ``-t`` or a download. Damaged files are skipped with a
    warning naming them; one whose progress cannot be read (truncated) is checked first, so it is named too. Files
    without a checksum file are used only when no file is verified (checkpoints written by another
    ``CheckpointIO``), the furthest first, with a warning; a directory without its manifest (an interrupted save, or
    the manifest deleted) is skipped with a warning saying so. Temporaries left by killed saves are removed on the
    way.
    """
    candidates = _candidates(directories, exclude)
    readable = sorted((c for c in candidates if c.progress is not None), key=lambda c: (c.progress, c.mtime),
                      reverse=True)
    unreadable = sorted((c for c in candidates if c.progress is None), key=lambda c: c.mtime, reverse=True)
    problems = {c.path: _problem(c.path) for c in unreadable}
    usable = [c for c in unreadable if problems[c.path] is None or _unverified_file(c.path, problems[c.path])]
    for c in unreadable:
        if c not in usable:
            rank_zero_warn(f"resume: skipping {c.path!r}: {problems[c.path]}")
    # A sound file that records no progress (not a Lightning checkpoint?) comes after every one that does.
    ordered = readable + usable
    unverified: list[tuple[_Candidate, str]] = []
    for candidate in ordered:
        problem = problems[candidate.path] if candidate.path in problems else _problem(candidate.path)
        if problem is None:
            for other, why in unverified:
                rank_zero_warn(f"resume: skipping {other.path!r}: {why}")
            return _choice(candidate, readable, len(candidates))
        if _unverified_file(candidate.path, problem):
            unverified.append((candidate, problem))
        else:
            rank_zero_warn(f"resume: skipping {candidate.path!r}: {problem}")
    if unverified:
        candidate, why = unverified[0]
        rank_zero_warn(f"resume: no verified checkpoint; using {candidate.path!r} unverified ({why})")
        return _choice(candidate, readable, len(candidates))
    return None


def _candidates(directories: Iterable[PathType], exclude: Iterable[PathType]) -> list[_Candidate]:
    skip = {os.path.abspath(os.fspath(p)) for p in exclude}
    candidates = []
    for directory in directories:
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            continue
        remove_stale_temporaries(directory)
        for name in os.listdir(directory):
            path = os.path.abspath(os.path.join(directory, name))
            if not name.endswith(".ckpt") or name.startswith(".") or path in skip:
                continue
            if os.path.isfile(path):
                mtime = os.path.getmtime(path)
            elif os.path.isfile(os.path.join(path, MANIFEST_NAME)):  # a sharded checkpoint, published whole
                mtime = os.path.getmtime(os.path.join(path, MANIFEST_NAME))
            elif os.path.isdir(path):  # no manifest: never used, but its skip is said where it is the further one
                mtime = os.path.getmtime(path)
            else:
                continue
            candidates.append(_Candidate(path, mtime, recorded_progress(path)))
    return candidates


def _problem(path: str) -> Optional[str]:
    return verify_manifest(path) if os.path.isdir(path) else check_checkpoint_file(path)


def _unverified_file(path: str, problem: str) -> bool:
    """A whole file without its checksum file: usable when nothing verified is there."""
    return problem.startswith(_NO_CHECKSUM) and not os.path.isdir(path)


def _choice(chosen: _Candidate, readable: list[_Candidate], count: int) -> ResumeChoice:
    latest = max(readable, key=lambda c: c.mtime, default=None)
    behind = (latest is not None and chosen.progress is not None and latest.progress is not None
              and latest.progress < chosen.progress and latest.mtime > chosen.mtime)
    return ResumeChoice(chosen.path, chosen.progress, count,
                        (latest.path, latest.progress) if behind else None)  # type: ignore[union-attr]


def find_resume_checkpoint(resume: str, directories: list[PathType]) -> Optional[str]:
    """The checkpoint that ``resume`` (``"auto"`` or a directory) goes on from, or ``None`` for a fresh start; either
    is said in one info line (the choice with the progress it records). A ``resume`` directory that does not exist is
    a ``ValueError``: a typo would otherwise train from scratch silently."""
    if resume != "auto":
        if os.path.isfile(resume):
            raise ValueError(f"`resilience.resume`={resume!r} is a file: pass a checkpoint file as "
                             "`fit(ckpt_path=...)`; `resume` accepts None, 'auto' or the directory checkpoints are "
                             "saved in.")
        if not os.path.isdir(resume):
            raise ValueError(f"`resilience.resume`={resume!r}: no such directory (accepted: None, 'auto' or an "
                             "existing directory of checkpoints; create it empty for a fresh start).")
    choice = choose_checkpoint(directories)
    if choice is None:
        rank_zero_info(f"resume={resume!r}: no checkpoint in {[os.fspath(d) for d in directories]}: a fresh start.")
        return None
    rank_zero_info(choice.describe(resume))
    return choice.path


def file_checksum(path: PathType) -> str:
    """SHA-256 of the file at ``path`` (hex), as ``sha256sum`` prints it."""
    digest, buffer = hashlib.sha256(), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:  # `hashlib.file_digest` does the same from Python 3.11
        while size := f.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def write_manifest(directory: PathType, threads: int = 4) -> str:
    """Write ``<directory>/checksums.sha256``: the SHA-256 of every file below ``directory`` (``sha256sum -c`` reads
    it); atomically, with the umask. Call it once every file of a (sharded) checkpoint is written; returns its path.
    """
    directory = os.fspath(directory)
    remove_stale_temporaries(directory)
    files = _directory_files(directory)
    digests = _checksums(directory, files, threads)
    target = os.path.join(directory, MANIFEST_NAME)
    with _temporary(target) as (tmp, out):
        out.write("".join(_checksum_line(d, f) for f, d in zip(files, digests)).encode())
        _sync(out)
        os.replace(tmp, target)
    _fsync_dir(directory)
    return target


def verify_manifest(directory: PathType, threads: int = 4) -> Optional[str]:
    """Why the checkpoint directory does not match its ``checksums.sha256`` (a file missing, added or changed, or no
    manifest), or ``None`` if every file matches."""
    directory = os.fspath(directory)
    manifest = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isdir(directory):
        return "the directory does not exist."
    if not os.path.isfile(manifest):
        return f"{_NO_CHECKSUM} {MANIFEST_NAME!r} in it: it cannot be verified (a save was interrupted?)."
    expected = {}
    with open(manifest, encoding="utf-8", errors="replace") as f:
        for line in f:
            digest, _, name = line.rstrip("\n").partition("  ")
            expected[name] = digest
    present = [f for f in _directory_files(directory) if not _TEMP.match(os.path.basename(f))]
    missing = sorted(set(expected) - set(present))
    if missing:
        return f"{len(missing)} file(s) of the manifest are missing: {missing[:4]}."
    added = sorted(set(present) - set(expected))
    if added:
        return f"{len(added)} file(s) not in the manifest: {added[:4]} (written after it, or a save was interrupted)."
    changed = [f for f, d in zip(present, _checksums(directory, present, threads)) if d != expected[f]]
    if changed:
        return f"{len(changed)} file(s) are damaged (SHA-256 differs from the manifest): {changed[:4]}."
    return None


def remove_stale_temporaries(directory: PathType) -> list[str]:
    """Remove the temporaries of our own naming in ``directory`` that a killed save left; returns their paths.

    One is left over when its writer (a pid on this host) is gone, or when it was not written to for
    ``STALE_AFTER_S`` seconds (another host's, or one written by an earlier version).
    """
    directory = os.fspath(directory)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        ours = _TEMP.match(name)
        if ours is None and _LEGACY_TEMP.match(name) is None:
            continue
        path = os.path.join(directory, name)
        try:
            idle = now - os.path.getmtime(path)
            writer_gone = ours is not None and ours["host"] == _HOST and not _pid_alive(int(ours["pid"]))
            if (writer_gone or idle > STALE_AFTER_S) and os.path.isfile(path):
                size = os.path.getsize(path)
                os.remove(path)
                removed.append(path)
                rank_zero_info(f"removed {path!r} ({size} bytes) left by an interrupted save")
        except FileNotFoundError:  # its writer renamed or removed it meanwhile
            continue
    return removed


class _HashingWriter:
    """A file object that hashes what ``torch.save`` writes (torch writes a file object strictly in order)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file, self._hash = file, hashlib.sha256()

    def write(self, data: Any) -> int:
        self._hash.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


@contextmanager
def _temporary(target: str) -> Iterator[tuple[str, IO[bytes]]]:
    """A new file next to ``target``, named as ours, created with the umask (``mkstemp`` forces 0600); removed unless
    the caller renamed it."""
    directory, name = os.path.split(os.path.abspath(target))
    while True:
        tmp = os.path.join(directory, f".{name}.{_HOST}-{os.getpid()}-{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            yield tmp, f
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _sync(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _checksum_line(digest: str, name: str) -> str:
    return f"{digest}  {name}\n"


def _read_checksum(path: str, name: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            digest, _, listed = f.readline().rstrip("\n").partition("  ")
    except OSError:
        return None
    # A checksum file naming another file (copied next to the wrong checkpoint) proves nothing.
    return digest if listed == name and re.fullmatch(r"[0-9a-f]{64}", digest) else None


# Files verified (or written) by this process, by identity: rank 0 verifies while choosing, then loads the same file.
_verified: dict[tuple, str] = {}


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_ino, st.st_size, st.st_ctime_ns  # ctime: any write or utime changes it


def _remember_verified(path: str, digest: str) -> None:
    _verified[_identity(path)] = digest


def _directory_files(directory: str) -> list[str]:
    """Every file below ``directory`` (relative, sorted), without the manifest."""
    files = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != MANIFEST_NAME:
                files.append(rel)
    return sorted(files)


def _checksums(directory: str, files: list[str], threads: int) -> list[str]:
    # hashlib releases the GIL on large reads: shards hash in parallel.
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return list(pool.map(lambda f: file_checksum(os.path.join(directory, f)), files))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


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
            f"{running_strategy()}: this checkpoint is taken after training stopped inside epoch {epoch} (at batch "
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
