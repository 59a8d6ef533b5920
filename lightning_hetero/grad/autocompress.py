"""``compression="auto"``: let the slowest link of the job pick the gradient compression.

At setup every host times a full-precision all-reduce of a few MB inside itself, then the hosts' leaders time one
among themselves (through the emulated link's pacing, when there is one). The slow hop (between hosts when there
are several, else inside the host) and the gradient size decide:

=====================  =======================================================================================
slow hop (bus GB/s)    choice
=====================  =======================================================================================
NVLink class (>= 40)   none
PCIe class (>= 5)      none, or bf16 when the fp32 exchange would be exposed
Ethernet class (< 5)   bf16 (default ``strong``), or PowerSGD (rank 4) / top-k (1 %) when asked
=====================  =======================================================================================

"Exposed" compares the fp32 exchange time with ``exposed_fraction`` × ``step_seconds`` (the compute time of one step,
if the user knows it) or, without it, with ``exposed_seconds``. With more than one host the choice is always
hierarchical: full precision inside each host, the chosen method only between the leaders. The measurement and the
choice go into the lab table.

Example::
    >>> HeteroDDPStrategy(compression="auto")
    >>> HeteroDDPStrategy(compression=AutoCompression(step_seconds=0.3, strong="topk"))
"""

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_hetero.grad.compression_config import (
    AutoCompression,
    CastCompression,
    NoCompression,
    PowerSGDCompression,
    TopKCompression,
    describe_compression,
)

# Bus bandwidth (GB/s) from which a hop is NVLink class.
NVLINK_BUS_GBPS = 40.0
# Bus bandwidth (GB/s) from which a hop is PCIe class; below: Ethernet class (25 GbE = 3.1 GB/s, 10 GbE = 1.25 GB/s)
PCIE_BUS_GBPS = 5.0


@dataclass(frozen=True)
class LinkMeasurement:
    """Timed full-precision all-reduces: seconds per MB-sized probe and bus bandwidth (GB/s) of each hop.

    ``intra_*``: the slowest host's internal hop (``None`` when no host has two ranks); ``inter_*``: among the host
    leaders (``None`` with one host).
    """

    probe_bytes: int
    intra_seconds: Optional[float]
    inter_seconds: Optional[float]
    hosts: int
    # The largest host
    ranks_per_host: int

    @staticmethod
    def _bus(seconds: Optional[float], nbytes: int, n: int) -> Optional[float]:
        return None if seconds is None or n < 2 else nbytes / seconds * 2 * (n - 1) / n / 1e9

    @property
    def intra_bus_gbps(self) -> Optional[float]:
        return self._bus(self.intra_seconds, self.probe_bytes, self.ranks_per_host)

    @property
    def inter_bus_gbps(self) -> Optional[float]:
        return self._bus(self.inter_seconds, self.probe_bytes, self.hosts)

    def exchange_seconds(self, nbytes: int) -> float:
        """Time of a full-precision all-reduce of ``nbytes`` over the slow hop (0 when there is none)."""
        seconds = self.inter_seconds if self.hosts > 1 else self.intra_seconds
        return 0.0 if seconds is None else seconds * nbytes / self.probe_bytes


def _timed_allreduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], repeats: int, pacer: Any) -> float:
    def once() -> None:
        dist.all_reduce(tensor, group=group)
        if pacer is not None:
            pacer.transfer(tensor.numel() * tensor.element_size())
            pacer.settle()

    # Warm-up: the communicator's connections are set up lazily
    once()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return (time.perf_counter() - start) / repeats


def measure_links(config: AutoCompression, lab: Any, groups: Any, device: torch.device, pacer: Any = None,
                  repeats: int = 3) -> LinkMeasurement:
    """Time the hop inside each host and the one among the leaders (a collective on every rank).

    ``pacer``: the emulated inter-host link (:class:`~lightning_hetero.lab.link_pacing.LinkPacer`), applied to the
    leaders' probe exactly as to their gradient exchange.
    """
    numel = max(1, int(config.probe_mb * 2**20) // 4)
    probe = torch.ones(numel, dtype=torch.float32, device=device)
    hosts = lab.hosts
    host_size = len(groups.members["host"])
    intra = _timed_allreduce(probe, groups.groups["host"], repeats, None) if host_size > 1 else 0.0
    inter = 0.0
    if len(hosts) > 1 and groups.leaders["host"] is not None:
        inter = _timed_allreduce(probe, groups.leaders["host"], repeats, pacer)
    # The slowest of each hop decides: every rank must reach the same choice.
    worst = torch.tensor([intra, inter], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    intra_s, inter_s = (float(v) for v in worst.tolist())
    return LinkMeasurement(
        probe_bytes=numel * 4,
        intra_seconds=intra_s if max(len(r) for r in hosts.values()) > 1 else None,
        inter_seconds=inter_s if len(hosts) > 1 else None,
        hosts=len(hosts),
        ranks_per_host=max(len(r) for r in hosts.values()),
    )


def choose(config: AutoCompression, links: LinkMeasurement, grad_bytes: int) -> tuple[Any, str]:
    """The compression config for these links and this gradient size (``None``: plain all-reduce), and why."""
    several = links.hosts > 1
    bus = links.inter_bus_gbps if several else links.intra_bus_gbps
    fp32_s = links.exchange_seconds(grad_bytes)
    budget = config.exposed_fraction * config.step_seconds if config.step_seconds else config.exposed_seconds
    hop = "between hosts" if several else "inside the host"
    if bus is None:
        return None, "one rank: nothing to exchange"
    what = f"{bus:.3g} GB/s bus {hop}, fp32 gradient exchange {1e3 * fp32_s:.0f} ms vs {1e3 * budget:.0f} ms budget"
    if bus >= NVLINK_BUS_GBPS:
        cls, method = "NVLink class", "none"
    elif bus >= PCIE_BUS_GBPS:
        cls, method = "PCIe class", "none" if fp32_s <= budget else "bf16"
    else:
        cls = "Ethernet class"
        # A fast enough slow link (short steps, small gradients) needs no lossy compression.
        method = "none" if fp32_s <= budget else "bf16" if fp32_s / 2 <= budget else config.strong
    chosen: Any
    if method == "none":
        chosen = NoCompression(hierarchical=True) if several else None
    elif method == "bf16":
        chosen = CastCompression(dtype="bf16", hierarchical=several)
    elif method == "powersgd":
        chosen = PowerSGDCompression(rank=4, hierarchical=several)
    else:
        chosen = TopKCompression(ratio=0.01, warmup_steps=50, hierarchical=several)
    name = chosen.describe() if chosen is not None else "none"
    return chosen, f"{cls} ({what}): {name}" + (", hierarchical" if several else "")


def link_column(links: LinkMeasurement, lab: Any) -> list[str]:
    """Per-rank text for the lab table: the measured bus bandwidth of each hop the rank takes part in (inside a host:
    the slowest host's)."""
    leaders = {ranks[0] for ranks in lab.hosts.values()}
    shared = {r for ranks in lab.hosts.values() if len(ranks) > 1 for r in ranks}
    out = []
    for rank in range(lab.world_size):
        parts = []
        if links.intra_bus_gbps is not None and rank in shared:
            parts.append(f"in host {links.intra_bus_gbps:.3g} GB/s")
        if links.inter_bus_gbps is not None and rank in leaders:
            parts.append(f"between hosts {links.inter_bus_gbps:.3g} GB/s")
        out.append(", ".join(parts) or "-")
    return out


def resolve_compression(request: Any, lab: Any, groups: Any, device: torch.device, pacer: Any,
                        module: Optional[torch.nn.Module]) -> tuple[Any, dict[str, list[str]]]:
    """The compression in use and its lab-table columns: ``request`` itself, or for ``"auto"`` the choice from the
    links measured now (a collective) and the module's gradient size."""
    columns: dict[str, list[str]] = {}
    config = request
    if isinstance(request, AutoCompression):
        links = measure_links(request, lab, groups, device, pacer)
        grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) if module else 0
        config, reason = choose(request, links, grad_bytes)
        columns["link (measured)"] = link_column(links, lab)
        rank_zero_info(f"compression='auto': {reason}")
    by = lab.device_classes if getattr(config, "group_by", "") == "class" else lab.hosts
    described = describe_compression(config, list(by.values()), lab.world_size)
    auto = isinstance(request, AutoCompression)
    columns["compression"] = [f"auto: {d}" if auto else d for d in described]
    return config, columns
