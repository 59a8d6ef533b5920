"""The contract of docs/development.md ("Adding a strategy"), followed by a fourth strategy written here: one class
and one registry line. It registers with Lightning under its name and trains with unequal batches as one process
does on the global batch."""

import copy
from typing import Any, Callable, Literal, Optional

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, StrategyRegistry
from torch import Tensor

import lightning_hetero.registry as registry
from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy, HeteroHybridStrategy
from lightning_hetero.config import Observation, Resilience, from_flat_arguments
from lightning_hetero.grad.weighting import loss_weight
from lightning_hetero.registry import StrategyEntry
from lightning_hetero.strategies.arguments import parallel_arguments
from lightning_hetero.strategies.core import core_from_arguments
from lightning_hetero.strategies.facade import HeteroFacade
from lightning_hetero.strategies.lifecycle import HeteroLifecycle
from tests.helpers import TinyModel, fit_distributed, max_rel_diff, reference_run


class HeteroSummedStrategy(HeteroLifecycle):
    """Data parallel without DDP's wrapper: each rank's loss weighted b_r / G, the gradients summed over the ranks
    once, after the backward, before the optimizer step.

    Args:
        capacities: relative speed of each rank (as for the other strategies).
        resilience: fault timeout and the rest (:class:`~lightning_hetero.config.Resilience`).
        observation: the lab table (:class:`~lightning_hetero.config.Observation`).
        start_method: ``"popen"``, ``"spawn"``, ``"fork"``.
    """

    strategy_name = "hetero_summed"

    def __init__(self, capacities: Any = "auto", resilience: Optional[Resilience] = None,
                 observation: Optional[Observation] = None,
                 start_method: Literal["popen", "spawn", "fork"] = "popen") -> None:
        options = from_flat_arguments(None, False, None, resilience, observation, flat={})
        super().__init__(**parallel_arguments(options, start_method, None, None, None, None, None, None))
        self.core = core_from_arguments(self, capacities, None, options, None, None, None)
        self.hetero = HeteroFacade(self)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no wrapper: the gradients are summed in `optimizer_step`

    def _register_ddp_hooks(self) -> None:
        pass

    def weigh_loss(self, loss: Tensor) -> Tensor:
        share = self.core.step.share
        return loss if share is None else loss * loss_weight(share[0], share[1], world_size=1)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def summed() -> Any:
            out = closure()
            for param in self.lightning_module.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
            return out

        return super().optimizer_step(optimizer, summed, model, **kwargs)


ENTRY = StrategyEntry("hetero_summed", f"{__name__}.HeteroSummedStrategy", "Summed gradients, no wrapper")


@pytest.fixture
def registered(monkeypatch):
    """The strategy's one registry line, registered with Lightning as the package registers its own."""
    monkeypatch.setattr(registry, "STRATEGIES", (*registry.STRATEGIES, ENTRY))
    HeteroSummedStrategy.register_strategies(StrategyRegistry)
    yield
    for name, _ in ENTRY.variants():
        StrategyRegistry.remove(name)


def test_it_registers_under_its_name(registered):
    assert StrategyRegistry["hetero_summed_fork"]["strategy"] is HeteroSummedStrategy
    trainer = Trainer(accelerator="cpu", devices=2, strategy="hetero_summed_spawn", logger=False)
    assert isinstance(trainer.strategy, HeteroSummedStrategy) and trainer.strategy._start_method == "spawn"


@pytest.mark.parametrize("cls", [HeteroDDPStrategy, HeteroFSDPStrategy, HeteroHybridStrategy, HeteroSummedStrategy])
def test_every_strategy_is_one_chain_of_single_inheritance(cls):
    """No mixins: each class of the package in a strategy's chain has one base, and the chain ends in Lightning's
    DDPStrategy (what Lightning's own `isinstance` checks look for)."""
    ours = [c for c in cls.__mro__ if c.__module__.startswith(("lightning_hetero", __name__))]
    assert ours[-1] is HeteroLifecycle and all(len(c.__bases__) == 1 for c in ours), [c.__bases__ for c in ours]
    assert issubclass(cls, DDPStrategy) and issubclass(cls, ParallelStrategy)


@pytest.mark.slow
def test_it_trains_as_one_process(tmp_path):
    capacities, epochs = [3, 1, 2], 2
    seed_everything(0)
    model = TinyModel("adam", n=53, batch_size=4)
    reference = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), len(capacities), {"capacities": capacities}, max_epochs=epochs,
                              strategy_class=HeteroSummedStrategy)
    ref_params, ref_batches = reference_run(reference, len(capacities), capacities, epochs)
    assert {r["steps"] for r in records} == {len(ref_params)}
    for step, expected in enumerate(ref_params):
        assert sorted(i for r in records for i in r["indices"][step]) == sorted(ref_batches[step])
        assert max_rel_diff(records[0]["params"][step], expected) <= 2e-6, step
