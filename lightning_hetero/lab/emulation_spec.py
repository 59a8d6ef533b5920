"""One rank's emulation profile as the user gives it (``emulate=[...]``): a preset name, a dict or ``None``,
validated into a frozen :class:`EmulationSpec` whose errors name the field.

Example::
    >>> parse_emulate(["A100-40GB", {"slowdown": 3}, None])
    (EmulationSpec(preset='A100-40GB', ...), EmulationSpec(..., slowdown=3.0, ...), None)
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_hetero.lab.cards import WORKLOADS
from lightning_hetero.lab.presets import LINK_CLASSES, PRESETS, LinkClass

EmulateArg = Optional[Sequence[Union[str, Mapping[str, Any], None]]]

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
