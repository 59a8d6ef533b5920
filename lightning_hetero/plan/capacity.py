"""Where each rank's capacity (its relative training speed) comes from.

``capacities`` on the strategy is one of:

- a list of positive numbers, one per global rank: ``[3, 1]``;
- a mapping from a device-name substring to a weight: ``{"A100": 3.0, "3090": 1.0}`` (``"*"`` matches any device;
  the longest matching key wins; ``"rank:N"`` names one rank; see :class:`~lightning_hetero.rules.RankRules`);
- ``"equal"``; ``"peak"`` (published end-to-end training speed, :mod:`lightning_hetero.lab.cards`);
  ``"peak_tflops"`` (published dense tensor rate, :mod:`lightning_hetero.lab.devices`: ranks cards badly for
  training, kept by name for comparison);
- ``"profile"`` (time the user's own model on every rank before training);
- ``"auto"``: ``"profile"`` when fitting, else ``"peak"`` on GPUs whose cards are all known, else ``"equal"``.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from lightning_hetero.lab.cards import device_speed
from lightning_hetero.lab.devices import DeviceInfo, peak_tflops
from lightning_hetero.rules import RankRules
from lightning_hetero.plan.split import validate_weights

CapacitiesArg = Union[str, Sequence[float], Mapping[str, float]]
CAPACITY_SOURCES = ("auto", "equal", "peak", "peak_tflops", "profile")


@dataclass(frozen=True)
class CapacitySpec:
    """A validated ``capacities`` argument."""

    source: str  # "list", "mapping", or one of CAPACITY_SOURCES
    weights: tuple[float, ...] = ()
    mapping: tuple[tuple[str, float], ...] = ()

    @property
    def rules(self) -> RankRules[float]:
        return RankRules("capacities", self.mapping)


def parse_capacities(value: CapacitiesArg) -> CapacitySpec:
    """Validate the ``capacities`` argument at construction time; ``ValueError`` naming it otherwise."""
    if isinstance(value, str):
        if value not in CAPACITY_SOURCES:
            raise ValueError(f"`capacities`={value!r} is not one of {CAPACITY_SOURCES}, a list or a mapping.")
        return CapacitySpec(source=value)
    if isinstance(value, Mapping):
        rules = RankRules.parse("capacities", value,
                                lambda key, weight: validate_weights([weight], f"capacities[{key!r}]")[0])
        return CapacitySpec(source="mapping", mapping=rules.rules)
    if isinstance(value, Sequence):
        return CapacitySpec(source="list", weights=tuple(validate_weights(value, "capacities")))
    raise ValueError(f"`capacities`={value!r} must be a list, a mapping or one of {CAPACITY_SOURCES}.")


def peak_capacities(devices: Sequence[DeviceInfo], dtype: torch.dtype, source: str = "peak") -> Optional[list[float]]:
    """Published speeds for every rank (``source`` "peak": training speed; "peak_tflops": dense tensor rate for
    ``dtype``), or ``None`` when some rank's is unknown (CPU ranks)."""
    rates = [peak_tflops(d, dtype) if source == "peak_tflops" else device_speed(d) for d in devices]
    if any(r is None or not math.isfinite(r) or r <= 0 for r in rates):
        return None
    return [float(r) for r in rates]  # type: ignore[arg-type]


def resolve_static_capacities(
    spec: CapacitySpec, devices: Sequence[DeviceInfo], dtype: torch.dtype
) -> tuple[list[float], str]:
    """Weights that need no measurement, and a word for the table saying where they came from.

    ``"profile"`` and ``"auto"`` resolve here to their fallback; the strategy replaces them with measured
    throughput when it can profile.
    """
    world = len(devices)
    if spec.source == "list":
        if len(spec.weights) != world:
            raise ValueError(
                f"`capacities` has {len(spec.weights)} weights but the job has {world} ranks: give one per rank."
            )
        return list(spec.weights), "explicit"
    if spec.source == "mapping":
        return [spec.rules.for_device(d) for d in devices], "mapping"
    if spec.source == "equal":
        return [1.0] * world, "equal"
    if spec.source == "peak_tflops":
        tflops = peak_capacities(devices, dtype, "peak_tflops")
        if tflops is None:
            unknown = sorted({d.name for d in devices if peak_tflops(d, dtype) is None})
            raise ValueError(f"`capacities`='peak_tflops' has no published rate for {unknown}; use 'profile', 'equal' "
                             "or explicit weights.")
        return tflops, "peak_tflops"
    peak = peak_capacities(devices, dtype)
    if spec.source == "peak":
        if peak is None:
            unknown = sorted({d.name for d in devices if device_speed(d) is None})
            raise ValueError(
                f"`capacities`='peak' has no published rate for {unknown}; use 'profile', 'equal' or explicit weights."
            )
        return peak, "peak"
    # "auto" / "profile" before (or without) measurement
    if peak is not None:
        return peak, "peak"
    return [1.0] * world, "equal"
