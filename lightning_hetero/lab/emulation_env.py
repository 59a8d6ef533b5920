"""The process environment of an emulated rank, set before the process group exists: NCCL's settings for the job's
link class, the emulated hosts (``LIGHTNING_HETERO_HOST`` and ``NCCL_HOSTID``), and the device name and capability
that :mod:`lightning_hetero.lab.devices` then reports.

NCCL settings must agree on every rank, so the link class is the job's (the slowest any rank asks for), derived from
every rank's spec. With emulated hosts, NCCL treats them as separate machines: peer-to-peer / shared memory inside a
host, its network transport (TCP sockets over loopback) between hosts, and ``link: "ethernet"`` names the hop
between hosts.

Example::
    >>> link_env(job_link_class(parse_emulate(["A100-40GB", "RTX3090"])))
    {'NCCL_NVLS_ENABLE': '0', 'NCCL_P2P_DISABLE': '1'}
"""

import os
import socket
from collections.abc import Sequence
from typing import Optional

from lightning_hetero.lab.devices import CAPABILITY_OVERRIDE_ENV, HOST_OVERRIDE_ENV, NAME_OVERRIDE_ENV
from lightning_hetero.lab.emulated_device import EmulatedDevice
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.presets import LINK_CLASSES, PRESETS, LinkClass

# NCCL settings per link class (measured between two H200s of one host: NVLink ≈ 275 GB/s, P2P off ≈ 25 GB/s,
# P2P and SHM off ≈ 2.6 GB/s). IB off too, so "ethernet" means TCP sockets on any host.
_LINK_ENV: dict[str, dict[str, str]] = {
    "nvlink": {},
    "pcie": {"NCCL_P2P_DISABLE": "1"},
    "ethernet": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
}
# NVLink SHARP (NVLS) exists only on Hopper NVSwitch systems: an emulated lab of other cards must not use it.
_ALWAYS_ENV = {"NCCL_NVLS_ENABLE": "0"}


def job_link(devices: Sequence[Optional[EmulatedDevice]]) -> LinkClass:
    """The link of the whole job: the slowest of any rank's (NCCL settings must agree on every rank)."""
    links = [d.link for d in devices if d is not None] or ["nvlink"]
    return max(links, key=LINK_CLASSES.index)  # type: ignore[return-value]


def link_env(link: LinkClass) -> dict[str, str]:
    """NCCL environment for a link class (set before the process group is created)."""
    if link not in LINK_CLASSES:
        raise ValueError(f"`link`={link!r} must be one of {LINK_CLASSES}.")
    return {**_ALWAYS_ENV, **_LINK_ENV[link]}


def link_class_of_spec(spec: Optional[EmulationSpec]) -> LinkClass:
    """A spec's link without a host (links must be known on every rank before devices are compared)."""
    if spec is None:
        return "nvlink"
    if spec.link is not None:
        return spec.link
    return PRESETS[spec.preset].link if spec.preset else "nvlink"


def emulates_hosts(specs: Sequence[Optional[EmulationSpec]]) -> bool:
    return any(s is not None and s.host is not None for s in specs)


def job_link_class(specs: Sequence[Optional[EmulationSpec]]) -> LinkClass:
    """The NCCL link class of the job. With emulated hosts, "ethernet" is the hop between hosts (NCCL_HOSTID makes
    NCCL use its network transport there): inside hosts only the other classes count."""
    links = [link_class_of_spec(s) for s in specs]
    if emulates_hosts(specs):
        links = [link for link in links if link != "ethernet"]
    return max(links or ["nvlink"], key=LINK_CLASSES.index)  # type: ignore[return-value]


def job_inter_host_gbit(specs: Sequence[Optional[EmulationSpec]]) -> Optional[float]:
    """The paced bandwidth between emulated hosts: the lowest any rank asks for (``None``: not paced)."""
    values = [s.inter_host_gbit for s in specs if s is not None and s.inter_host_gbit is not None]
    return min(values) if values else None


def nccl_host_id(host: str) -> str:
    """``NCCL_HOSTID`` of an emulated host: unique per real machine and emulated name (NCCL hashes it)."""
    return f"{socket.gethostname()}/{host}"


def rank_env(device: EmulatedDevice, root_type: str, link: LinkClass, hosts: bool) -> dict[str, str]:
    """The environment variables one rank sets for ``device`` on a ``root_type`` device, in a job on ``link`` that
    emulates ``hosts`` or not."""
    env = {NAME_OVERRIDE_ENV: device.name}
    if device.capability is not None:
        env[CAPABILITY_OVERRIDE_ENV] = f"{device.capability[0]}.{device.capability[1]}"
    if root_type == "cuda":
        env.update(link_env(link))
    if hosts:
        env[HOST_OVERRIDE_ENV] = device.host or socket.gethostname()
        env["NCCL_HOSTID"] = nccl_host_id(env[HOST_OVERRIDE_ENV])
        env["NCCL_IB_DISABLE"] = "1"  # between emulated hosts: TCP sockets, as on an Ethernet lab
        if "NCCL_SOCKET_IFNAME" not in os.environ:
            env["NCCL_SOCKET_IFNAME"] = "lo"  # the emulated hosts share this machine: loopback always exists
    return env
