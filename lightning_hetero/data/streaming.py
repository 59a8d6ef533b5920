"""Streaming (iterable) datasets split by capacity: LitData's ``StreamingDataset`` or any torch ``IterableDataset``.

A stream has no indices to permute, so :class:`HeteroStreamLoader` cuts the stream itself. Two modes
(``HeteroDDPStrategy(data=DataSplit(stream_mode=...))``):

- ``"exact"`` (default): every rank reads the *whole* stream, in the same order, cuts it into global batches of G
  samples and keeps its capacity share of each: training is exactly one device on the same stream. The price is that
  every rank reads (and decodes) every sample, so use it when reading is cheap next to the step. The stream must be
  the same on every rank: a LitData ``StreamingDataset`` is given a one-rank view of its chunks; a dataset that
  shards itself by rank is detected (the first global batch differs across ranks) and refused with advice.
- ``"shard"``: every rank reads only its own part of the stream and takes its share b_r of each step from it. A LitData
  ``StreamingDataset`` gives each rank a part proportional to its capacity (:class:`CapacityShards`); any other
  dataset shards itself by rank (e.g. ``split_dataset_by_node``). The global batch is the union of the ranks'
  slices and gradients are weighted by the samples each rank actually had. A rank whose stream ends first runs
  zero-weight padding steps until every rank is done, so step counts are equal and no sample is dropped (shards not
  sized by capacity, e.g. ``lab.split`` of the strategy, make the faster ranks pad at the end).

The stream is the sequence of samples the loader delivers (with workers: each worker's chunks of G samples in turn,
as a ``DataLoader(batch_size=G)`` would deliver them), so every rank must use the same ``num_workers`` in exact mode.

Both modes exchange two numbers per step (one ``all_gather``): the samples each rank holds, which gives the exact
weight of a partial batch, and whether its stream ended, which ends the epoch on every rank at the same step (no
rank hangs). Shares may change between steps (live rebalancing) as for map-style data. A run resumed mid-epoch
re-reads and skips the batches already trained on, so it continues exactly.
"""

import copy
import hashlib
import math
import sys
from collections.abc import Iterator
from itertools import islice
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler
from lightning_hetero.plan.shares import ShareSchedule
from lightning_hetero.plan.split import split_batch
from lightning_hetero.view import running_strategy

StreamMode = Literal["exact", "shard"]
STREAM_MODES = ("exact", "shard")


class _StreamOrder(GlobalOrder):
    """The epoch (and seed) of a stream; iterating it reads a first batch of samples for profiling."""

    def __init__(self, seed: int, read_samples: Callable[[], list[Any]]) -> None:
        super().__init__(0, shuffle=False, seed=seed)
        self.samples: list[Any] = []  # what `profile_view.dataset` indexes
        self._read_samples = read_samples
        self.pinned = False

    def set_epoch(self, epoch: int) -> None:
        """The next iteration reads ``epoch`` (a restore sets it; after that a training loader counts on)."""
        super().set_epoch(epoch)
        self.pinned = True

    def __iter__(self) -> Iterator[int]:
        if not self.samples:
            self.samples.extend(self._read_samples())
        return iter(range(len(self.samples)))

    def __len__(self) -> int:
        return len(self.samples)


class StreamSplitter(HeteroBatchSampler):
    """The share schedule of a stream (the plan's) and every rank's samples in the batches drawn so far (what the
    gradient weights read)."""

    def __init__(self, schedule: ShareSchedule, rank: int, mode: StreamMode, seed: int,
                 read_samples: Callable[[], list[Any]], num_batches: Optional[int]) -> None:
        super().__init__(_StreamOrder(seed, read_samples), schedule.global_batch_size, schedule.capacities, rank,
                         drop_last=False, schedule=schedule)
        self.mode = mode
        self.num_batches = num_batches  # known when the stream has a length (exact mode)
        self._sizes: dict[int, list[int]] = {}

    def record(self, batch_index: int, rank_sizes: list[int]) -> None:
        """Every rank's samples in global batch ``batch_index``, as the ranks hold them."""
        self._sizes[batch_index] = list(rank_sizes)
        for old in [k for k in self._sizes if k < batch_index - 8]:  # Lightning prefetches one batch ahead
            del self._sizes[old]
        self.batches_yielded = batch_index + 1

    def rank_sizes_at(self, batch_index: int, by_cost: Optional[bool] = None) -> list[float]:
        # In shard mode the ranks' samples are what each stream had left, not a split of their sum.
        if batch_index in self._sizes:
            return list(self._sizes[batch_index])
        return super().rank_sizes_at(batch_index, by_cost)

    def global_batch_len(self, batch_index: int) -> int:
        return sum(self._sizes[batch_index]) if batch_index in self._sizes else self.global_batch_size

    def global_batches(self) -> list[list[int]]:
        raise TypeError("a stream has no indices: iterate its HeteroStreamLoader")

    def __iter__(self) -> Iterator[list[int]]:
        raise TypeError("a stream has no indices: iterate its HeteroStreamLoader")

    def __len__(self) -> int:
        return self.num_batches if self.num_batches is not None else sys.maxsize  # unknown: "never the last batch"


class HeteroStreamLoader(DataLoader):
    """A ``DataLoader`` over an ``IterableDataset`` that yields this rank's share of every global batch.

    Example::

        splitter, loader, _ = build_stream_loader(DataLoader(stream, batch_size=32), {}, mode="exact",
                                                  schedule=ShareSchedule(64, [3, 1]), rank=0,
                                                  device=torch.device("cpu"))
        for batch in loader: ...  # 48 of every 64 samples of the stream on rank 0
    """

    def __init__(self, dataset: IterableDataset, splitter: StreamSplitter, collate: Callable, device: torch.device,
                 drop_last: bool, epoch_fn: Optional[Callable[[], int]] = None, training: bool = False,
                 **kwargs: Any) -> None:
        # Samples travel from the workers in chunks of a global batch (as lists); this rank collates its slice.
        super().__init__(dataset, batch_size=splitter.global_batch_size, collate_fn=list, **kwargs)
        self.splitter = splitter
        self.user_collate = collate
        self.device = device
        self.user_drop_last = drop_last
        # The trainer's epoch (a stream loader has no sampler for Lightning to tell): read when a loader is first
        # iterated, and by evaluation loaders. Right after a restore Lightning's counter can lag by one epoch.
        self.epoch_fn = epoch_fn
        self.training = training
        self._iterated = False

    def _samples(self) -> Iterator[Any]:
        for chunk in super().__iter__():
            yield from chunk

    def read_first_samples(self) -> list[Any]:
        """Up to one global batch of this rank's stream (for profiling; a separate read)."""
        self._set_dataset_epoch()
        return list(islice(self._samples(), self.splitter.global_batch_size))

    def _set_dataset_epoch(self) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(self.splitter.sampler.epoch)

    def _exchange(self, count: int, fingerprint: int) -> list[list[int]]:
        local = torch.tensor([count, fingerprint], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        return [r.tolist() for r in rows]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        s = self.splitter
        order = s.sampler
        if order.pinned:  # restored (or set by hand): read that epoch
            order.pinned = False
        elif self.training and self._iterated:  # one iteration of a training loader per epoch
            order.epoch += 1
        elif self.epoch_fn is not None:
            order.epoch = self.epoch_fn()
        self._iterated = True
        s.roll_schedule_to_epoch()
        self._set_dataset_epoch()
        if isinstance(self.dataset, CapacityShards):  # before workers copy the dataset
            shares = split_batch(self.dataset.virtual_world, s.change_at(s.start_batch).capacities)
            self.dataset.assign(shares, s.rank)
        samples = _Lookahead(self._samples())
        start, s.start_batch = s.start_batch, 0
        exact = s.mode == "exact"
        # A padding step re-reads as many samples as a rank's least share (BatchNorm trains on no fewer); in shard
        # mode, this rank's last ones.
        pad = s.schedule.min_share
        last: list[Any] = []
        for k in range(start):  # resumed mid-epoch: re-read what was trained on
            last = (last + list(islice(samples, s.global_batch_size if exact else s.split_at(k)[s.rank])))[-pad:]
        k = start
        while True:
            if exact:
                batch = list(islice(samples, s.global_batch_size))
                if self.user_drop_last and len(batch) < s.global_batch_size:
                    batch = []
                mine = s.rank_slice(k, batch) if batch else []
                count = len(batch)
            else:
                mine = _take_with_tail(samples, s.split_at(k)[s.rank], pad)
                count = len(mine)
            # Exact mode checks the first batch's contents; shard mode flags a rank with nothing at all to train on.
            if exact:
                check = _fingerprint(batch) if k == start else 0
            else:
                check = int(not mine and not last)
            rows = self._exchange(count, check)
            counts = [c for c, _ in rows]
            if exact and (len(set(counts)) > 1 or len({f for _, f in rows}) > 1):
                raise RuntimeError(
                    f"{running_strategy()}(data={{'stream_mode': 'exact'}}): the ranks read different streams "
                    f"(global batch {k} "
                    f"has {counts} samples / differing contents across ranks). Exact mode needs the same stream on "
                    "every rank; a dataset that shards itself by rank needs `stream_mode='shard'`."
                )
            if sum(counts) == 0:
                return
            empty = [r for r, (_, flag) in enumerate(rows) if flag] if not exact else []
            if empty:
                raise RuntimeError(
                    f"{running_strategy()}(data={{'stream_mode': 'shard'}}): the streams of rank(s) {empty} are empty "
                    "while other "
                    "ranks' are not; give every rank at least one sample per epoch."
                )
            # A padding step (no sample for this rank) re-reads samples of its own global batch in exact mode (as
            # map-style padding does), this rank's last ones in shard mode; its weight is 0.
            last = (batch if exact else last + mine)[-pad:]
            s.record(k, s.split_at(k, count) if exact else counts)
            yield self.user_collate(mine if mine else last)
            k += 1

    def __len__(self) -> int:
        if self.splitter.num_batches is None:
            raise TypeError("the number of global batches of this stream is not known")
        return self.splitter.num_batches


def _take_with_tail(samples: "_Lookahead", count: int, least: int) -> list[Any]:
    """Shard mode: the next ``count`` samples of a rank's own stream, and with them the stream's last ones when fewer
    than ``least`` would be left for a step of their own (BatchNorm trains on no fewer). No sample is dropped; the
    step's weight counts the samples taken."""
    taken = list(islice(samples, count))
    if least > 1 and len(taken) == count:
        ahead = samples.peek(least)
        if 0 < len(ahead) < least:
            taken += list(islice(samples, len(ahead)))
    return taken


class _Lookahead(Iterator[Any]):
    """An iterator that can look a few items ahead."""

    def __init__(self, items: Iterator[Any]) -> None:
        self._items = items
        self._ahead: list[Any] = []

    def peek(self, n: int) -> list[Any]:
        self._ahead.extend(islice(self._items, max(0, n - len(self._ahead))))
        return self._ahead[:n]

    def __next__(self) -> Any:
        return self._ahead.pop(0) if self._ahead else next(self._items)


def _fingerprint(samples: list[Any]) -> int:
    """A 62-bit digest of the samples' contents (tensors, arrays, numbers, strings, containers)."""
    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                h.update(str(key).encode())
                feed(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                feed(item)
        elif hasattr(obj, "tobytes"):
            h.update(obj.tobytes())
        else:
            h.update(repr(obj).encode())

    feed(samples)
    return int.from_bytes(h.digest()[:8], "little") >> 2


def _is_litdata(dataset: Any) -> bool:
    try:
        from litdata.streaming.dataset import StreamingDataset
    except ImportError:
        return False
    return isinstance(dataset, StreamingDataset)


def _litdata_view(dataset: Any, world_size: int, rank: int, drop_last: bool) -> Any:
    """LitData's dataset as if the job had ``world_size`` ranks and this were ``rank`` (it reads its env once)."""
    from litdata.utilities.env import _DistributedEnv

    dataset.distributed_env = _DistributedEnv(world_size=world_size, global_rank=rank, num_nodes=1)
    dataset.drop_last = drop_last
    dataset.shuffler = None  # rebuilt from the new view on the next iteration
    return dataset


class CapacityShards(IterableDataset):
    """LitData in shard mode: this rank reads a share of the chunks' items proportional to its capacity.

    LitData splits a dataset evenly over ranks. Here the job is shown to LitData as ``virtual_world`` ranks and rank r
    reads the virtual ranks it owns (as many as its share b_r of a global batch of ``virtual_world``), one after the
    other, so shard sizes follow the split at the start of each epoch and every rank runs out at about the same step.
    """

    def __init__(self, dataset: Any, virtual_world: int) -> None:
        self.dataset = dataset
        self.virtual_world = virtual_world
        self.virtual_ranks: list[int] = []

    def assign(self, split: list[int], rank: int) -> None:
        """Own virtual ranks ``[sum(split[:rank]), sum(split[:rank + 1]))`` (``split`` sums to ``virtual_world``)."""
        first = sum(split[:rank])
        self.virtual_ranks = list(range(first, first + split[rank]))

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        for v in self.virtual_ranks:
            # LitData's evenly split virtual ranks drop at most one item each to stay equal.
            yield from _litdata_view(copy.copy(self.dataset), self.virtual_world, v, drop_last=True)


def stream_global_batch(dataloader: DataLoader, explicit: Optional[int], world_size: int,
                        loader_name: str = "dataloader") -> int:
    """The global batch of a stream: the strategy's ``global_batch_size``, else the loader's ``batch_size`` x ranks."""
    if explicit is not None:
        return explicit
    if dataloader.batch_size is None:
        raise ValueError(f"{loader_name}: a stream loader needs `batch_size=` (or the strategy's "
                         "`global_batch_size`) to form global batches.")
    return dataloader.batch_size * world_size


def build_stream_loader(dataloader: DataLoader, settings: dict[str, Any], mode: StreamMode, schedule: ShareSchedule,
                        rank: int, device: torch.device, seed: int = 0,
                        epoch_fn: Optional[Callable[[], int]] = None,
                        training: bool = False) -> tuple[StreamSplitter, HeteroStreamLoader, Any]:
    """(splitter, loader, a map-style view of the first samples for profiling) for a DataLoader over a stream.

    ``schedule`` is the share plan's for this loader (:meth:`~lightning_hetero.plan.shares.SharePlan.new_schedule`,
    of :func:`stream_global_batch` samples): the splitter reads it, it holds no capacities of its own. ``settings``
    are the loader's own (workers, memory, ``collate_fn``), kept by the new loader.
    """
    if mode not in STREAM_MODES:
        raise ValueError(f"`stream_mode`={mode!r} must be one of {STREAM_MODES}.")
    world = schedule.world_size
    global_batch_size = schedule.global_batch_size
    dataset = dataloader.dataset
    if _is_litdata(dataset):
        if mode == "exact":  # every rank streams all chunks in one order, as a single process would
            _litdata_view(dataset, 1, 0, drop_last=False)
        else:
            dataset = CapacityShards(dataset, virtual_world=min(global_batch_size, 16 * world))
    num_batches = None
    if mode == "exact" and hasattr(dataset, "__len__"):
        try:
            n = len(dataset)  # type: ignore[arg-type]
            num_batches = n // global_batch_size if dataloader.drop_last else math.ceil(n / global_batch_size)
        except TypeError:
            num_batches = None
    kwargs = dict(settings)
    collate = kwargs.pop("collate_fn", dataloader.collate_fn)
    holder: list[HeteroStreamLoader] = []
    splitter = StreamSplitter(schedule, rank, mode, seed, lambda: holder[0].read_first_samples(), num_batches)
    loader = HeteroStreamLoader(dataset, splitter, collate, device, dataloader.drop_last,
                                epoch_fn=epoch_fn, training=training, **kwargs)
    holder.append(loader)
    profile_view = _ProfileView(splitter.sampler.samples, collate)
    return splitter, loader, profile_view


class _ProfileView:
    """What profiling reads from a loader: a map-style dataset (the first samples) and the collate function."""

    def __init__(self, dataset: list[Any], collate_fn: Callable) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
