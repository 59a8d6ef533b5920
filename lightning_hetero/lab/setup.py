"""The lab set-up of one strategy: emulation, the process group, every rank's device, groups, precision.

:class:`LabSetup` is owned by :class:`~lightning_hetero.strategies.core.HeteroCore`; it reads the Lightning strategy
through a :class:`~lightning_hetero.view.StrategyView` and holds the lab's device facts (:class:`HeteroLab`), its
process groups and this rank's emulator.

Example::

    setup = LabSetup(view, options, emulate=None, precision_policy=None)
    setup.before_process_group(); ...; devices = setup.gather()
"""

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lightning_hetero._compat as _compat
from lightning_hetero.config import Options
from lightning_hetero.grad.precision import (
    PrecisionPolicy,
    apply_tf32,
    build_precision_plugin,
    check_no_conflict,
    job_compute_dtype,
    precision_column,
    resolve_precisions,
)
from lightning_hetero.lab.devices import DeviceInfo, describe_device
from lightning_hetero.lab.emulation import EmulationSpec, Emulator, LinkPacer, lab_warning, start_emulation
from lightning_hetero.lab.rehearsal import lab_devices, rehearsal, rehearsed_summaries
from lightning_hetero.lab.groups import HeteroLab, LabGroups, build_groups, gather_devices
from lightning_hetero.resilience.faults import rendezvous
from lightning_hetero.view import StrategyView


class LabSetup:
    """This job's lab: devices and groups (after the process group exists), this rank's emulator, precision."""

    def __init__(self, view: StrategyView, options: Options, emulate: Optional[list[Optional[EmulationSpec]]],
                 precision_policy: Optional[PrecisionPolicy]) -> None:
        self.view = view
        self.options = options
        self.emulate = emulate
        self.precision_policy = precision_policy
        self.emulation: Optional[Emulator] = None
        self.precision_modes: Optional[tuple[str, ...]] = None
        self.lab_: Optional[HeteroLab] = None
        self.groups_: Optional[LabGroups] = None
        self.table_printed = False

    @property
    def lab(self) -> HeteroLab:
        if self.lab_ is None:
            raise RuntimeError("the lab is described once the process group exists (after `Trainer.fit` starts).")
        return self.lab_

    @property
    def groups(self) -> LabGroups:
        if self.groups_ is None:
            raise RuntimeError("process groups are built once the process group exists.")
        return self.groups_

    def add_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        for name, values in columns.items():
            self.lab_ = self.lab.with_column(name, values)

    # -- process group ---------------------------------------------------------------------------------------------
    def before_process_group(self) -> None:
        """The emulator's environment (NCCL link class, host id) must exist before the process group does."""
        view = self.view
        if self.emulate is not None:
            view.set_world_ranks()
            host = describe_device(view.root_device, view.global_rank)
            self.emulation = start_emulation(self.emulate, view.global_rank, view.world_size, host, view.root_device)

    def init_process_group(self) -> None:
        """Lightning's set-up, through a rendezvous that names the ranks (nodes) that did not join in time."""
        view = self.view
        reset_seed()
        rehearsed = rehearsal()
        if rehearsed is not None:
            # One rank of a lab that is not here: no rendezvous, collectives stood in for (see `lab.rehearsal`).
            _compat.init_rehearsal_process_group(view, rehearsed.rank, rehearsed.world_size)
            return
        view.set_world_ranks()
        env = view.cluster_environment
        assert env is not None
        store = rendezvous(env.main_address, env.main_port, view.global_rank, view.world_size,
                           self.options.resilience.timeout, ranks_per_node=view.num_processes)
        _compat.init_process_group(view, store)

    def describe_local(self) -> DeviceInfo:
        """This rank's device (as emulated, if it is)."""
        if self.emulation is not None:
            self.emulation.activate()
        local = describe_device(self.view.root_device, self.view.global_rank)
        return self.emulation.describe(local) if self.emulation is not None else local

    def gather(self, local: DeviceInfo) -> tuple[DeviceInfo, ...]:
        """Every rank's device (a collective), and the per-rank precision they imply installed."""
        if rehearsal() is not None:
            devices = lab_devices(self.emulate, local, self.view.root_device)
        else:
            devices = gather_devices(local)
        self._install_precision(devices)
        return devices

    def build(self, devices: Sequence[DeviceInfo]) -> None:
        """The lab, its precision and emulation columns and its process groups (collectives)."""
        self.lab_ = HeteroLab(devices=tuple(devices))
        if self.precision_policy is not None and self.precision_modes is not None:
            self.add_columns({"precision": precision_column(self.precision_policy, devices, self.precision_modes)})
        self.groups_ = build_groups(self.lab_)
        if self.emulate is not None:
            summaries: list[Any] = [None] * self.view.world_size
            summary = self.emulation.summary() if self.emulation is not None else "real device"
            dist.all_gather_object(summaries, summary)
            if rehearsal() is not None:
                summaries = rehearsed_summaries(self.emulate, self.view.root_device)
            self.add_columns({"emulated": summaries})
            if self.view.global_rank == 0:
                rank_zero_warn(lab_warning(summaries))

    # -- precision -------------------------------------------------------------------------------------------------
    def _install_precision(self, devices: Sequence[DeviceInfo]) -> None:
        if self.precision_policy is None:
            return
        view = self.view
        check_no_conflict(self.precision_policy, view.precision_plugin)
        # Derived from the gathered devices, hence identical on every rank without another collective.
        self.precision_modes = resolve_precisions(self.precision_policy, devices)
        apply_tf32(self.precision_policy, devices[view.global_rank])
        view.precision_plugin = build_precision_plugin(
            self.precision_policy, self.precision_modes, view.global_rank, view.root_device.type
        )

    def compute_dtype(self) -> torch.dtype:
        """The dtype this rank's matmuls run in, for the published-rate table."""
        if self.precision_modes is not None:
            # One dtype for all ranks: capacities must agree.
            return job_compute_dtype(self.precision_modes)
        precision = str(getattr(self.view.precision_plugin, "precision", "32-true"))
        if "bf16" in precision:
            return torch.bfloat16
        return torch.float16 if precision.startswith("16") else torch.float32

    # -- emulation -------------------------------------------------------------------------------------------------
    def link_pacer(self, participants: int) -> Optional[LinkPacer]:
        """The emulated inter-host link's pacing (only with emulated hosts and ``inter_host_gbit``)."""
        gbit = self.emulation.inter_host_gbit if self.emulation is not None else None
        if gbit is None or len(self.lab.hosts) < 2:
            return None
        return LinkPacer(gbit, participants, self.view.root_device)

    def emulated_work(self) -> Any:
        return self.emulation.work() if self.emulation is not None else nullcontext()

    def restore(self) -> None:
        if self.emulation is not None:
            self.emulation.restore()
