"""What the hetero collaborators read from the Lightning strategy that owns them: one small typed view.

Every collaborator of :class:`~lightning_hetero.strategies.core.HeteroCore` (the lab set-up, the share plan's
controller, the loader split, the step share, the resilience hooks) is handed the strategy as a :class:`StrategyView`,
so a reader (and a type checker) sees exactly which Lightning facts it uses. A Lightning ``ParallelStrategy`` satisfies
it as it is.

Example::

    def describe(view: StrategyView) -> str:
        return f"rank {view.global_rank} of {view.world_size} on {view.root_device}"
"""

from typing import Any, Callable, Optional, Protocol, runtime_checkable

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


@runtime_checkable
class ObservedStrategy(Protocol):
    """What this package's callbacks (the monitor, the non-finite check, the rehearsal) read from a heterogeneous
    strategy, through its face (``strategy.hetero``, :class:`~lightning_hetero.strategies.facade.HeteroFacade`). A
    callback calls :func:`observed` once and then reads typed members, instead of probing attribute names: a renamed
    member fails the type check and the test that every strategy's face satisfies this protocol, not a callback's
    feature silently. (Lightning's own strategies have no face: a callback then runs without what only ours
    provide.)"""

    @property
    def train_step_size(self) -> Optional[float]:
        """This rank's real samples (or token weight) in the current training batch."""

    @property
    def comm_bytes_last_step(self) -> Optional[int]:
        """Bytes this rank handed to the last optimizer step's gradient collectives (None: nothing counts them)."""

    @property
    def holds_partial_gradients(self) -> bool:
        """A rank holds some parameters' gradients only (a pipeline's stage): ranks agree before acting on them."""

    @property
    def pipeline_ranks(self) -> Optional[list[list[int]]]:
        """Each pipelined replica's ranks in stage order (None: no pipelines)."""

    @property
    def capacity_source(self) -> str:
        """Where the capacities in force came from."""

    @property
    def rebalancing(self) -> bool:
        """Whether the shares follow measured speeds during the fit."""

    @property
    def sharded(self) -> bool:
        """The model's parameters are sharded across ranks."""

    @property
    def emulation(self) -> Optional[Any]:
        """This rank's lab emulator (:class:`~lightning_hetero.lab.emulator.Emulator`), if any."""

    @property
    def memory_plan(self) -> Optional[list[Any]]:
        """Every rank's memory mode and estimate, where the strategy plans memory."""

    @property
    def owns_comm_hook(self) -> bool:
        """Whether the strategy registered a DDP comm hook of its own."""

    def attach_monitor(self, monitor: Any) -> None:
        """The monitor that times collectives issued inside a step (``None``: none)."""

    def observe_backward_end(self, observer: Callable[[], None], observe: bool = True) -> bool:
        """Call ``observer`` where a synchronizing backward ends; False: no hook to watch."""

    def observe_pipeline_stage(self, timer: Optional[Any]) -> bool:
        """Time this rank's pipeline steps with ``timer`` (``None``: stop); False: no stage here."""


@runtime_checkable
class HeteroStrategy(Protocol):
    """A strategy of this package: it owns its public face, ``hetero``."""

    @property
    def hetero(self) -> ObservedStrategy: ...


def observed(strategy: object) -> Optional[ObservedStrategy]:
    """``strategy``'s face (``strategy.hetero``) as an :class:`ObservedStrategy`, or ``None`` (a Lightning strategy
    of its own).

        >>> hetero = observed(trainer.strategy)
        >>> samples = hetero.train_step_size if hetero is not None else None
    """
    if not isinstance(strategy, HeteroStrategy):
        return None
    face = strategy.hetero
    return face if isinstance(face, ObservedStrategy) else None


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
