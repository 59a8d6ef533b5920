"""What a profile means on the host device: an :class:`EmulatedDevice` (green-context SM count, time dilation, memory
cap, reported name, capability, link, CPU slowdown), and the same card throttled mid-run.

Presets are calibrated by *measurement* (:mod:`lightning_hetero.lab.calibration`): the host GPU's calibration file
gives each preset an SM count and a time dilation (the GPU idles ``(d - 1) x`` each step's compute time, see
:mod:`lightning_hetero.lab.dilation`) that make the host train like the card, per workload family (profile key
``"workload"``: ``"bert"``, ``"resnet"`` or ``"gpt"``; else the default fit). Targets are published training speeds
(:mod:`lightning_hetero.lab.cards`). A host without a calibration file gets the published speed ratio as its SM share
(a warning says so); ``{"preset": ..., "calibration": "peak_tflops"}`` keeps the old share of dense bf16 rates. SM
counts are rounded to the green-context granularity (multiples of 8 on compute capability 9.x); a card slower than
one granule is clamped up to it, a card as fast as the host runs uncapped; the summary says so. On CPU, presets
calibrate to ``slowdown = fastest preset's rate / this preset's rate``.

Example::
    >>> h200 = describe_device(torch.device("cuda", 0), 0)
    >>> resolve(EmulationSpec(preset="RTX3090"), h200).num_sms, throttled(resolve(EmulationSpec(), h200), 2.0).num_sms
    (32, 64)
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch

from lightning_hetero.lab.calibration import HOST_KINDS, HOST_STAND_IN, load_calibration
from lightning_hetero.lab.cards import card_of, device_speed, training_speed
from lightning_hetero.lab.devices import DeviceInfo, match_name, peak_tflops
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.presets import PRESETS, LinkClass, preset_tflops

EMULATED_SUFFIX = " (emulated)"


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


def sm_granularity(capability: tuple[int, int]) -> tuple[int, int]:
    """(minimum, step) of a green context's SM count: CUDA splits SMs in groups of 8 on 9.x and newer, of 2 before."""
    return (8, 8) if capability >= (9, 0) else (4, 2) if capability >= (8, 0) else (2, 2)


def round_sms(wanted: float, total: int, capability: tuple[int, int]) -> Optional[int]:
    """The green-context SM count closest to ``wanted``; ``None`` when that is the whole device."""
    minimum, step = sm_granularity(capability)
    count = max(minimum, int(math.floor(wanted / step + 0.5)) * step)
    return None if count >= total else count


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
