"""The lab set-up of one strategy: emulation, the process group, every rank's device, groups.

:class:`LabSetup` is owned by :class:`~lightning_hetero.strategies.core.HeteroCore`; it reads the Lightning strategy
through a :class:`~lightning_hetero.view.StrategyView` and holds the lab's device facts (:class:`HeteroLab`), its
process groups and this rank's emulator.

Example::

    setup = LabSetup(view, options, emulate=None)
    setup.before_process_group(); ...; devices = setup.gather(setup.describe_local()); setup.build(devices, {})
"""

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Optional

import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_hetero._compat as _compat
from lightning_hetero.config import Options
from lightning_hetero.lab.devices import DeviceInfo, describe_device
from lightning_hetero.lab.emulation import lab_warning, start_emulation
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.emulator import Emulator
from lightning_hetero.lab.rehearsal import lab_devices, rehearsal, rehearsed_summaries
from lightning_hetero.lab.groups import HeteroLab, LabGroups, build_groups, gather_devices
from lightning_hetero.lab.shared_gpu import binds_device
from lightning_hetero.lab.clean_exit import destroy_process_groups_at_exit
from lightning_hetero.lab.link_pacing import LinkPacer
from lightning_hetero.lab.rendezvous import rendezvous
from lightning_hetero.view import StrategyView


class LabSetup:
    """This job's lab: devices and groups (after the process group exists), this rank's emulator."""

    def __init__(self, view: StrategyView, options: Options, emulate: Optional[list[Optional[EmulationSpec]]]) -> None:
        self.view = view
        self.options = options
        self.emulate = emulate
        self.emulation: Optional[Emulator] = None
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
        # Ranks sharing one GPU leave it unbound: gloo's `new_group` fails on a bound device (see lab/shared_gpu.py).
        _compat.init_process_group(view, store, bind_device=binds_device(view.parallel_devices, view.root_device))
        destroy_process_groups_at_exit()

    def describe_local(self) -> DeviceInfo:
        """This rank's device (as emulated, if it is)."""
        if self.emulation is not None:
            self.emulation.activate()
        local = describe_device(self.view.root_device, self.view.global_rank)
        return self.emulation.describe(local) if self.emulation is not None else local

    def gather(self, local: DeviceInfo) -> tuple[DeviceInfo, ...]:
        """Every rank's device (a collective; in a rehearsal, the lab's cards)."""
        if rehearsal() is not None:
            return lab_devices(self.emulate, local, self.view.root_device)
        return gather_devices(local)

    def build(self, devices: Sequence[DeviceInfo], columns: Mapping[str, Sequence[Any]]) -> None:
        """The lab with ``columns`` (e.g. precision) and its emulation column, and its process groups (collectives)."""
        self.lab_ = HeteroLab(devices=tuple(devices))
        self.add_columns(columns)
        self.groups_ = build_groups(self.lab_)
        if self.emulate is not None:
            summaries: list[Any] = [None] * self.view.world_size
            summary = self.emulation.summary() if self.emulation is not None else "real device"
            dist.all_gather_object(summaries, summary)
            if rehearsal() is not None:
                summaries = rehearsed_summaries(self.emulate, self.view.root_device)
            self.add_columns({"emulated": summaries})
            if self.view.global_rank == 0:
                # Information, printed as the strategy's other notices are (a warning read as an error: `setup.py:115:`)
                rank_zero_info(lab_warning(type(self.view).__name__, self.view.root_device.type, summaries))

    # -- emulation -------------------------------------------------------------------------------------------------
    def link_pacer(self, participants: int) -> Optional[LinkPacer]:
        """The emulated inter-host link's pacing (only with emulated hosts and ``inter_host_gbit``)."""
        gbit = self.emulation.inter_host_gbit if self.emulation is not None else None
        if gbit is None or len(self.lab.hosts) < 2:
            return None
        return LinkPacer(gbit, participants, self.view.root_device)

    def emulated_work(self) -> Any:
        return self.emulation.work() if self.emulation is not None else nullcontext()

    def emulated_stream(self) -> Any:
        """The stream a step runs on, without the emulation's slowdown (a trial step's memory is measured there)."""
        return self.emulation.capped_stream() if self.emulation is not None else nullcontext()

    def restore(self) -> None:
        if self.emulation is not None:
            self.emulation.restore()
