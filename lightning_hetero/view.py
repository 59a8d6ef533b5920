"""What the hetero collaborators read from the Lightning strategy that owns them: one small typed view.

Every collaborator of :class:`~lightning_hetero.strategies.core.HeteroCore` (the lab set-up, the share plan's
controller, the loader split, the step share, the resilience hooks) is handed the strategy as a :class:`StrategyView`,
so a reader (and a type checker) sees exactly which Lightning facts it uses. A Lightning ``ParallelStrategy`` satisfies
it as it is.

Example::

    def describe(view: StrategyView) -> str:
        return f"rank {view.global_rank} of {view.world_size} on {view.root_device}"
"""

from typing import Any, Optional, Protocol

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer


class StrategyView(Protocol):
    """The Lightning strategy as the collaborators see it (ranks, device, module, precision, optimizers)."""

    # Set by the precision set-up (grad/precision.py::RankPrecision) when a policy installs per-rank precision.
    precision_plugin: Precision

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]: ...

    @property
    def cluster_environment(self) -> Optional[ClusterEnvironment]: ...

    @property
    def lightning_module(self) -> Optional[LightningModule]: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    def set_world_ranks(self) -> None: ...

    def training_step(self, *args: Any, **kwargs: Any) -> Any: ...


# The running strategy's name, for messages from the modules both strategies share (set in
# HeteroLifecycle.setup_environment, on every rank; one strategy sets up per process).
_running = ""


def name_running_strategy(strategy: object) -> None:
    """Remember ``strategy``'s class as the one this process runs (one strategy sets up per process)."""
    global _running
    _running = type(strategy).__name__


def running_strategy() -> str:
    """The class name of the strategy set up in this process (``"lightning_hetero"`` before any is)."""
    return _running or "lightning_hetero"
