"""Emulate a mixed lab on identical GPUs (or on CPU), to develop and benchmark without owning the cards.

Every rank gets a profile: a preset name (``"RTX3090"``, ``"A100-40GB"``, ...), a dict, or ``None`` (the real
device, unchanged). On CUDA a profile applies:

- **compute**: a CUDA green context with a share of the host's SMs. Only kernels launched on the green context's
  stream are capped, so the strategy runs every training/validation/test/predict step and every optimizer step
  (whose closure runs forward and backward) with that stream as the current stream; autograd runs each backward op
  on its forward op's stream, so backward is capped too. NCCL launches its kernels on its own streams: collectives
  are *not* capped (a real slow card's NCCL kernels would also be slower, but they are memory-bound, not SM-bound).
  Work outside the steps (the batch copy, logging reductions, callbacks) is not capped either.
- **memory**: ``torch.cuda.set_per_process_memory_fraction`` caps PyTorch's caching allocator (the CUDA context and
  NCCL's buffers are outside it).
- **name and compute capability**: the ``LIGHTNING_HETERO_DEVICE_NAME`` / ``LIGHTNING_HETERO_CAPABILITY`` overrides
  that :mod:`lightning_hetero.lab.devices` reads, so the lab table, ``capacities="peak"`` and the precision policy see
  the emulated card (a ``(7, 0)`` capability makes the policy take the fp16 path on bf16 hardware).
- **link**: the slowest link class of the job, through NCCL's environment before the process group exists
  (``"pcie"``: no peer-to-peer, ≈ 25 GB/s on an H200 host; ``"ethernet"``: no P2P and no shared memory, ≈ 2.6 GB/s).
- **host** (``{"host": "ws1"}``): the rank reports that host name (``LIGHTNING_HETERO_HOST``: host groups, leaders and
  the lab table follow it) and NCCL gets ``NCCL_HOSTID`` before the process group exists, so NCCL treats the emulated
  hosts as separate machines: peer-to-peer / shared memory inside a host, its network transport (TCP sockets over
  loopback: ``NCCL_IB_DISABLE=1``, ``NCCL_SOCKET_IFNAME=lo`` unless set) between hosts. With emulated hosts,
  ``link: "ethernet"`` names the link *between* hosts and leaves the transport inside each host alone.
- **inter-host bandwidth** (``{"inter_host_gbit": 10}``): the hop between hosts is *paced*, not throttled: the
  gradient exchange between hosts still runs at the machine's speed, then the hook holds the step until a link of
  that many Gbit/s would have delivered the same bytes (see
  :class:`~lightning_hetero.lab.link_pacing.LinkPacer`; the job uses the lowest value of any
  rank). Transfers overlap the backward pass as they would on a real link; the time a real NIC's protocol stack
  would add is not modelled. Works on CPU (gloo) too.

Presets are calibrated by *measurement* (:mod:`lightning_hetero.lab.calibration`): the host GPU's calibration file
gives each preset an SM count and a time dilation (the GPU idles ``(d - 1) x`` each step's compute time, see
:mod:`lightning_hetero.lab.dilation`) that make the host train like the card, per workload family (profile key
``"workload"``: ``"bert"``, ``"resnet"`` or ``"gpt"``; else the default fit). Targets are published training speeds
(:mod:`lightning_hetero.lab.cards`). A host without a calibration file gets the published speed ratio as its SM share
(a warning says so); ``{"preset": ..., "calibration": "peak_tflops"}`` keeps the old share of dense bf16 rates. SM
counts are rounded to the green-context granularity (multiples of 8 on compute capability 9.x); a card slower than
one granule is clamped up to it, a card as fast as the host runs uncapped; the summary says so.

On CPU there are no SMs: a profile's ``slowdown`` makes the rank pause ``(slowdown - 1) ×`` the CPU time its
training thread spent in each step (Lightning's launchers give each CPU rank cores / ranks intra-op threads; with
more than one, work on the other threads is not counted), and presets calibrate to
``slowdown = fastest preset's rate / this preset's rate``. CPU time, not wall time: a rank blocked waiting for a
slower rank's all-reduce would otherwise sleep for that wait too, and slowed ranks would inflate each other. The CPU
that collectives inside the step burn (the strategy's weighted ``reduce``; DDP's wait for the gradient all-reduce
after the last bucket) is left out too: a slower card computes slower, its communication is not slowed. The
pause sleeps except for its last millisecond, which is busy-waited: a core that slept comes back cold and slow, and
that would be multiplied by the slowdown again (a 3x rank measured 5-6x on a millisecond step).

A rank can slow down mid-run (a card that throttles): ``Emulator.throttle(factor)`` between two steps divides its SM
count by ``factor`` (rounded to the granularity; a new green context) or multiplies its CPU slowdown.

Example::

    from lightning.pytorch import Trainer
    from lightning_hetero import HeteroDDPStrategy

    # two H200s pretending to be an A100 and an RTX 3090 on a PCIe link
    strategy = HeteroDDPStrategy(capacities="peak", emulate=["A100-40GB", "RTX3090"])
    Trainer(accelerator="gpu", devices=2, strategy=strategy).fit(model)

    # a custom profile: a quarter of the SMs, 24 GiB, PCIe-class link
    HeteroDDPStrategy(emulate=[None, {"sm_share": 0.25, "memory_gib": 24, "link": "pcie"}])
"""

import math
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union

import torch

from lightning_hetero.lab.calibration import HOST_KINDS, HOST_STAND_IN, load_calibration
from lightning_hetero.lab.cards import WORKLOADS, card_of, device_speed, training_speed
from lightning_hetero.lab.devices import (
    CAPABILITY_OVERRIDE_ENV,
    HOST_OVERRIDE_ENV,
    NAME_OVERRIDE_ENV,
    DeviceInfo,
    match_name,
    peak_tflops,
)
from lightning_hetero.lab.dilation import GpuDilation, measure_spin_rate

LinkClass = Literal["nvlink", "pcie", "ethernet"]
LINK_CLASSES: tuple[str, ...] = ("nvlink", "pcie", "ethernet")  # fastest first
EmulateArg = Optional[Sequence[Union[str, Mapping[str, Any], None]]]

EMULATED_SUFFIX = " (emulated)"

# NCCL settings per link class (measured between two H200s of one host: NVLink ≈ 275 GB/s, P2P off ≈ 25 GB/s,
# P2P and SHM off ≈ 2.6 GB/s). IB off too, so "ethernet" means TCP sockets on any host.
_LINK_ENV: dict[str, dict[str, str]] = {
    "nvlink": {},
    "pcie": {"NCCL_P2P_DISABLE": "1"},
    "ethernet": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
}
# NVLink SHARP (NVLS) exists only on Hopper NVSwitch systems: an emulated lab of other cards must not use it.
_ALWAYS_ENV = {"NCCL_NVLS_ENABLE": "0"}


@dataclass(frozen=True)
class Preset:
    """A card to emulate: its reported name (a key of ``PEAK_TFLOPS`` must be part of it), memory and capability."""

    name: str
    memory_gib: float
    capability: tuple[int, int]
    link: LinkClass


PRESETS: dict[str, Preset] = {
    "H100": Preset("NVIDIA H100 80GB HBM3", 80, (9, 0), "nvlink"),
    "A100-80GB": Preset("NVIDIA A100-SXM4-80GB", 80, (8, 0), "nvlink"),
    "A100-40GB": Preset("NVIDIA A100-SXM4-40GB", 40, (8, 0), "nvlink"),
    "L40S": Preset("NVIDIA L40S", 48, (8, 9), "pcie"),
    "A6000": Preset("NVIDIA RTX A6000", 48, (8, 6), "pcie"),
    "RTX4090": Preset("NVIDIA GeForce RTX 4090", 24, (8, 9), "pcie"),
    "RTX3090": Preset("NVIDIA GeForce RTX 3090", 24, (8, 6), "pcie"),
    "A10": Preset("NVIDIA A10", 24, (8, 6), "pcie"),
    "V100": Preset("Tesla V100-SXM2-32GB", 32, (7, 0), "nvlink"),
    "T4": Preset("Tesla T4", 16, (7, 5), "pcie"),
}
"""The cards ``emulate=[...]`` accepts by name: reported name, memory, compute capability and link class of each."""

_PROFILE_KEYS = ("preset", "name", "sm_share", "memory_gib", "memory_fraction", "capability", "link", "slowdown",
                 "host", "inter_host_gbit", "workload", "calibration")
# How a preset's speed is set on a GPU: "measured" (the host's calibration file; without one, the published training
# speed ratio as SM share) or "peak_tflops" (SM share = dense bf16 rate ratio, the old calibration).
CALIBRATIONS: tuple[str, ...] = ("measured", "peak_tflops")


@dataclass(frozen=True)
class EmulationSpec:
    """One rank's validated profile, before it meets the host device."""

    preset: Optional[str] = None
    name: Optional[str] = None
    sm_share: Optional[float] = None  # fraction of the host's SMs; None: from the preset, else all
    memory_gib: Optional[float] = None
    memory_fraction: Optional[float] = None
    capability: Optional[tuple[int, int]] = None
    link: Optional[LinkClass] = None
    slowdown: Optional[float] = None  # CPU analogue of the SM share
    host: Optional[str] = None  # emulated host name
    inter_host_gbit: Optional[float] = None  # paced bandwidth between emulated hosts, Gbit/s
    workload: Optional[str] = None  # "bert" | "resnet" | "gpt": the preset's calibration for that family
    calibration: Optional[str] = None  # one of CALIBRATIONS; None: "measured"

    def __post_init__(self) -> None:
        # Built directly (not from a YAML dict through `parse_emulate`): the same checks, naming the field.
        raw = {k: getattr(self, k) for k in _PROFILE_KEYS if getattr(self, k) is not None}
        for key, value in _fields(raw, "EmulationSpec").items():
            object.__setattr__(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able dict this spec was parsed from (unset keys left out)."""
        out = {k: getattr(self, k) for k in _PROFILE_KEYS if getattr(self, k) is not None}
        if "capability" in out:
            out["capability"] = f"{out['capability'][0]}.{out['capability'][1]}"
        return out


@dataclass(frozen=True)
class EmulatedDevice:
    """One rank's profile resolved against its host device: what the emulator will actually do."""

    name: str  # reported name, ending in " (emulated)"
    host_name: str
    host_sms: int
    num_sms: Optional[int]  # green-context SM count; None: all SMs (no cap)
    wanted_sms: Optional[float]  # what the calibration asked for, before rounding to the granularity
    memory_bytes: Optional[int]  # allocator cap; None: no cap
    capability: Optional[tuple[int, int]]
    link: LinkClass
    slowdown: float  # CPU: sleep (slowdown - 1) × step CPU time; 1.0: none
    clamped: bool = False  # the calibrated SM count was out of the green context's range
    host: Optional[str] = None  # emulated host name (None: the real one)
    inter_host_gbit: Optional[float] = None
    host_capability: Optional[tuple[int, int]] = None  # the real GPU's (its green-context granularity); CPU: None
    dilation: float = 1.0  # GPU: each step is followed by an idle of (dilation - 1) x its compute time
    calibration: str = ""  # where the preset's speed came from, for the lab table ("" without a preset)

    @property
    def sm_share(self) -> float:
        return 1.0 if self.num_sms is None else self.num_sms / self.host_sms

    def summary(self) -> str:
        """A short description for the lab table."""
        parts = []
        if self.num_sms is not None:
            parts.append(f"{self.num_sms}/{self.host_sms} SMs")
        elif self.host_sms:
            parts.append("all SMs")
        if self.clamped and self.wanted_sms is not None:
            parts[-1] += f" (calibration wants {self.wanted_sms:.1f}: clamped)"
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 2**30:.0f} GiB cap")
        if self.dilation > 1.0:
            parts.append(f"dilation {self.dilation:.2f}x")
        if self.slowdown > 1.0:
            parts.append(f"slowdown {self.slowdown:.2f}x")
        if self.calibration:
            parts.append(f"calibration: {self.calibration}")
        if self.host is not None:
            parts.append(f"host {self.host}")
        parts.append(self.link)
        if self.inter_host_gbit is not None:
            parts[-1] += f" at {self.inter_host_gbit:g} Gbit/s (paced)"
        return ", ".join(parts)


def parse_emulate(value: EmulateArg, name: str = "emulate") -> Optional[tuple[Optional[EmulationSpec], ...]]:
    """Validate the strategy's ``emulate`` argument at construction; ``ValueError`` naming it otherwise (as ``name``:
    the rehearsal's ``--lab`` gives its cards in the same form)."""
    if value is None:
        return None
    if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(
            f"`{name}`={value!r} must be a list with one entry per rank (a preset name, a dict or None), "
            f"e.g. ['A100-40GB', 'RTX3090']. Presets: {sorted(PRESETS)}."
        )
    if not value:
        raise ValueError(f"`{name}` is empty: give one entry per rank, or leave it None.")
    return tuple(_parse_one(entry, f"{name}[{i}]") for i, entry in enumerate(value))


def _parse_one(entry: Union[str, Mapping[str, Any], None], where: str) -> Optional[EmulationSpec]:
    if entry is None:
        return None
    if isinstance(entry, str):
        if entry not in PRESETS:
            raise ValueError(f"`{where}`={entry!r} is not a preset; known presets: {sorted(PRESETS)}.")
        return EmulationSpec(preset=entry)
    if not isinstance(entry, Mapping):
        raise ValueError(f"`{where}`={entry!r} must be a preset name, a dict or None.")
    return EmulationSpec(**_fields(entry, where))


def _fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A profile dict's validated, normalised fields; ``ValueError`` naming ``where.field`` otherwise."""
    unknown = sorted(set(entry) - set(_PROFILE_KEYS))
    if unknown:
        raise ValueError(f"`{where}` has unknown keys {unknown}; allowed: {list(_PROFILE_KEYS)}.")
    preset = entry.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"`{where}.preset`={preset!r} is not a preset; known presets: {sorted(PRESETS)}.")
    name = entry.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"`{where}.name`={name!r} must be a non-empty string.")
    link = entry.get("link")
    if link is not None and link not in LINK_CLASSES:
        raise ValueError(f"`{where}.link`={link!r} must be one of {LINK_CLASSES}.")
    if entry.get("memory_gib") is not None and entry.get("memory_fraction") is not None:
        raise ValueError(f"`{where}` sets both `memory_gib` and `memory_fraction`; give one.")
    host = entry.get("host")
    if host is not None and (not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host)):
        raise ValueError(f"`{where}.host`={host!r} must be a non-empty host name without spaces.")
    workload = entry.get("workload")
    if workload is not None and workload not in WORKLOADS:
        raise ValueError(f"`{where}.workload`={workload!r} must be one of {WORKLOADS}.")
    calibration = entry.get("calibration")
    if calibration is not None and calibration not in CALIBRATIONS:
        raise ValueError(f"`{where}.calibration`={calibration!r} must be one of {CALIBRATIONS}.")
    if (workload is not None or calibration is not None) and preset is None:
        raise ValueError(f"`{where}` sets `workload` or `calibration` without a `preset`: they choose how a preset "
                         "is calibrated.")
    return dict(
        preset=preset,
        name=name,
        sm_share=_number(entry.get("sm_share"), f"{where}.sm_share", low=0.0, high=1.0),
        memory_gib=_number(entry.get("memory_gib"), f"{where}.memory_gib", low=0.0),
        memory_fraction=_number(entry.get("memory_fraction"), f"{where}.memory_fraction", low=0.0, high=1.0),
        capability=_capability(entry.get("capability"), f"{where}.capability"),
        link=link,
        slowdown=_number(entry.get("slowdown"), f"{where}.slowdown", low=1.0, inclusive_low=True),
        host=host,
        inter_host_gbit=_number(entry.get("inter_host_gbit"), f"{where}.inter_host_gbit", low=0.0),
        workload=workload,
        calibration=calibration,
    )


def _number(
    value: Any, where: str, low: float, high: Optional[float] = None, inclusive_low: bool = False
) -> Optional[float]:
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if not bad:
        bad = value < low if inclusive_low else value <= low
        bad = bad or (high is not None and value > high)
    if bad:
        bound = f"{'>=' if inclusive_low else '>'} {low}" + (f" and <= {high}" if high is not None else "")
        raise ValueError(f"`{where}`={value!r} must be a number {bound}.")
    return float(value)


def _capability(value: Any, where: str) -> Optional[tuple[int, int]]:
    if value is None:
        return None
    try:
        if isinstance(value, (str, float)) and not isinstance(value, bool):  # a YAML loader may make 7.5 a float
            major, _, minor = str(value).replace(",", ".").partition(".")
            parsed = (int(major), int(minor or 0))
        else:
            major, minor = value
            parsed = (int(major), int(minor))
    except (TypeError, ValueError):
        raise ValueError(f"`{where}`={value!r} must be a compute capability such as '7.0' or [7, 0].") from None
    if parsed < (1, 0):
        raise ValueError(f"`{where}`={value!r} must be a compute capability such as '7.0' or [7, 0].")
    return parsed


def sm_granularity(capability: tuple[int, int]) -> tuple[int, int]:
    """(minimum, step) of a green context's SM count: CUDA splits SMs in groups of 8 on 9.x and newer, of 2 before."""
    return (8, 8) if capability >= (9, 0) else (4, 2) if capability >= (8, 0) else (2, 2)


def round_sms(wanted: float, total: int, capability: tuple[int, int]) -> Optional[int]:
    """The green-context SM count closest to ``wanted``; ``None`` when that is the whole device."""
    minimum, step = sm_granularity(capability)
    count = max(minimum, int(math.floor(wanted / step + 0.5)) * step)
    return None if count >= total else count


def preset_tflops(preset: Preset) -> float:
    """The rate a preset is calibrated by: its dense bf16 rate, its fp16 rate on cards without bf16."""
    info = DeviceInfo(rank=0, host="", type="cuda", name=preset.name, capability=preset.capability,
                      memory_bytes=int(preset.memory_gib * 2**30), multiprocessors=0)
    rate = peak_tflops(info, torch.bfloat16)
    assert rate is not None and rate > 0, preset
    return rate


def lab_slowdown(preset: str, lab_specs: Sequence[Optional[EmulationSpec]]) -> float:
    """A CPU rank's slowdown as ``preset`` in the lab ``lab_specs``: the lab's fastest preset's published training
    speed (:func:`~lightning_hetero.lab.cards.training_speed`, the default over workloads) over this one's."""
    rates = [training_speed(s.preset) for s in lab_specs if s is not None and s.preset]
    own = training_speed(preset)
    return max(rates + [own]) / own


def preset_knob(spec: EmulationSpec, host: DeviceInfo) -> tuple[float, float, str]:
    """A preset's ``(wanted SM count, dilation, calibration label)`` on the GPU ``host``.

    The host's calibration file when it has one; else the published training-speed ratio of the preset to the host
    (an H200 taken as the H100 the calibration treats it as) as SM share; ``calibration="peak_tflops"``: the dense
    bf16 rate ratio.
    """
    preset = spec.preset
    assert preset is not None
    if spec.calibration == "peak_tflops":
        host_rate = peak_tflops(host, torch.bfloat16) or preset_tflops(PRESETS[preset])
        return preset_tflops(PRESETS[preset]) / host_rate * host.multiprocessors, 1.0, "peak_tflops"
    table = load_calibration(host.name)
    if table is not None:
        sms, dilation = table.knob(preset, spec.workload)
        label = f"measured {os.path.basename(table.path)} ({spec.workload or 'default'})"
        return sms * host.multiprocessors / table.host_sms, dilation, label
    host_card = card_of(host.name) or (HOST_STAND_IN if match_name(host.name, HOST_KINDS) else None)
    host_speed = training_speed(host_card, spec.workload) if host_card else device_speed(host, spec.workload)
    share = training_speed(preset, spec.workload) / host_speed if host_speed else 1.0
    return share * host.multiprocessors, 1.0, f"published ratio as SM share, no calibration file for {host.name!r}"


def alone(spec: Optional[EmulationSpec], lab_specs: Sequence[Optional[EmulationSpec]],
          root_type: str) -> Optional[EmulationSpec]:
    """``spec`` to run without the rest of its lab at the speed it has in the lab: on CPU its slowdown is relative to
    the lab's fastest preset, so it is pinned; a GPU's SM share is the card's own already."""
    if spec is None or root_type == "cuda" or spec.slowdown is not None or spec.preset is None:
        return spec
    return replace(spec, slowdown=lab_slowdown(spec.preset, lab_specs))


def resolve(
    spec: EmulationSpec, host: DeviceInfo, lab_specs: Sequence[Optional[EmulationSpec]] = ()
) -> EmulatedDevice:
    """What ``spec`` means on ``host``: SM count, memory cap, name, link, CPU slowdown.

    ``lab_specs`` (every rank's spec) calibrates CPU slowdowns of presets against the lab's fastest preset.
    """
    preset = PRESETS[spec.preset] if spec.preset else None
    name = spec.name or (preset.name if preset else _default_name(spec, host))
    if not name.endswith(EMULATED_SUFFIX):
        name += EMULATED_SUFFIX
    capability = spec.capability or (preset.capability if preset else None)
    link: LinkClass = spec.link or (preset.link if preset else "nvlink")  # type: ignore[assignment]

    memory: Optional[int] = None
    if spec.memory_fraction is not None:
        memory = int(spec.memory_fraction * host.memory_bytes)
    elif spec.memory_gib is not None or preset is not None:
        gib = spec.memory_gib if spec.memory_gib is not None else preset.memory_gib  # type: ignore[union-attr]
        memory = int(gib * 2**30)
    if memory is not None and host.memory_bytes and memory >= host.memory_bytes:
        memory = None  # the card has more memory than the host: nothing to cap

    num_sms: Optional[int] = None
    wanted: Optional[float] = None
    clamped = False
    slowdown = spec.slowdown or 1.0
    dilation, calibration = 1.0, ""
    if host.type == "cuda":
        if spec.sm_share is not None:
            wanted = spec.sm_share * host.multiprocessors
        elif preset is not None:
            wanted, dilation, calibration = preset_knob(spec, host)
        if wanted is not None:
            num_sms = round_sms(wanted, host.multiprocessors, host.capability)
            granted = num_sms if num_sms is not None else host.multiprocessors
            clamped = abs(granted - wanted) > 0.15 * wanted  # the granularity cannot express this card
    elif spec.slowdown is None and spec.preset is not None:
        slowdown = lab_slowdown(spec.preset, lab_specs)
    return EmulatedDevice(
        name=name,
        host_name=host.name,
        host_sms=host.multiprocessors if host.type == "cuda" else 0,
        num_sms=num_sms,
        wanted_sms=wanted,
        memory_bytes=memory,
        capability=capability,
        link=link,
        slowdown=slowdown,
        clamped=clamped,
        host=spec.host,
        inter_host_gbit=spec.inter_host_gbit,
        host_capability=host.capability if host.type == "cuda" else None,
        dilation=dilation,
        calibration=calibration,
    )


def throttled(device: EmulatedDevice, factor: float) -> EmulatedDevice:
    """``device`` made ``factor`` times slower: on a GPU its SM count (all SMs when uncapped) divided by ``factor``
    and rounded to the green-context granularity (:func:`round_sms`), on CPU its ``slowdown`` multiplied by it.

    Example::
        >>> throttled(uncapped_h100, 2.0).num_sms  # 132 SMs / 2 = 66 wanted: 64 granted (multiples of 8 on 9.x)
        64
    """
    bad = isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor)
    if bad or factor < 1.0:
        raise ValueError(f"`factor`={factor!r} must be a number >= 1 (how many times slower the rank becomes).")
    if device.host_capability is None:
        return replace(device, slowdown=device.slowdown * float(factor))
    current = device.num_sms if device.num_sms is not None else device.host_sms
    wanted = current / factor
    num_sms = round_sms(wanted, device.host_sms, device.host_capability)
    granted = num_sms if num_sms is not None else device.host_sms
    if factor > 1.0 and granted >= current:
        minimum, _ = sm_granularity(device.host_capability)
        raise ValueError(f"`factor`={factor!r}: {current} SMs / {factor:g} rounds to {granted}; a green context "
                         f"has at least {minimum} SMs, in steps of the granularity: this card cannot slow further.")
    return replace(device, num_sms=num_sms, wanted_sms=wanted, clamped=abs(granted - wanted) > 0.15 * wanted)


def _default_name(spec: EmulationSpec, host: DeviceInfo) -> str:
    # Not the host's name: `capacities="peak"` would then read the host's rate. An unknown name makes the peak
    # table estimate from capability × the emulated SM count.
    if host.type == "cuda" and spec.sm_share is not None:
        return f"GPU slice {spec.sm_share:.0%} SMs"
    if spec.slowdown:
        return f"{host.name} at 1/{spec.slowdown:g} speed"
    if spec.host is not None and host.type == "cpu":
        return host.name  # only the host is emulated: the rank keeps its device class
    return host.name  # full compute (only memory, capability or link emulated): the host's rate is right


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


class Emulator:
    """Applies one rank's :class:`EmulatedDevice` and runs its steps under it.

    Order of use: :meth:`apply_env` (before the process group exists), :meth:`activate` (after the CUDA device is
    set), :meth:`work` around every step (:meth:`throttle` between two of them slows the rank mid-run),
    :meth:`restore` at teardown.
    """

    def __init__(self, device: EmulatedDevice, root_device: torch.device, job_link_class: LinkClass,
                 hosts: bool = False, inter_host_gbit: Optional[float] = None) -> None:
        self.device = device
        self.root_device = root_device
        self.link: LinkClass = job_link_class
        self.hosts = hosts  # the job emulates hosts (NCCL's network transport between them)
        self.inter_host_gbit = inter_host_gbit  # the job's paced inter-host bandwidth
        self._saved_env: dict[str, Optional[str]] = {}
        self._green: Any = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._retired: list[Any] = []  # green contexts replaced by `throttle`, kept alive (see there)
        self._depth = 0
        self.compute_seconds = 0.0  # measured step time (CPU: thread CPU time) before the slowdown
        self.slept_seconds = 0.0
        # CPU: collectives are communication, not the card's compute (see `collective_began`).
        self._cpu_slowed = device.slowdown > 1.0 and root_device.type != "cuda"
        self._collective_cpu = 0.0  # this step's CPU seconds inside collectives
        self._bucket_cpu: Optional[float] = None  # the clock when the last gradient bucket went to the comm hook
        self._dilation: Optional[GpuDilation] = None  # GPU time dilation (set up by `activate`)

    def apply_env(self) -> None:
        env = {NAME_OVERRIDE_ENV: self.device.name}
        if self.device.capability is not None:
            env[CAPABILITY_OVERRIDE_ENV] = f"{self.device.capability[0]}.{self.device.capability[1]}"
        if self.root_device.type == "cuda":
            env.update(link_env(self.link))
        if self.hosts:
            env[HOST_OVERRIDE_ENV] = self.device.host or socket.gethostname()
            env["NCCL_HOSTID"] = nccl_host_id(env[HOST_OVERRIDE_ENV])
            env["NCCL_IB_DISABLE"] = "1"  # between emulated hosts: TCP sockets, as on an Ethernet lab
            if "NCCL_SOCKET_IFNAME" not in os.environ:
                env["NCCL_SOCKET_IFNAME"] = "lo"  # the emulated hosts share this machine: loopback always exists
        for key, value in env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def activate(self) -> None:
        """Cap memory and create the green context (the CUDA device must be the current one)."""
        if self.root_device.type != "cuda":
            return
        index = self._index()
        if self.device.memory_bytes is not None:
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.device.memory_bytes / total), index)
        if self.device.num_sms is not None:
            self._cap_sms(self.device.num_sms)
        if self.device.dilation > 1.0:
            self._dilation = GpuDilation(self.device.dilation, measure_spin_rate(torch.device("cuda", index)))

    def _index(self) -> int:
        return self.root_device.index if self.root_device.index is not None else torch.cuda.current_device()

    def _cap_sms(self, num_sms: int) -> None:
        from torch.cuda.green_contexts import GreenContext

        self._green = GreenContext.create(num_sms=num_sms, device_id=self._index())
        self._stream = self._green.Stream()

    def throttle(self, factor: float) -> EmulatedDevice:
        """Make this rank ``factor`` times slower from its next step on (a card that throttles mid-run); returns the
        new :class:`EmulatedDevice`. Call between steps, after :meth:`activate`.

        On CUDA the steps move to a new green context with the SM count divided by ``factor`` (see
        :func:`throttled`): :meth:`work` reads the stream at every step. On CPU the slowdown is multiplied. A CPU rank
        that started unslowed had no gradient-bucket observer registered by the strategy at setup, so after a
        throttle its wait for DDP's all-reduce counts as compute: give it a slowdown above 1 from the start when
        that matters.

        cuDNN keeps the kernels it chose for the old SM count: ResNet-50 autotuned (``cudnn.benchmark``) on a whole H100
        failed on its next backward after a throttle to 64 SMs (``CUDNN_STATUS_EXECUTION_FAILED``, 2026-11-27);
        matmul-bound models (cuBLAS, GPT) slowed by the SM ratio.
        """
        if self._depth:
            raise RuntimeError("Emulator.throttle() was called inside a step: call it between steps.")
        device = throttled(self.device, factor)
        if self.root_device.type == "cuda" and device.num_sms != self.device.num_sms:
            if self._green is not None:
                # Work queued on the old green context's stream must finish before that context may go; kept
                # referenced, it is destroyed with the emulator.
                torch.cuda.synchronize(self.root_device)
                self._retired.append(self._green)
            if device.num_sms is None:
                self._green = self._stream = None
            else:
                self._cap_sms(device.num_sms)
            if self._dilation is not None:
                self._dilation.restart()  # the old SM count's step times no longer say what a step takes
        self.device = device
        self._cpu_slowed = device.slowdown > 1.0 and self.root_device.type != "cuda"
        return device

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The green context's stream (``None`` without an SM cap)."""
        return self._stream

    @contextmanager
    def work(self) -> Iterator[None]:
        """Run the enclosed step on the capped stream, then queue its GPU dilation or sleep off the CPU slowdown.
        Re-entrant: a nested step (the training step inside the optimizer step's closure) is counted once, by the
        outermost."""
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            slowed = self.device.slowdown > 1.0
            start = self._clock() if slowed else 0.0  # the clock synchronizes on CUDA: only when it is needed
            self._collective_cpu, self._bucket_cpu = 0.0, None
            with self.capped_stream():
                dilation = self._dilation
                stream = torch.cuda.current_stream(self.root_device) if dilation is not None else None
                if dilation is not None:
                    dilation.begin(stream)
                yield
                if dilation is not None:
                    # Counted as a CPU rank's pause is: completed steps' GPU time, and the idle queued after this one.
                    measured, paused = dilation.end(stream)
                    self.compute_seconds += measured
                    self.slept_seconds += paused
            if slowed:
                elapsed = max(self._clock() - start - self._collective_cpu, 0.0)
                self.compute_seconds += elapsed
                # Every step pauses what it owes. A late wake-up (a busy host) is host noise, as on any rank; credited
                # against later steps it would leave those unslowed, and the fastest of a few profiled steps would
                # then time the emulated card at full speed.
                begin = time.perf_counter()
                _pause((self.device.slowdown - 1.0) * elapsed)
                self.slept_seconds += time.perf_counter() - begin
        finally:
            self._depth -= 1

    @contextmanager
    def capped_stream(self) -> Iterator[None]:
        """Run the enclosed work on the capped stream, as a step runs, but unslowed and uncounted: a trial step then
        allocates what a step does (a stream's first matrix product allocates the kernels' workspace for it)."""
        stream = self._stream
        if stream is None:
            yield
            return
        outer = torch.cuda.current_stream(self.root_device)
        stream.wait_stream(outer)  # the batch was copied on the outer stream
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            outer.wait_stream(stream)  # what follows on the outer stream reads the step's results

    @property
    def slows_cpu(self) -> bool:
        """This rank pauses after each step in proportion to its CPU time (a CPU rank with ``slowdown`` > 1)."""
        return self._cpu_slowed

    def collective_began(self) -> Optional[float]:
        """Before a collective issued inside a step: the CPU clock when a CPU slowdown must leave it out, else
        ``None``. Pass it to :meth:`collective_ended`. A slower card does not slow its collectives (on GPUs NCCL runs
        outside the green context too), yet gloo burns CPU in each one (70-170 us per small all-reduce on a 2-core VM,
        the more the further apart the ranks arrive): slowed, that would turn every shift in arrival times into
        pause."""
        return time.thread_time() if self._cpu_slowed and self._depth else None

    def collective_ended(self, began: Optional[float]) -> None:
        if began is not None:
            self._collective_cpu += time.thread_time() - began

    def bucket_ready(self) -> None:
        """A gradient bucket went to the comm hook (a bucket observer of the strategy's weighting hook): the
        backward's compute is done when the last one does; what follows until :meth:`backward_returned` is DDP
        waiting for the gradient all-reduce."""
        if self._cpu_slowed and self._depth:
            self._bucket_cpu = time.thread_time()

    def backward_returned(self) -> None:
        if self._bucket_cpu is not None:
            self._collective_cpu += time.thread_time() - self._bucket_cpu
            self._bucket_cpu = None

    @contextmanager
    def slowed_in_place(self) -> Iterator[None]:
        """Inside a step: pause for the enclosed piece of work as it ends rather than at the step's end, where a
        pipeline stage's neighbour waits for each micro-batch of a slower card. Its CPU time, pause included, then
        leaves the step's own count."""
        if not (self._cpu_slowed and self._depth):
            yield
            return
        begin = time.thread_time()
        yield
        elapsed = time.thread_time() - begin
        self.compute_seconds += elapsed
        paused = time.perf_counter()
        _pause((self.device.slowdown - 1.0) * elapsed)
        self.slept_seconds += time.perf_counter() - paused
        # Paid here: the step's end pauses for the rest of its CPU time only (as for a collective's).
        self._collective_cpu += time.thread_time() - begin

    def reset_stats(self) -> None:
        """Start counting ``compute_seconds`` / ``slept_seconds`` afresh."""
        self.compute_seconds = self.slept_seconds = 0.0

    def _clock(self) -> float:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)
            return time.perf_counter()
        # CPU time of the training thread: a blocking wait for a slower rank's all-reduce is not compute, so slowed
        # ranks do not inflate each other.
        return time.thread_time()

    def describe(self, info: DeviceInfo) -> DeviceInfo:
        """The rank's device as the lab table should show it: emulated memory and SM count."""
        memory = self.device.memory_bytes if self.device.memory_bytes is not None else info.memory_bytes
        sms = self.device.num_sms if self.device.num_sms is not None else info.multiprocessors
        return replace(info, memory_bytes=int(memory), multiprocessors=int(sms))

    def summary(self) -> str:
        link = self.link if self.root_device.type == "cuda" else "gloo (link not emulated)"
        if self.hosts:
            link += ", NET between hosts" if self.root_device.type == "cuda" else ", hosts emulated"
        return replace(self.device, link=link, inter_host_gbit=self.inter_host_gbit).summary()  # type: ignore[arg-type]

    def restore(self) -> None:
        """Undo :meth:`apply_env` (the memory cap and green context end with the process)."""
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()


# The last stretch of every emulated pause is a busy wait: a core that sleeps between steps comes back with cold
# caches and a low clock (measured on a 2-core VM: a 0.25 ms MLP step took 0.5-0.9 ms right after a sleep), which the
# slowdown would multiply again; a pause of a millisecond or less is busy-waited entirely.
_BUSY_WAIT_S = 0.001


def _pause(seconds: float) -> None:
    """Let ``seconds`` pass, sleeping all but the last millisecond."""
    deadline = time.perf_counter() + seconds
    if seconds > _BUSY_WAIT_S:
        time.sleep(seconds - _BUSY_WAIT_S)
    while time.perf_counter() < deadline:
        pass


def start_emulation(
    specs: Sequence[Optional[EmulationSpec]], rank: int, world_size: int, host: DeviceInfo, root_device: torch.device
) -> Optional[Emulator]:
    """This rank's emulator with its environment applied, or ``None`` when its entry is ``None``.

    Every rank must call it with the same ``specs`` (the NCCL link settings are derived from all of them).
    """
    if len(specs) != world_size:
        raise ValueError(f"`emulate` has {len(specs)} entries but the job has {world_size} ranks: give one per rank.")
    link = job_link_class(specs)
    hosts = emulates_hosts(specs)
    spec = specs[rank]
    if spec is None:
        if not hosts and (root_device.type != "cuda" or link == "nvlink"):
            return None
        spec = EmulationSpec(name=host.name, link=link)  # the real card, but on the job's emulated link / hosts
    device = resolve(spec, host, specs)
    if device.calibration.startswith("published ratio"):
        warnings.warn(f"Emulating {spec.preset} on {host.name}: {device.calibration} "
                      "(benchmarks/calibrate_presets.py measures one).")
    emulator = Emulator(device, root_device, link, hosts=hosts, inter_host_gbit=job_inter_host_gbit(specs))
    emulator.apply_env()
    return emulator


def lab_warning(strategy_name: str, device_type: str, summaries: Sequence[str]) -> str:
    """The rank-0 notice that the numbers come from an emulation, naming the running strategy and only what the
    emulation does on ``device_type`` ("cuda": green-context SM caps, memory caps, NCCL link classes; otherwise:
    pauses that slow each rank's CPU steps, the link between ranks not emulated).

    Example::
        >>> lab_warning("HeteroFSDPStrategy", "cpu", ["slowdown 3.00x, gloo (link not emulated)", "real device"])
    """
    if device_type == "cuda":
        how = ("SM shares are green-context caps on the host GPU (with a time dilation after each step where the "
               "calibration asks for one), memory a cap on its allocator, links NCCL's transport settings; NCCL "
               "kernels are not capped")
    else:
        how = ("a rank's slowdown is a pause of (slowdown - 1) x its step's CPU time; the link between ranks is not "
               "emulated")
    lines = [f"  rank {r}: {s}" for r, s in enumerate(summaries)]
    return (
        f"{strategy_name} is EMULATING a mixed lab on {device_type.upper()}: device names, memory and speed below are "
        f"imposed on the host device ({how}). Timings are not those of real cards.\n" + "\n".join(lines)
    )
