"""What one rank's device is: a JSON-able description and its published peak compute rate.

The peak table is the ``capacities="peak"`` source: dense (non-sparse) tensor-core rates with fp32 accumulation,
as the vendors publish them, because that is what autocast matmuls run at. Devices missing from the table get an
estimate from compute capability × SM count.
"""

import os
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

# Environment override for the compute capability a rank reports (used by the lab emulator to exercise the
# fp16 path on bf16 hardware): "7.0" or "7,0".
CAPABILITY_OVERRIDE_ENV = "LIGHTNING_HETERO_CAPABILITY"
# Environment override for the device name (the emulator names an emulated card, e.g. "RTX 3090 (emulated)").
NAME_OVERRIDE_ENV = "LIGHTNING_HETERO_DEVICE_NAME"
# Environment override for the host name (the emulator puts ranks of one machine on emulated hosts: groups, leaders
# and the lab table follow it).
HOST_OVERRIDE_ENV = "LIGHTNING_HETERO_HOST"


@dataclass(frozen=True)
class DeviceInfo:
    """One rank's device, as every rank reports it at setup."""

    rank: int
    host: str
    type: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int]  # (0, 0) on CPU
    memory_bytes: int  # total device memory (CPU: physical memory)
    multiprocessors: int  # SM count (CPU: logical cores visible to the process)

    @property
    def device_class(self) -> str:
        """Ranks of one class are interchangeable: same device name (emulated cards carry their emulated name)."""
        return self.name

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _capability_override() -> Optional[tuple[int, int]]:
    raw = os.environ.get(CAPABILITY_OVERRIDE_ENV)
    if not raw:
        return None
    parts = raw.replace(",", ".").split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise ValueError(f"{CAPABILITY_OVERRIDE_ENV}={raw!r} is not a compute capability such as '7.0'") from None


def describe_device(device: torch.device, rank: int) -> DeviceInfo:
    """Describe the device this process trains on."""
    host = os.environ.get(HOST_OVERRIDE_ENV) or socket.gethostname()
    name_override = os.environ.get(NAME_OVERRIDE_ENV)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(
            rank=rank,
            host=host,
            type="cuda",
            name=name_override or props.name,
            capability=_capability_override() or (props.major, props.minor),
            memory_bytes=int(props.total_memory),
            multiprocessors=int(props.multi_processor_count),
        )
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return DeviceInfo(
        rank=rank,
        host=host,
        type=device.type,
        name=name_override or "cpu",
        capability=_capability_override() or (0, 0),
        memory_bytes=int(memory),
        multiprocessors=cores,
    )


# Dense TFLOP/s: (bf16, fp16, fp32). bf16 = 0 where the card has no bf16 tensor cores. Matched by substring of the
# device name, longest key first, so "H100 PCIe" wins over "H100".
PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    "B200": (2250.0, 2250.0, 80.0),
    "H200": (989.0, 989.0, 67.0),
    "H100 PCIe": (756.0, 756.0, 51.0),
    "H100": (989.0, 989.0, 67.0),
    "GH200": (989.0, 989.0, 67.0),
    "A100": (312.0, 312.0, 19.5),
    "A30": (165.0, 165.0, 10.3),
    "A40": (149.7, 149.7, 37.4),
    "A10G": (70.0, 70.0, 31.2),
    "A10": (125.0, 125.0, 31.2),
    "RTX A6000": (154.8, 154.8, 38.7),
    "A6000": (154.8, 154.8, 38.7),
    "L40S": (362.0, 362.0, 91.6),
    "L40": (181.0, 181.0, 90.5),
    "L4": (121.0, 121.0, 30.3),
    "V100": (0.0, 125.0, 15.7),
    "T4": (0.0, 65.0, 8.1),
    "P100": (0.0, 18.7, 9.3),
    "RTX 5090": (209.5, 209.5, 104.8),
    "RTX 4090": (165.2, 165.2, 82.6),
    "RTX 4080": (97.5, 97.5, 48.7),
    "RTX 3090": (35.6, 35.6, 35.6),
    "RTX 3080": (29.8, 29.8, 29.8),
    "RTX 2080 Ti": (0.0, 53.8, 13.4),
    "MI300X": (1307.0, 1307.0, 163.4),
    "MI250": (362.1, 362.1, 47.9),
}
"""Published dense TFLOP/s (bf16, fp16, fp32) by device-name substring: what ``capacities="peak"`` reads."""

# Per-SM dense tensor rate by compute capability (TFLOP/s per SM), for cards missing from the table.
_TFLOPS_PER_SM: dict[tuple[int, int], float] = {
    (7, 0): 1.56,  # Volta (V100: 125 / 80)
    (7, 5): 0.79,  # Turing (2080 Ti: 53.8 / 68)
    (8, 0): 2.89,  # Ampere datacenter (A100: 312 / 108)
    (8, 6): 0.43,  # Ampere consumer (3090: 35.6 / 82)
    (8, 9): 1.29,  # Ada (4090: 165.2 / 128)
    (9, 0): 7.49,  # Hopper (H100: 989 / 132)
    (10, 0): 15.2,  # Blackwell datacenter (B200: 2250 / 148)
    (12, 0): 1.23,  # Blackwell consumer (5090: 209.5 / 170)
}


def match_name(name: str, keys: Iterable[str]) -> Optional[str]:
    """The key that is part of the device name ``name`` (case-insensitive), the longest one where several are, so
    that "H100 PCIe" wins over "H100"; ``None`` when none is."""
    lowered = name.lower()
    return next((k for k in sorted(keys, key=len, reverse=True) if k.lower() in lowered), None)


def is_consumer_card(name: str) -> bool:
    """A GeForce / RTX workstation-class card by name (the RTX A6000 excepted): no NVLink between such cards, and
    peer-to-peer is often off or broken."""
    return ("GeForce" in name or "RTX" in name) and "A6000" not in name


def has_bf16_hardware(info: DeviceInfo) -> bool:
    """bf16 tensor cores exist from Ampere (8.0) on; torch.cuda.is_bf16_supported() may report emulation."""
    return info.type == "cuda" and info.capability >= (8, 0)


def peak_tflops(info: DeviceInfo, dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """Published dense rate of ``info`` for ``dtype`` matmuls; an estimate when the card is not in the table.

    bf16 on a card without bf16 falls back to its fp16 rate (the precision policy trains it in fp16). Returns
    ``None`` for CPUs, whose rate the table cannot know.
    """
    if info.type != "cuda":
        return None
    column = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}.get(dtype, 2)
    key = match_name(info.name, PEAK_TFLOPS)
    if key is not None:
        rates = PEAK_TFLOPS[key]
        return rates[column] if rates[column] > 0 else rates[1]
    per_sm = _TFLOPS_PER_SM.get(info.capability)
    if per_sm is None:
        # Nearest older architecture: a new card is at least as fast per SM as its predecessor.
        known = [cc for cc in _TFLOPS_PER_SM if cc <= info.capability]
        per_sm = _TFLOPS_PER_SM[max(known)] if known else 0.5
    estimate = per_sm * max(info.multiprocessors, 1)
    return estimate if column != 2 else estimate / 8.0
