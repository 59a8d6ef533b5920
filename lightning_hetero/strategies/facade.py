"""The public, read-only face of a heterogeneous strategy: what users, callbacks and tools read from it.

Each strategy owns one :class:`HeteroFacade` as ``strategy.hetero``: it reads the strategy's
:class:`~lightning_hetero.strategies.core.HeteroCore` and its gradient exchange, and overrides nothing of
Lightning's. It satisfies :class:`~lightning_hetero.view.ObservedStrategy`, the protocol this package's callbacks
(the monitor, the non-finite check, the rehearsal) read through :func:`~lightning_hetero.view.observed` instead of
probing attribute names; a strategy whose parallelism has more to say (a comm hook, a memory plan, a pipeline stage
to time) gives its own small subclass in its module.

Example::

    hetero = observed(trainer.strategy)   # trainer.strategy.hetero, or None for Lightning's own strategies
    if hetero is not None:
        print(hetero.capacity_source, hetero.train_step_size)
"""

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar, overload

from lightning_hetero.data.sampler import HeteroBatchSampler
from lightning_hetero.grad.exchange import GradExchange
from lightning_hetero.lab.emulator import Emulator
from lightning_hetero.lab.groups import HeteroLab, LabGroups
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.plan.shares import SharePlan
from lightning_hetero.strategies.core import HeteroCore


T = TypeVar("T")


class FacadeOwner(Protocol):
    """What the façade reads from its strategy: the core, and the exchange (the hybrid's is built at set-up)."""

    core: HeteroCore
    exchange: GradExchange


class HeteroFacade:
    """Read-only views of the core, and the defaults of :class:`~lightning_hetero.view.ObservedStrategy`.

    Example::

        strategy.hetero.plan.split, strategy.hetero.lab.devices
    """

    # Each rank holds every parameter's gradient after the exchange (a pipeline's stage rank: its stage's alone).
    holds_partial_gradients: bool = False
    owner: FacadeOwner

    def __init__(self, owner: FacadeOwner) -> None:
        self.owner = owner

    @property
    def core(self) -> HeteroCore:
        return self.owner.core

    @property
    def lab(self) -> HeteroLab:
        """Ranks, devices and groups of this job (available after setup)."""
        return self.core.lab.lab

    @property
    def plan(self) -> SharePlan:
        """Capacities (and where they came from), memory caps, the split of the global batch and its changes."""
        return self.core.plan

    @property
    def groups(self) -> LabGroups:
        """This rank's process groups: by device class, by host, and the leaders across them."""
        return self.core.lab.groups

    @property
    def train_batch_sampler(self) -> Optional[HeteroBatchSampler]:
        return self.core.loaders.train_sampler

    @property
    def emulation(self) -> Optional[Emulator]:
        """This rank's lab emulator (``None`` unless ``emulate`` gave it a profile)."""
        return self.core.lab.emulation

    @property
    def share_controller(self) -> ShareController:
        """Rebalancing decisions and the profiling record (the checkpointed share state is ``core.share_state``)."""
        return self.core.shares

    @property
    def capacity_source(self) -> str:
        """Where the capacities in force came from (``"peak"``, ``"profile"``, ...)."""
        return self.core.plan.source

    @property
    def rebalancing(self) -> bool:
        """Whether the shares follow measured speeds during the fit."""
        return self.core.shares.rebalance

    @property
    def sharded(self) -> bool:
        """The model's parameters are sharded across ranks: its forward and backward issue collectives, and the
        options a sharded strategy refuses (``config.sharded_refusals``) are refused."""
        return self.core.sharded

    @property
    def memory_plan(self) -> Optional[list[Any]]:
        """Every rank's memory mode and estimate, where the strategy plans memory (the sharded one), after set-up."""
        return None

    @property
    def train_step_size(self) -> Optional[float]:
        """This rank's real samples (or token weight) in the current training batch."""
        return self.core.step.train_step_size()

    @property
    def comm_bytes_last_step(self) -> Optional[int]:
        """Bytes this rank handed to the last optimizer step's gradient collectives (None: nothing counts them)."""
        return self.owner.exchange.bytes_last_step

    @property
    def owns_comm_hook(self) -> bool:
        """Whether the strategy registered a DDP comm hook of its own (a profiler must not replace it)."""
        return False

    @property
    def pipeline_ranks(self) -> Optional[list[list[int]]]:
        """Each pipelined replica's ranks in stage order (None: no pipelines in this layout)."""
        return None

    def update_capacities(self, capacities: Sequence[float], source: str,
                          split: Optional[Sequence[int]] = None) -> None:
        """Adopt new capacities from the next global batch the training loader draws (call it on every rank at the
        same batch). ``split`` is derived by the plan (accepted, not needed)."""
        sampler, plan = self.core.loaders.train_sampler, self.core.plan
        if sampler is None or plan.schedule is None:
            plan.adopt(capacities, source, caps=plan.caps)
            return
        # Past the batches already drawn (their gradient weights are read off the split that cut them).
        first_batch = max(sampler.batches_yielded, plan.schedule.latest.first_batch)
        plan.adopt(capacities, source, caps=plan.caps, first_batch=first_batch, epoch=sampler.sampler.epoch)

    def add_lab_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        """Extra per-rank columns for the lab table (e.g. measured samples/s, memory caps)."""
        self.core.lab.add_columns(columns)

    def attach_monitor(self, monitor: Any) -> None:
        """The monitor that times collectives issued inside a step (``None``: none)."""
        self.core.step.monitor = monitor

    def observe_backward_end(self, observer: Callable[[], None], observe: bool = True) -> bool:
        """Call ``observer`` where a synchronizing backward ends, from the gradient hook; False: no hook to watch."""
        return False

    def observe_pipeline_stage(self, timer: Optional[Any]) -> bool:
        """Time this rank's pipeline steps with the monitor's ``timer`` (``None``: stop); False: no stage here."""
        return False


class FromFacade(Generic[T]):
    """A strategy attribute that reads the same name off its façade (``strategy.hetero``): the public names the docs
    give on the strategy itself (``strategy.plan``, ``strategy.lab`` ...).

    Example::

        class HeteroLifecycle(DDPStrategy):
            plan: FromFacade[SharePlan] = FromFacade()   # strategy.plan is strategy.hetero.plan
    """

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, strategy: None, owner: type) -> "FromFacade[T]": ...

    @overload
    def __get__(self, strategy: "Faced", owner: type) -> T: ...

    def __get__(self, strategy: Optional["Faced"], owner: type) -> Any:
        return self if strategy is None else getattr(strategy.hetero, self.name)


class Faced(Protocol):
    """A strategy that owns a façade."""

    hetero: HeteroFacade
