"""Rehearsal mode: this process is rank ``r`` of an ``N``-rank job whose other ranks do not exist.

``python -m lightning_hetero doctor --model CONFIG --lab ...`` starts one process per target card with
:data:`REHEARSE_ENV` set to ``"r/N"``. The strategy then joins torch's fake process group (every collective returns at
once with tensors of the right shapes) instead of a real one, and describes every rank as the lab's cards (the
``emulate`` presets resolved on this host), so the capacities, batch shares and memory plan it chooses are the ones
the real lab would choose, while its own step runs for real on the local device under that card's caps.

Example::

    os.environ[REHEARSE_ENV] = "1/3"  # rank 1 of a 3-card lab, set by the doctor in the rank's process
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch

from lightning_hetero.lab.devices import CAPABILITY_OVERRIDE_ENV, NAME_OVERRIDE_ENV, DeviceInfo, describe_device
from lightning_hetero.lab.emulated_device import resolve
from lightning_hetero.lab.emulation_env import job_link_class
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.emulator import Emulator

REHEARSE_ENV = "LIGHTNING_HETERO_REHEARSE"


@dataclass(frozen=True)
class Rehearsal:
    rank: int
    world_size: int


def rehearsal() -> Optional[Rehearsal]:
    """This process's rehearsal rank and world size, or ``None`` outside a rehearsal."""
    value = os.environ.get(REHEARSE_ENV)
    if not value:
        return None
    rank, _, world = value.partition("/")
    try:
        parsed = Rehearsal(int(rank), int(world))
    except ValueError:
        raise ValueError(f"`{REHEARSE_ENV}`={value!r} must be 'rank/world_size', e.g. '1/3'.") from None
    if not 0 <= parsed.rank < parsed.world_size:
        raise ValueError(f"`{REHEARSE_ENV}`={value!r}: the rank must lie in [0, world_size).")
    return parsed


def host_device(root_device: torch.device) -> DeviceInfo:
    """The local device as it really is (the emulator's name and capability overrides left out)."""
    saved = {key: os.environ.pop(key, None) for key in (NAME_OVERRIDE_ENV, CAPABILITY_OVERRIDE_ENV)}
    try:
        return describe_device(root_device, 0)
    finally:
        for key, value in saved.items():
            if value is not None:
                os.environ[key] = value


def lab_devices(specs: Optional[Sequence[Optional[EmulationSpec]]], local: DeviceInfo,
                root_device: torch.device) -> tuple[DeviceInfo, ...]:
    """Every rank's device as the lab's cards: what :func:`~lightning_hetero.lab.groups.gather_devices` would
    gather if each target card ran its own rank (the emulator's description of rank ``i``'s preset on this host)."""
    world = rehearsal()
    assert world is not None
    if specs is None:
        return tuple(replace(local, rank=i) for i in range(world.world_size))
    host = host_device(root_device)
    link = job_link_class(specs)
    devices = []
    for i, spec in enumerate(specs):
        if spec is None:
            devices.append(replace(host, rank=i, host=local.host))
            continue
        emulated = resolve(spec, host, specs)
        info = replace(host, rank=i, host=local.host, name=emulated.name,
                       capability=emulated.capability or host.capability)
        devices.append(Emulator(emulated, root_device, link).describe(info))
    if devices[world.rank] != local:
        raise RuntimeError(f"rehearsal: rank {world.rank} describes itself as {local}, the lab as "
                           f"{devices[world.rank]}: the rehearsed plan would not be the lab's.")
    return tuple(devices)


def rehearsed_summaries(specs: Optional[Sequence[Optional[EmulationSpec]]], root_device: torch.device) -> list[str]:
    """Every rank's emulation summary for the lab table (what the gathered summaries would be)."""
    if specs is None:
        return []
    host = host_device(root_device)
    link = job_link_class(specs)
    return [Emulator(resolve(s, host, specs), root_device, link).summary() if s is not None else "real device"
            for s in specs]
