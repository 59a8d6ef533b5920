"""What one training step adds to a rank's device memory, measured before training: a forward and backward of the
rank's share and of half of it, as the rank will run them (its precision, its blocks' checkpoint and offload choices,
FSDP's gathered and prefetched blocks, the logits and the loss), each measured as the peak over the resting state.

A step's peak is linear in its samples: ``fixed + per_sample × b``. ``fixed`` is what a step holds whatever its
batch (gathered blocks, their casts, the new gradient shards, kernel workspaces); ``per_sample`` is one sample's
activations, everything outside the blocks included (a GPT's fp32 logits, vocabulary × sequence, are often the
largest). Two points give both. They are taken at the top of the range (the share and half of it), not at 1 and 2
samples: a step's peak is the larger of the forward's end and a moment in the backward, each linear in the samples
with its own slope, so the slope at few samples can miss the one at the share (on a small GPT, 16 % low). A rank whose
share is one sample is measured at one sample only, and its one point is taken as all per-sample.

Peaks are read from CUDA's caching allocator; elsewhere (CPU) from the storages every tensor operation creates and
frees, followed by :class:`LiveBytes`.

A peak is measured over the resting state, and the plan counts the model's part of that state (parameters, gradients,
optimizer state) from its sizes. The rest of it is measured too (``resident``): on CUDA all else the allocator
holds (the model's buffers, kernel workspaces earlier work allocated, 32 MiB a stream on Hopper, tensors the job
keeps), elsewhere the buffers. It stays allocated through training; uncounted, it left an offloaded rank's plan 10 %
under its peak (2 GPUs, 2026-11-27).

Example::

    >>> StepBytes.from_points({2: 5 * 2**20, 4: 9 * 2**20}, "allocator")
    StepBytes(fixed=1048576, per_sample=2097152, source='allocator', samples=(2, 4))
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

import weakref

import torch

import lightning_hetero._compat as _compat

# Measured sources, by device: the allocator's peak (CUDA), torch's memory tracker (elsewhere).
SOURCES = ("allocator", "live tensors")


@dataclass(frozen=True)
class StepBytes:
    """A step's bytes over the resting state: ``fixed + per_sample × samples`` (measured at ``samples``)."""

    fixed: int
    per_sample: int
    source: str
    samples: tuple[int, ...]
    resident: int = 0  # what the device held before the trials besides the model's state (:func:`resident_bytes`)

    def at(self, samples: int) -> int:
        return self.fixed + self.per_sample * samples

    @classmethod
    def from_points(cls, points: Mapping[int, int], source: str) -> "StepBytes":
        """The line through two measured points (samples -> peak bytes), or with one point everything per sample."""
        counts = sorted(points)
        if not counts or counts[0] < 1:
            raise ValueError(f"step bytes need points at 1 sample or more, got {dict(points)}")
        if len(counts) == 1:
            return cls(0, points[counts[0]] // counts[0], source, tuple(counts))
        low, high = counts[0], counts[-1]
        per_sample = max(0, (points[high] - points[low]) // (high - low))
        return cls(max(0, points[low] - per_sample * low), per_sample, source, tuple(counts))


def measured_samples(share: int, least: int = 1) -> tuple[int, int]:
    """The sample counts a rank of ``share`` samples (a forward/backward's) measures: half of it and all of it, or one
    count twice when its steps never hold more (every rank runs as many trials: they meet in the same collectives).
    No trial has fewer than ``least`` samples (2 where BatchNorm layers train: one sample has no batch statistics).

    Example::

        >>> measured_samples(7), measured_samples(2), measured_samples(1), measured_samples(0), measured_samples(3, 2)
        ((3, 7), (1, 2), (1, 1), (1, 1), (2, 3))
    """
    low, high = max(least, share // 2), max(least, share, 1)
    return (low, high) if low < high else (high, high)


class LiveBytes(_compat.TorchDispatchMode):
    """The bytes of the tensor storages on ``device`` created inside it and still alive, and their peak: each output
    storage of an operation counted once, until it is freed or resized (FSDP frees and refills its gathered
    parameters' storages by resizing them, which no operation reports). Sparse tensors (an embedding's sparse
    gradient) are not counted."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.now = self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a live storage -> its bytes
        self._refs: dict[int, weakref.ref] = {}
        self._resize = torch.UntypedStorage.resize_

    def _count(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        self.now += nbytes - self._sizes.get(key, 0)
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.now)
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, lambda ref, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # DTensor first turns into its local tensors' operations, which are counted
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place or `out=` operation) allocated nothing: a storage made
        # before the block (a parameter, a buffer) is not counted as new when an operation writes or views it.
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and _has_storage(value) and value.device == self.device:
                storage = value.untyped_storage()
                if id(storage) not in self._sizes and id(storage) not in inputs:
                    self._count(storage, storage.nbytes())
        return out

    def __enter__(self) -> "LiveBytes":
        tracker, resize = self, self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            if id(storage) in tracker._sizes or size > 0:
                tracker._count(storage, size)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*args)


def _storage_bytes(device: torch.device, tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages on ``device`` behind ``tensors`` (a DTensor's local shard), each storage once."""
    storages = {}
    with torch.no_grad():
        for tensor in tensors:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if _has_storage(local) and local.device == device:
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(device: torch.device, module: torch.nn.Module,
                      optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """The bytes on ``device`` of ``module``'s parameters and gradients and of the optimizers' state: what the plan
    counts from the model's sizes."""
    tensors = [t for p in module.parameters() for t in (p, p.grad) if t is not None]
    tensors += [t for o in optimizers for state in o.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
    return _storage_bytes(device, tensors)


def resident_bytes(device: torch.device, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """What ``device`` holds besides :func:`model_state_bytes`, and keeps through training: on CUDA everything else
    the allocator holds (buffers, kernel workspaces, tensors the job keeps); elsewhere, with no allocator to ask, the
    module's buffers."""
    if device.type != "cuda":
        return _storage_bytes(device, module.buffers())
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.memory_allocated(device) - model_state_bytes(device, module, optimizers))


def _has_storage(tensor: torch.Tensor) -> bool:
    """A dense tensor with data (a sparse tensor has no storage to read: its bytes are not counted)."""
    return tensor.layout == torch.strided and not tensor.is_meta


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The dense tensors in an operation's arguments (nested in tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        if _has_storage(value):
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


@contextmanager
def _peak_over_rest(device: torch.device, found: list[int]) -> Iterator[None]:
    """The peak bytes allocated on ``device`` inside the block, over those allocated at its start, appended to
    ``found``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        rest = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield
        torch.cuda.synchronize(device)
        found.append(torch.cuda.max_memory_allocated(device) - rest)
    else:
        with LiveBytes(device) as live:
            yield
        found.append(live.peak)


def measure_step_bytes(run: Callable[[int], None], share: int, device: torch.device, counts: Sequence[int] = (),
                       least: int = 1) -> StepBytes:
    """Run ``run(samples)`` (a forward and backward of that many samples, leaving nothing behind) once at the first of
    ``counts`` (two; default :func:`measured_samples` of ``share`` and ``least``), then at each, and fit
    :class:`StepBytes` to the peaks. The first run's peak also holds what a first step allocates once and keeps
    (kernel workspaces): it counts in ``fixed``, as it stays allocated under every later step. One count above the
    share (``least`` forced it) is taken as fixed: an upper bound at the share."""
    counts = tuple(counts or measured_samples(share, least))
    if len(counts) != 2:
        raise ValueError(f"measure_step_bytes runs two measured trials (and a first one), got counts {counts}")
    peaks = []
    for samples in (counts[0],) + counts:
        found: list[int] = []
        with _peak_over_rest(device, found):
            run(samples)
        peaks.append(found[0])
    source = SOURCES[0] if device.type == "cuda" else SOURCES[1]
    if counts[0] == counts[1]:
        if counts[0] > max(share, 1):
            return StepBytes(max(peaks), 0, source, counts[:1])
        return StepBytes.from_points({counts[0]: max(peaks)}, source)
    line = StepBytes.from_points(dict(zip(counts, peaks[1:])), source)
    first_fixed = peaks[0] - line.per_sample * counts[0]
    return replace(line, fixed=max(line.fixed, first_fixed))
