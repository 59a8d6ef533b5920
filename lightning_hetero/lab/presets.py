"""The cards ``emulate=[...]`` accepts by name, and the link classes an emulated lab can have.

Example::
    >>> PRESETS["RTX3090"].memory_gib
    24
"""

from dataclasses import dataclass
from typing import Literal

LinkClass = Literal["nvlink", "pcie", "ethernet"]
# Fastest first.
LINK_CLASSES: tuple[str, ...] = ("nvlink", "pcie", "ethernet")


@dataclass(frozen=True)
class Preset:
    """A card to emulate: its reported name (a key of :data:`~lightning_hetero.lab.devices.PEAK_TFLOPS` must be part of
    it), memory, capability and link class."""

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
