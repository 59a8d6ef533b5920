"""The cards ``emulate=[...]`` accepts by name (:data:`PRESETS`) and the link classes an emulated job runs on.

Each preset is a reported device name (its published speeds are in :mod:`lightning_hetero.lab.cards`), memory,
compute capability and the class of link such a card usually sits on.

Example::
    >>> PRESETS["RTX3090"].memory_gib, preset_tflops(PRESETS["RTX3090"])
    (24, 35.6)
"""

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_hetero.lab.devices import DeviceInfo, peak_tflops

LinkClass = Literal["nvlink", "pcie", "ethernet"]
LINK_CLASSES: tuple[str, ...] = ("nvlink", "pcie", "ethernet")  # fastest first


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


def preset_tflops(preset: Preset) -> float:
    """The rate a preset is calibrated by: its dense bf16 rate, its fp16 rate on cards without bf16."""
    info = DeviceInfo(rank=0, host="", type="cuda", name=preset.name, capability=preset.capability,
                      memory_bytes=int(preset.memory_gib * 2**30), multiprocessors=0)
    rate = peak_tflops(info, torch.bfloat16)
    assert rate is not None and rate > 0, preset
    return rate
