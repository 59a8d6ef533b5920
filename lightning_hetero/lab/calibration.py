"""Measured calibration of the presets on a host GPU: which SM count and time dilation make it train like a card.

A green context with a fraction of the SMs does not train at that fraction of the speed (small kernels keep a slice
busy, memory bandwidth is shared), so the SM count of a preset comes from a *measured* curve: the step speed of
each workload family at each green-context SM count, relative to the whole GPU (``benchmarks/calibrate_presets.py
sweep``). The host is treated as an H100 (an H200 is one with more memory bandwidth): the target speed of preset
``p`` on workload ``w`` relative to the host is ``R(p, w) / R(H100, w)`` (:mod:`lightning_hetero.lab.cards`). One SM
count cannot hit the three workloads at once, and a slice is often too fast, so each preset also gets a *dilation*
``d >= 1``: the GPU idles ``(d - 1) x`` each step's compute time (:mod:`lightning_hetero.lab.dilation`).

File format (JSON; one per host GPU kind, shipped as ``lightning_hetero/lab/calibrations/<kind>.json``, or the file
that ``LIGHTNING_HETERO_CALIBRATION`` names)::

    {"host": "NVIDIA H200", "host_sms": 132,
     "curves": {"bert": {"8": 0.11, ..., "132": 1.0}, "resnet": {...}, "gpt": {...}},
     "presets": {"RTX3090": {"sms": 40, "default": 1.12, "bert": 1.05, "resnet": 1.0, "gpt": 1.2,
                             "worst_error": 0.08}, ...}}

Example::
    >>> table = load_calibration(host_name="NVIDIA H200")
    >>> table.knob("RTX3090", "bert") if table else None   # (SM count, dilation)
"""

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_hetero.lab.cards import PUBLISHED, WORKLOADS, training_speed
from lightning_hetero.lab.devices import match_name

CALIBRATION_ENV = "LIGHTNING_HETERO_CALIBRATION"
_PACKAGE_DIR = Path(__file__).with_name("calibrations")  # not "calibration": that is this module
# Host GPU kinds with a shipped calibration file, matched by device-name substring.
HOST_KINDS: dict[str, str] = {"H200": "h200.json"}
HOST_STAND_IN = "H100"  # the preset whose published speed the host's full GPU is taken to have
_FIT_TOLERANCE = 0.02  # |log error| within which two SM counts fit equally well


@dataclass(frozen=True)
class PresetKnob:
    """One preset's fitted knob: SM count, dilation for each workload and by default, the default's worst error."""

    sms: int
    default: float
    per_workload: tuple[tuple[str, float], ...]
    worst_error: float  # max |log(emulated / target)| over the workloads with the default dilation

    def dilation(self, workload: Optional[str]) -> float:
        return dict(self.per_workload).get(workload, self.default) if workload else self.default


@dataclass(frozen=True)
class Calibration:
    """A host's measured curves and the presets' fitted knobs (see the module docstring for the file format)."""

    host: str
    host_sms: int
    curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...]
    presets: tuple[tuple[str, PresetKnob], ...]
    path: str = ""  # where it was read from (for the summary)

    def knob(self, preset: str, workload: Optional[str] = None) -> tuple[int, float]:
        """``(SM count, dilation)`` of ``preset`` on ``workload`` (``None``: the default dilation)."""
        knobs = dict(self.presets)
        if preset not in knobs:
            raise ValueError(f"calibration {self.path or self.host!r} has no preset {preset!r}; "
                             f"it has {sorted(knobs)}.")
        entry = knobs[preset]
        return entry.sms, entry.dilation(workload)

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "host_sms": self.host_sms,
            "curves": {w: {str(s): v for s, v in points} for w, points in self.curves},
            "presets": {p: {"sms": k.sms, "default": k.default, **dict(k.per_workload), "worst_error": k.worst_error}
                        for p, k in self.presets},
        }


def parse_calibration(raw: Mapping[str, Any], where: str = "calibration") -> Calibration:
    """Validate a calibration dict; ``ValueError`` naming the field otherwise."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"`{where}` must be a JSON object with 'host', 'host_sms', 'curves' and 'presets'.")
    for key in ("host", "host_sms", "curves", "presets"):
        if key not in raw:
            raise ValueError(f"`{where}` lacks `{key}`.")
    host_sms = raw["host_sms"]
    if isinstance(host_sms, bool) or not isinstance(host_sms, int) or host_sms <= 0:
        raise ValueError(f"`{where}.host_sms`={host_sms!r} must be a positive integer.")
    curves = []
    for workload, points in _mapping(raw["curves"], f"{where}.curves").items():
        if workload not in WORKLOADS:
            raise ValueError(f"`{where}.curves.{workload}` is not a workload; known: {WORKLOADS}.")
        parsed = sorted((_int(s, f"{where}.curves.{workload}"), _positive(v, f"{where}.curves.{workload}.{s}"))
                        for s, v in _mapping(points, f"{where}.curves.{workload}").items())
        curves.append((workload, tuple(parsed)))
    presets = []
    for preset, entry in _mapping(raw["presets"], f"{where}.presets").items():
        at = f"{where}.presets.{preset}"
        if preset not in PUBLISHED:
            raise ValueError(f"`{at}` is not a preset; known: {sorted(PUBLISHED)}.")
        entry = _mapping(entry, at)
        sms = _int(entry.get("sms"), f"{at}.sms")
        if not 0 < sms <= host_sms:
            raise ValueError(f"`{at}.sms`={sms} must be between 1 and host_sms={host_sms}.")
        dilations = {w: _dilation(entry[w], f"{at}.{w}") for w in WORKLOADS if w in entry}
        presets.append((preset, PresetKnob(sms=sms, default=_dilation(entry.get("default"), f"{at}.default"),
                                           per_workload=tuple(dilations.items()),
                                           worst_error=float(entry.get("worst_error", float("nan"))))))
    return Calibration(host=str(raw["host"]), host_sms=host_sms, curves=tuple(curves), presets=tuple(presets))


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"`{where}`={value!r} must be a JSON object.")
    return value


def _int(value: Any, where: str) -> int:
    try:
        parsed = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{where}`: {value!r} must be an SM count (an integer).") from None
    if isinstance(value, bool) or str(parsed) != str(value).strip():
        raise ValueError(f"`{where}`: {value!r} must be an SM count (an integer).")
    return parsed


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{where}`={value!r} must be a positive number.")
    return float(value)


def _dilation(value: Any, where: str) -> float:
    parsed = _positive(value, where)
    if parsed < 1.0:
        raise ValueError(f"`{where}`={value!r} must be a dilation >= 1 (a card is never made faster).")
    return parsed


def calibration_path(host_name: str) -> Optional[Path]:
    """The calibration file for a host GPU: ``LIGHTNING_HETERO_CALIBRATION`` if set, else the shipped file of its
    kind, else ``None``."""
    override = os.environ.get(CALIBRATION_ENV)
    if override:
        return Path(override)
    kind = match_name(host_name, HOST_KINDS)
    if kind is None:
        return None
    path = _PACKAGE_DIR / HOST_KINDS[kind]
    return path if path.is_file() else None


def load_calibration(host_name: str) -> Optional[Calibration]:
    """The calibration for a host GPU (see :func:`calibration_path`), or ``None`` when there is none."""
    path = calibration_path(host_name)
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{CALIBRATION_ENV} / calibration file {str(path)!r} cannot be read: {err}") from None
    table = parse_calibration(raw, where=str(path))
    return Calibration(table.host, table.host_sms, table.curves, table.presets, path=str(path))


def target_speed(preset: str, workload: str) -> float:
    """The speed ``preset`` should have on ``workload`` relative to the whole host GPU (taken to be an H100)."""
    return training_speed(preset, workload) / training_speed(HOST_STAND_IN, workload)


def fit_knob(curves: Mapping[str, Mapping[int, float]], targets: Mapping[str, float]) -> PresetKnob:
    """The SM count and dilation that bring the curves nearest the targets (speeds relative to the whole GPU).

    For each SM count measured on every workload: with ``r_w = log(curve_w / target_w)``, a dilation ``d`` makes the
    error ``r_w - log d``; the worst ``|error|`` is least at ``log d = (max r + min r) / 2``, kept ``>= 0`` (a card is
    never sped up). Among the SM counts within 2 % of the least worst error, the one needing the least dilation wins.
    The per-workload dilations make each workload exact at that SM count where the slice is fast enough.

    Example::
        >>> fit_knob({"bert": {8: 0.1, 16: 0.3, 132: 1.0}}, {"bert": 0.25}).sms
        16
    """
    workloads = sorted(targets)
    common = set.intersection(*(set(curves[w]) for w in workloads))
    if not common:
        raise ValueError(f"the curves share no SM count over {workloads}: sweep every workload at the same counts.")
    fits = []
    for sms in sorted(common):
        r = [math.log(curves[w][sms] / targets[w]) for w in workloads]
        log_d = max(0.0, (max(r) + min(r)) / 2)
        fits.append((max(abs(x - log_d) for x in r), sms, log_d))
    least = min(f[0] for f in fits)
    # Within a hair of the best fit, the smallest dilation: the less a step idles, the more its compute overlaps
    # communication as a real card's does.
    worst, sms, log_d = min((f for f in fits if f[0] <= least + _FIT_TOLERANCE), key=lambda f: (f[2], -f[1]))
    per = tuple((w, max(1.0, curves[w][sms] / targets[w])) for w in workloads)
    return PresetKnob(sms=sms, default=math.exp(log_d), per_workload=per, worst_error=worst)


def fit_calibration(host: str, host_sms: int, curves: Mapping[str, Mapping[int, float]],
                    presets: Sequence[str] = tuple(PUBLISHED)) -> Calibration:
    """Fit every preset on the measured ``curves`` (workload -> SM count -> speed relative to the whole GPU)."""
    workloads = [w for w in WORKLOADS if w in curves]
    if not workloads:
        raise ValueError(f"`curves` has no workload of {WORKLOADS}.")
    knobs = tuple((p, fit_knob(curves, {w: target_speed(p, w) for w in workloads})) for p in presets)
    points = tuple((w, tuple(sorted((int(s), float(v)) for s, v in curves[w].items()))) for w in workloads)
    return Calibration(host=host, host_sms=host_sms, curves=points, presets=knobs)
