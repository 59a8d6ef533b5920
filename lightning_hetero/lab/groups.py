"""The whole lab: every rank's device and the groups they form (device facts only).

:class:`HeteroLab` is the public, read-only description the strategy exposes as ``strategy.lab``; rank 0 prints it
once as a table together with the share plan (:class:`~lightning_hetero.plan.shares.SharePlan`, which owns
capacities and splits; the table reads it as a :class:`PlanColumns`, so the lab imports nothing of the plan).
:class:`LabGroups` holds the ``torch.distributed`` process groups built from it: one per device class and one per
host, plus a "leaders" group (first rank of each) for two-level communication.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

import torch.distributed as dist

from lightning_hetero.lab.devices import DeviceInfo

GroupKey = str  # "class" or "host"


class PlanColumns(Protocol):
    """What the lab table shows of the share plan: each rank's capacity, share and batch, and the global batch."""

    capacities: tuple[float, ...]
    source: str

    @property
    def shares(self) -> tuple[float, ...]: ...

    @property
    def split(self) -> tuple[int, ...]: ...

    @property
    def loader_batch_size(self) -> Optional[int]: ...


@dataclass(frozen=True)
class HeteroLab:
    """Ranks, their devices and groups. Immutable: the strategy swaps in a new one when a column is added."""

    devices: tuple[DeviceInfo, ...]
    # Extra per-rank columns for the table (precision, measured samples/s, memory cap, compression ...).
    columns: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def device_classes(self) -> dict[str, tuple[int, ...]]:
        return _group_ranks(self.devices, "class")

    @property
    def hosts(self) -> dict[str, tuple[int, ...]]:
        return _group_ranks(self.devices, "host")

    def with_column(self, name: str, values: Sequence[Any]) -> "HeteroLab":
        kept = tuple((n, v) for n, v in self.columns if n != name)
        return replace(self, columns=kept + ((name, tuple(str(v) for v in values)),))

    def as_dict(self) -> dict[str, Any]:
        return {
            "devices": [d.as_dict() for d in self.devices],
            "device_classes": {k: list(v) for k, v in self.device_classes.items()},
            "hosts": {k: list(v) for k, v in self.hosts.items()},
            "columns": {n: list(v) for n, v in self.columns},
        }

    def table(self, plan: PlanColumns) -> str:
        """A compact text table, one line per rank: its device, and its share under ``plan``."""
        headers = ["rank", "host", "device", "cc", "mem GiB", "SMs", "capacity", "share", "batch"]
        headers += [name for name, _ in self.columns]
        rows = []
        shares, split = plan.shares, plan.split
        for d in self.devices:
            r = d.rank
            row = [
                str(r),
                d.host,
                d.name,
                f"{d.capability[0]}.{d.capability[1]}" if d.type == "cuda" else "-",
                f"{d.memory_bytes / 2**30:.0f}",
                str(d.multiprocessors),
                f"{plan.capacities[r]:.3g}",
                f"{shares[r]:.1%}",
                str(split[r]) if split else "-",
            ]
            row += [values[r] for _, values in self.columns]
            rows.append(row)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in rows]
        batch = plan.loader_batch_size
        g = f"global batch {batch}" if batch else "global batch not yet known"
        lines.append(
            f"capacities: {plan.source}; {g}; "
            f"{len(self.device_classes)} device class(es), {len(self.hosts)} host(s)"
        )
        return "\n".join(lines)


def _group_ranks(devices: Sequence[DeviceInfo], key: GroupKey) -> dict[str, tuple[int, ...]]:
    groups: dict[str, list[int]] = {}
    for d in devices:
        groups.setdefault(d.device_class if key == "class" else d.host, []).append(d.rank)
    return {name: tuple(ranks) for name, ranks in sorted(groups.items(), key=lambda kv: kv[1][0])}


def gather_devices(local: DeviceInfo) -> tuple[DeviceInfo, ...]:
    """Every rank's :class:`DeviceInfo`, in rank order (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local.as_dict())
    return tuple(
        DeviceInfo(**{**d, "capability": tuple(d["capability"])}) for d in sorted(gathered, key=lambda d: d["rank"])
    )


@dataclass
class LabGroups:
    """Process groups of this rank, by device class and by host, and the leaders' groups across them.

    ``leaders[key]`` is ``None`` on ranks that lead no group (they take no part in the cross-group hop).
    """

    members: dict[GroupKey, tuple[int, ...]]
    groups: dict[GroupKey, Optional[dist.ProcessGroup]]
    leader_ranks: dict[GroupKey, tuple[int, ...]]
    leaders: dict[GroupKey, Optional[dist.ProcessGroup]]


def build_groups(lab: HeteroLab) -> LabGroups:
    """Create the class, host and leader groups. A collective: every rank calls ``new_group`` in the same order."""
    rank = dist.get_rank()
    members: dict[GroupKey, tuple[int, ...]] = {}
    groups: dict[GroupKey, Optional[dist.ProcessGroup]] = {}
    leader_ranks: dict[GroupKey, tuple[int, ...]] = {}
    leaders: dict[GroupKey, Optional[dist.ProcessGroup]] = {}
    for key, by in (("class", lab.device_classes), ("host", lab.hosts)):
        for ranks in by.values():
            group = dist.new_group(list(ranks))
            if rank in ranks:
                members[key], groups[key] = ranks, group
        leader_ranks[key] = tuple(ranks[0] for ranks in by.values())
        group = dist.new_group(list(leader_ranks[key]))
        leaders[key] = group if rank in leader_ranks[key] else None
    return LabGroups(members=members, groups=groups, leader_ranks=leader_ranks, leaders=leaders)
