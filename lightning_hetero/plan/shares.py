"""The share plan: the one owner of capacities, memory caps and the schedule of share changes.

torchtitan's ``ParallelDims`` is the model: one object holds the facts, readers derive from it and never write back.

- :class:`ShareSchedule` answers "which split at global batch k" for one loader: the capacities (and caps) in force
  from each batch index of the epoch on. The training loader's schedule is the plan's; evaluation loaders follow the
  plan's latest capacities from their next share change on.
- :class:`SharePlan` holds the validated ``capacities`` argument, the capacities in force and where they came from
  (explicit, peak, profiled, rebalanced, restored), the memory caps and the training schedule. It makes every
  loader's schedule (:meth:`SharePlan.new_schedule`), which the samplers read; profiling
  (:class:`~lightning_hetero.plan.profile_run.ShareProfiler`), rebalancing
  (:class:`~lightning_hetero.plan.rebalance.ShareController`) and resume
  (:class:`~lightning_hetero.plan.state.ShareState`) write it; the lab table shows it.
- :class:`PlannedSampler` and :class:`LabView` are what those writers read of the training sampler and of the lab
  set-up.

Example::

    plan = SharePlan(parse_capacities([3, 1]), global_batch_size=8)
    plan.resolve(devices, torch.float32)
    plan.adopt_train_schedule(plan.new_schedule(8))
    plan.schedule.split_at(0)  # [6, 2]
"""

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.emulation import Emulator
from lightning_hetero.lab.groups import HeteroLab
from lightning_hetero.plan.capacity import CapacitySpec, resolve_static_capacities
from lightning_hetero.plan.split import split_batch


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
    ``min_share``: the fewest samples a rank trains on (2 while BatchNorm layers train on per-rank statistics).
    """

    def __init__(self, global_batch_size: int, capacities: Sequence[float], caps: Optional[Sequence[int]] = None,
                 epoch: int = 0) -> None:
        if global_batch_size < len(capacities):
            raise ValueError(
                f"`global_batch_size`={global_batch_size} is smaller than the world size {len(capacities)}: "
                "every rank needs at least one sample of each global batch."
            )
        self.min_share = 1
        self.global_batch_size = global_batch_size
        self.world_size = len(capacities)
        self.cap_shares = True
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

    def change(self, capacities: Sequence[float], first_batch: int, caps: Optional[Sequence[int]] = None) -> None:
        """Split global batches ``first_batch``, ``first_batch + 1``, ... of this epoch with new capacities."""
        if len(capacities) != self.world_size:
            raise ValueError(f"`capacities` has {len(capacities)} weights for {self.world_size} ranks.")
        if first_batch < self.changes[-1].first_batch:
            raise ValueError("share changes must move forward in the epoch")
        self.changes = [c for c in self.changes if c.first_batch < first_batch]
        self.changes.append(ShareChange(first_batch, tuple(float(c) for c in capacities), tuple(caps) if caps else None))
        self._full_splits.clear()
        # Fail now, not later.
        split_batch(self.global_batch_size, capacities, caps if self.cap_shares else None, self.min_share)

    def roll_to_epoch(self, epoch: int) -> None:
        """A new epoch starts with the latest shares (changes are keyed to batch indices of one epoch)."""
        if epoch != self.epoch:
            latest = self.changes[-1]
            self.changes = [ShareChange(0, latest.capacities, latest.caps)]
            self._full_splits.clear()
            self.epoch = epoch

    def set_min_share(self, min_share: int) -> None:
        """Give every rank at least ``min_share`` samples of each global batch (2: BatchNorm layers train on each
        rank's own statistics and cannot train on one sample)."""
        if self.global_batch_size < min_share * self.world_size:
            raise ValueError(
                f"`global_batch_size`={self.global_batch_size} is smaller than {min_share} x the world size "
                f"{self.world_size}: the model's BatchNorm layers train on each rank's own statistics, which need at "
                "least 2 samples per rank. Raise the batch size, or set `Trainer(sync_batchnorm=True)` (statistics "
                "over the global batch; then 1 sample per rank is enough)."
            )
        self.min_share = min_share
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
        if n == self.global_batch_size:
            key = change.first_batch
            if key not in self._full_splits:
                self._full_splits[key] = split_batch(n, change.capacities, self.caps_of(change), self.min_share)
            return self._full_splits[key]
        return split_batch(n, change.capacities, self.caps_of(change), self.min_share)

    def state_dict(self) -> list[Any]:
        return [(c.first_batch, list(c.capacities), list(c.caps) if c.caps else None) for c in self.changes]

    def load_state_dict(self, changes: Sequence[Any], epoch: int) -> None:
        self.changes = [ShareChange(int(first), tuple(capacities), tuple(caps) if caps else None)
                        for first, capacities, caps in changes]
        self._full_splits.clear()
        self.epoch = epoch


class SharePlan:
    """Capacities, caps and the training schedule of one job: the single place they live (see the module docstring).

    ``global_batch_size`` is the user's explicit global batch (``None``: the training loader's ``batch_size`` x world
    size). Capacities are resolved once the lab's devices are known (:meth:`resolve`).
    """

    def __init__(self, spec: CapacitySpec, global_batch_size: Optional[int]) -> None:
        self.spec = spec
        self.global_batch_size = global_batch_size
        self.capacities: tuple[float, ...] = ()
        self.source = "not yet resolved"
        self.caps: Optional[tuple[int, ...]] = None
        # The training loader's schedule (None until it is built) and the evaluation loaders' ones that follow.
        self.schedule: Optional[ShareSchedule] = None
        self.followers: list[ShareSchedule] = []
        # The fewest samples of a training global batch a rank is given (2 for BatchNorm trained without sync).
        self.min_share = 1

    # -- writers: the lab set-up, profiling, rebalancing, resume -------------------------------------------------------
    def resolve(self, devices: Sequence[DeviceInfo], dtype: torch.dtype) -> None:
        """Capacities that need no measurement (the ``capacities`` argument against the lab's devices)."""
        weights, self.source = resolve_static_capacities(self.spec, devices, dtype)
        self.capacities = tuple(float(w) for w in weights)

    def update(self, capacities: Sequence[float], source: str) -> None:
        """Adopt new capacities (profiled, rebalanced, restored) for what follows; evaluation loaders follow too."""
        self.capacities = tuple(float(c) for c in capacities)
        self.source = source
        for schedule in self.followers:
            schedule.change(self.capacities, first_batch=0)

    def set_caps(self, caps: Optional[Sequence[int]]) -> None:
        self.caps = None if caps is None else tuple(int(c) for c in caps)

    def change(self, capacities: Sequence[float], first_batch: int, epoch: int) -> None:
        """Split the training loader's global batches ``first_batch``, ... of ``epoch`` with new capacities."""
        assert self.schedule is not None, "the training loader is not built yet"
        self.schedule.roll_to_epoch(epoch)
        self.schedule.change(capacities, first_batch, self.caps)

    def new_schedule(self, global_batch_size: int, epoch: int = 0) -> ShareSchedule:
        """A loader's schedule, starting from the capacities in force (it refuses a global batch below world size)."""
        return ShareSchedule(global_batch_size, self.capacities, epoch=epoch)

    def adopt_train_schedule(self, schedule: ShareSchedule) -> None:
        """The training loader's schedule becomes the plan's (replacing an earlier loader's)."""
        self.schedule = schedule

    def follow(self, schedule: ShareSchedule, replaces: Optional[ShareSchedule] = None) -> None:
        """An evaluation loader's schedule follows every later capacity update (``replaces``: its predecessor's)."""
        self.followers = [s for s in self.followers if s is not replaces and s is not schedule] + [schedule]

    # -- readers -------------------------------------------------------------------------------------------------------
    @property
    def split(self) -> tuple[int, ...]:
        """Each rank's samples of a full training global batch under the latest shares (empty before the loader)."""
        if self.schedule is None:
            return ()
        return tuple(self.schedule.split_at(self.schedule.latest.first_batch))

    @property
    def loader_batch_size(self) -> Optional[int]:
        """The training global batch (explicit, or the loader's once it is built)."""
        return self.schedule.global_batch_size if self.schedule is not None else self.global_batch_size

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

    @property
    def capacities(self) -> tuple[float, ...]: ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], start_batch: int = 0) -> None: ...


class LabView(Protocol):
    """The lab set-up (``lab/setup.py``) as the plan's writers read it: devices, this rank's emulator, table columns."""

    emulation: Optional[Emulator]

    @property
    def lab(self) -> HeteroLab: ...

    def add_columns(self, columns: Mapping[str, Sequence[Any]]) -> None: ...
