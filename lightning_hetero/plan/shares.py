"""The share plan: the one owner of capacities, memory caps and the schedule of share changes.

torchtitan's ``ParallelDims`` is the model: one object holds the facts, readers derive from it and never write back.

- :class:`ShareSchedule` answers "which split at global batch k" for one loader: the capacities (and caps) in force
  from each batch index of the epoch on, and how a batch is cut (by count, or by cost). Every count split goes through
  :func:`~lightning_hetero.plan.split.split_batch`, every cost split through
  :func:`~lightning_hetero.plan.split.split_by_cost`.
- :class:`SharePlan` keeps one schedule, the training loader's (before it is built, one that holds the capacities
  resolved at set-up), and derives from it the capacities in force, the memory caps and the split. Where they came
  from (explicit, peak, profile, rebalanced, restored) is ``source``. It makes every loader's schedule
  (:meth:`SharePlan.new_schedule`), which the samplers read; evaluation loaders' schedules follow the training one.
  Shares change through one method, :meth:`SharePlan.adopt`, which profiling
  (:class:`~lightning_hetero.plan.profile_run.ShareProfiler`), rebalancing
  (:class:`~lightning_hetero.plan.rebalance.ShareController`) and resume
  (:class:`~lightning_hetero.plan.state.ShareState`) call; the lab table reads it.
- :class:`PlannedSampler` and :class:`LabView` are what those writers read of the training sampler and of the lab
  set-up.

Example::

    plan = SharePlan(parse_capacities("equal"), global_batch_size=8)
    plan.resolve(devices, torch.float32)
    plan.split  # (4, 4) with capacities "equal"
    plan.use_train_schedule(plan.new_schedule(8))
    plan.adopt([3, 1], "rebalanced", caps=None, first_batch=2)
    plan.capacities, plan.schedule.split_at(1), plan.split  # (3.0, 1.0), [4, 4], (6, 2)
"""

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from lightning_hetero.config import Balance
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.emulator import Emulator
from lightning_hetero.lab.groups import HeteroLab
from lightning_hetero.plan.capacity import CapacitySpec, resolve_static_capacities
from lightning_hetero.plan.split import (check_replicas, split_batch, split_by_cost, split_replicas,
                                         split_replicas_by_cost)


# The ranks that train one replica together (a pipeline's stage ranks), chosen on the lab's devices and the
# capacities resolved on them: ``replicas_of(devices, capacities)`` covers every rank once.
ReplicasOf = Callable[[Sequence[DeviceInfo], Sequence[float]], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class ShareChange:
    """From global batch ``first_batch`` of an epoch on, split with these capacities (and optional caps)."""

    first_batch: int
    capacities: tuple[float, ...]
    caps: Optional[tuple[int, ...]] = None


class ShareSchedule:
    """The capacities in force from each global-batch index of one epoch on, and the splits they give.

    Changes are keyed to batch indices, so every rank applies one to the same batch; a new epoch starts from the
    latest change. ``cap_shares=False`` ignores memory caps (oversized shares then run as micro-batches).
    ``min_share``: the fewest samples a replica trains on (2 while BatchNorm layers train on per-rank statistics).
    ``replicas``: ranks that train one replica together (a pipeline's), split as one (:meth:`set_replicas`).
    ``replica_count``: how many replicas the job trains (a pipeline's stage ranks count once; default: one per rank):
    a global batch has at least one sample per replica. An evaluation schedule splits by rank but keeps the job's
    count (a rank short of a sample runs a padding step, as a pipeline's stage rank of no sample does in training).
    """

    def __init__(self, global_batch_size: Optional[int], capacities: Sequence[float],
                 caps: Optional[Sequence[int]] = None, epoch: int = 0, replica_count: Optional[int] = None) -> None:
        self.world_size = len(capacities)
        self.replica_count = self.world_size if replica_count is None else int(replica_count)
        if global_batch_size is not None and global_batch_size < self.replica_count:
            raise ValueError(f"`global_batch_size`={global_batch_size} is smaller than {self._replicas_named()}: "
                             f"every {self._replica_word()} needs at least one sample of each global batch.")
        self.min_share = 1
        self.replicas: Optional[tuple[tuple[int, ...], ...]] = None
        # None: not yet known (the plan's schedule before the training loader is built).
        self.global_batch_size = global_batch_size
        self._cap_shares = True
        # How a batch whose samples have costs is cut (see `cut`): by count, by summed cost, or by padded cost.
        self.balance: Balance = "samples"
        self.changes: list[ShareChange] = [
            ShareChange(0, tuple(float(c) for c in capacities), tuple(caps) if caps else None)
        ]
        self.epoch = epoch
        self._full_splits: dict[int, list[int]] = {}

    @property
    def capacities(self) -> tuple[float, ...]:
        return self.changes[-1].capacities

    @property
    def latest(self) -> ShareChange:
        return self.changes[-1]

    @property
    def cap_shares(self) -> bool:
        """False: memory caps are ignored (evaluation, or oversized shares run as micro-batches)."""
        return self._cap_shares

    @cap_shares.setter
    def cap_shares(self, value: bool) -> None:
        self._cap_shares = bool(value)
        self._full_splits.clear()

    def change(self, capacities: Sequence[float], first_batch: int, caps: Optional[Sequence[int]] = None) -> None:
        """Split global batches ``first_batch``, ``first_batch + 1``, ... of this epoch with new capacities."""
        if len(capacities) != self.world_size:
            raise ValueError(f"`capacities` has {len(capacities)} weights for {self.world_size} ranks.")
        if first_batch < self.changes[-1].first_batch:
            raise ValueError("share changes must move forward in the epoch")
        self.changes = [c for c in self.changes if c.first_batch < first_batch]
        capacities = tuple(float(c) for c in capacities)
        self.changes.append(ShareChange(first_batch, capacities, tuple(caps) if caps else None))
        self._full_splits.clear()
        if self.global_batch_size is not None:  # fail now, not later
            self._split(self.global_batch_size, self.changes[-1])

    def roll_to_epoch(self, epoch: int) -> None:
        """A new epoch starts with the latest shares (changes are keyed to batch indices of one epoch)."""
        if epoch != self.epoch:
            latest = self.changes[-1]
            self.changes = [ShareChange(0, latest.capacities, latest.caps)]
            self._full_splits.clear()
            self.epoch = epoch

    def _replica_word(self) -> str:
        return "rank" if self.replica_count == self.world_size else "replica"

    def _replicas_named(self) -> str:
        """The limit as the user meets it: the world size, or the replicas where pipelines make them fewer."""
        if self.replica_count == self.world_size:
            return f"the world size {self.world_size}"
        return (f"the {self.replica_count} replicas of the {self.world_size} ranks (a pipeline's stage ranks train one "
                "replica, and one of them may have no sample of its own)")

    def set_min_share(self, min_share: int) -> None:
        """Give every replica (every rank, without pipelines) at least ``min_share`` samples of each global batch
        (2: BatchNorm layers train on each rank's own statistics and cannot train on one sample)."""
        if self.global_batch_size is not None and self.global_batch_size < min_share * self.replica_count:
            named = self._replicas_named()
            raise ValueError(
                f"`global_batch_size`={self.global_batch_size} is smaller than {min_share} x {named}: the model's "
                f"BatchNorm layers train on each rank's own statistics, which need at least 2 samples per "
                f"{self._replica_word()}. Raise the batch size, or set `Trainer(sync_batchnorm=True)` (statistics "
                "over the global batch; then 1 sample per rank is enough)."
            )
        self.min_share = min_share
        self._full_splits.clear()

    def set_replicas(self, replicas: Optional[Sequence[Sequence[int]]]) -> None:
        """Split over these groups of ranks (each trains one replica on the union of its slices, every rank once)
        with the least share per replica, a rank of a group possibly getting none (:func:`split_replicas`), and
        count them as :attr:`replica_count`; ``None``: every rank its own replica (the count stays the job's)."""
        self.replicas = None if replicas is None else check_replicas(replicas, self.world_size)
        if self.replicas is not None:
            self.replica_count = len(self.replicas)
        self._full_splits.clear()

    def set_global_batch_size(self, global_batch_size: int) -> None:
        self.global_batch_size = int(global_batch_size)
        self._full_splits.clear()

    def change_at(self, batch_index: int) -> ShareChange:
        firsts = [c.first_batch for c in self.changes]
        return self.changes[bisect.bisect_right(firsts, batch_index) - 1]

    def caps_of(self, change: ShareChange) -> Optional[tuple[int, ...]]:
        return change.caps if self.cap_shares else None

    def split_at(self, batch_index: int, batch_len: Optional[int] = None) -> list[int]:
        """Per-rank sample counts of global batch ``batch_index`` (of ``batch_len`` samples; default: full)."""
        change = self.change_at(batch_index)
        n = self.global_batch_size if batch_len is None else batch_len
        if n is None:
            raise ValueError("the global batch is not known yet: give `batch_len`.")
        if n == self.global_batch_size:
            key = change.first_batch
            if key not in self._full_splits:
                self._full_splits[key] = self._split(n, change)
            return self._full_splits[key]
        return self._split(n, change)

    def _split(self, total: int, change: ShareChange) -> list[int]:
        """Every count split of this schedule: :func:`split_batch` under ``change``."""
        if self.replicas is not None:
            return split_replicas(total, change.capacities, self.replicas, self.caps_of(change), self.min_share)
        return split_batch(total, change.capacities, self.caps_of(change), self.min_share)

    def cut(self, batch_index: int, costs: Sequence[float]) -> list[list[int]]:
        """The positions of global batch ``batch_index`` each rank trains on, given its samples' ``costs``: by
        :attr:`balance`, runs of summed (or padded) cost proportional to capacity (:func:`split_by_cost`), or
        consecutive runs of :meth:`split_at`'s counts."""
        if self.balance != "samples":
            change = self.change_at(batch_index)
            padded = self.balance == "padded_tokens"
            if self.replicas is not None:
                return split_replicas_by_cost(costs, change.capacities, self.replicas, self.caps_of(change),
                                              padded=padded, minimum=self.min_share)
            return split_by_cost(costs, change.capacities, self.caps_of(change), padded=padded,
                                 minimum=self.min_share)
        bounds = [0]
        for b in self.split_at(batch_index, len(costs)):
            bounds.append(bounds[-1] + b)
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]

    def state_dict(self) -> list[Any]:
        return [(c.first_batch, list(c.capacities), list(c.caps) if c.caps else None) for c in self.changes]


class SharePlan:
    """Capacities, caps and the training schedule of one job: the single place they live (see the module docstring).

    ``global_batch_size`` is the user's explicit global batch (``None``: the training loader's ``batch_size`` x world
    size). Capacities are resolved once the lab's devices are known (:meth:`resolve`); from then on the schedule is
    the one store, and :meth:`adopt` the one way shares change. ``replicas_of`` groups ranks that train one replica
    together (a layout's pipelines), asked by :meth:`resolve` once the capacities are known; ``None``: one replica
    per rank.
    """

    def __init__(self, spec: CapacitySpec, global_batch_size: Optional[int],
                 replicas_of: Optional[ReplicasOf] = None) -> None:
        self.spec = spec
        self.global_batch_size = global_batch_size
        self.replicas_of = replicas_of
        self.source = "not yet resolved"
        # The one store: the training loader's schedule; before that loader, one without a global batch that holds
        # the capacities resolved at set-up. Capacities, caps and the split are read from it.
        self._schedule: Optional[ShareSchedule] = None
        self._loader_bound = False
        # The evaluation loaders' schedules, which follow every adopted change from their first batch.
        self.followers: list[ShareSchedule] = []
        self._min_share = 1
        self._replicas: Optional[tuple[tuple[int, ...], ...]] = None

    @property
    def min_share(self) -> int:
        """The fewest samples of a training global batch a rank is given (2 while BatchNorm layers train on each
        rank's own statistics). The plan is its one writer: the store and every training schedule read it from here."""
        return self._min_share

    @min_share.setter
    def min_share(self, value: int) -> None:
        self._min_share = int(value)
        if self._schedule is not None:
            self._schedule.set_min_share(self._min_share)

    @property
    def replicas(self) -> Optional[tuple[tuple[int, ...], ...]]:
        """Groups of ranks that train one replica together (a pipeline's stage ranks): training global batches are
        split over them as one, the least share per replica (:func:`~lightning_hetero.plan.split.split_replicas`);
        ``None``: every rank its own replica. Evaluation, where every rank runs the whole model, splits by rank.
        Set by :meth:`resolve` from the constructor's ``replicas_of``."""
        return self._replicas

    # -- writers: the lab set-up, then profiling, rebalancing and resume through `adopt` ------------------------------
    def resolve(self, devices: Sequence[DeviceInfo], dtype: torch.dtype) -> None:
        """Capacities that need no measurement (the ``capacities`` argument against the lab's devices), and the
        replicas ``replicas_of`` groups the ranks into on them."""
        weights, self.source = resolve_static_capacities(self.spec, devices, dtype)
        self._schedule = ShareSchedule(None, weights)
        if self.replicas_of is not None:
            self._replicas = check_replicas(self.replicas_of(devices, self._schedule.capacities), len(devices))
        self._schedule.set_replicas(self._replicas)
        self._schedule.set_min_share(self._min_share)
        self._loader_bound = False

    def adopt(self, capacities: Sequence[float], source: str, caps: Optional[Sequence[int]],
              first_batch: int = 0, epoch: Optional[int] = None) -> None:
        """The one way shares change: the training loader splits global batches ``first_batch``, ... of ``epoch``
        (default: its current one) with ``capacities`` and memory ``caps``; evaluation loaders follow from their
        first batch. Profiling, rebalancing and resume all call this."""
        schedule = self._store()
        if epoch is not None:
            schedule.roll_to_epoch(epoch)
        schedule.change(capacities, first_batch, caps)
        self.source = source
        for follower in self.followers:
            follower.change(capacities, first_batch=0, caps=caps)

    def new_schedule(self, global_batch_size: int, epoch: int = 0) -> ShareSchedule:
        """A loader's schedule, starting from the shares in force; it refuses a global batch below the number of
        replicas (the world size, less a pipeline's stage ranks but one: :attr:`replicas`)."""
        latest = self._store().latest
        count = None if self._replicas is None else len(self._replicas)
        return ShareSchedule(global_batch_size, latest.capacities, latest.caps, epoch=epoch, replica_count=count)

    def use_train_schedule(self, schedule: ShareSchedule) -> None:
        """The training loader's schedule (made by :meth:`new_schedule`) becomes the store, replacing the one before;
        it splits with the plan's :attr:`min_share` (a ``ValueError`` if its global batch is too small for it) and
        :attr:`replicas`."""
        # Replicas first: the least share is per replica.
        schedule.set_replicas(self._replicas)
        schedule.set_min_share(self._min_share)
        self._schedule = schedule
        self._loader_bound = True

    def follow(self, schedule: ShareSchedule, replaces: Optional[ShareSchedule] = None) -> None:
        """An evaluation loader's schedule follows every later change (``replaces``: its predecessor's). Evaluation
        runs no backward: memory caps bound training shares only."""
        schedule.cap_shares = False
        self.followers = [s for s in self.followers if s is not replaces and s is not schedule] + [schedule]

    def _store(self) -> ShareSchedule:
        if self._schedule is None:
            raise RuntimeError("the share plan has no capacities yet: they are resolved when the lab is set up.")
        return self._schedule

    # -- readers: everything below is derived from the schedule --------------------------------------------------------
    @property
    def schedule(self) -> Optional[ShareSchedule]:
        """The training loader's schedule of share changes (``None`` before that loader is built)."""
        return self._schedule if self._loader_bound else None

    @property
    def capacities(self) -> tuple[float, ...]:
        """The capacities in force (the schedule's latest; empty before they are resolved)."""
        return self._schedule.capacities if self._schedule is not None else ()

    @property
    def caps(self) -> Optional[tuple[int, ...]]:
        """Per-rank memory caps in force (``None``: none)."""
        return self._schedule.latest.caps if self._schedule is not None else None

    @property
    def loader_batch_size(self) -> Optional[int]:
        """The training global batch (explicit, or the loader's once it is built)."""
        stored = self._schedule.global_batch_size if self._schedule is not None else None
        return stored if stored is not None else self.global_batch_size

    @property
    def split(self) -> tuple[int, ...]:
        """Each rank's samples of a full training global batch under the latest shares (empty while that batch is
        unknown: no explicit ``global_batch_size`` and no training loader yet)."""
        batch = self.loader_batch_size
        if self._schedule is None or not batch:
            return ()
        return tuple(self._schedule.split_at(self._schedule.latest.first_batch, batch))

    @property
    def shares(self) -> tuple[float, ...]:
        """Fraction of each global batch each rank trains on."""
        split = self.split
        weights: Sequence[float] = split if split else self.capacities
        total = sum(weights)
        return tuple(w / total for w in weights)

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacities": list(self.capacities),
            "capacity_source": self.source,
            "global_batch_size": self.loader_batch_size,
            "split": list(self.split),
            "caps": None if self.caps is None else list(self.caps),
        }


# -- what the plan's writers read -------------------------------------------------------------------------------------
class PlannedSampler(Protocol):
    """The training batch sampler (``data/sampler.py``) as profiling, rebalancing and resume read it."""

    sampler: Any
    rank: int
    world_size: int
    global_batch_size: int
    batches_yielded: int
    start_batch: int

    def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], start_batch: int = 0) -> None: ...


class LabView(Protocol):
    """The lab set-up (``lab/setup.py``) as the plan's writers read it: devices, this rank's emulator, table columns."""

    emulation: Optional[Emulator]

    @property
    def lab(self) -> HeteroLab: ...

    def add_columns(self, columns: Mapping[str, Sequence[Any]]) -> None: ...
