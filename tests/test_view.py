"""The callbacks read a strategy through one typed protocol (:class:`~lightning_hetero.view.ObservedStrategy`), not
by probing attribute names: every strategy's face (``strategy.hetero``) satisfies it, and a renamed member fails
here."""

import ast
import pathlib

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy
from lightning_hetero.strategies.facade import HeteroFacade
from lightning_hetero.strategies.hybrid import HeteroHybridStrategy
from lightning_hetero.view import ObservedStrategy, observed

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lightning_hetero"
# The modules whose callbacks read the strategy.
CALLBACK_MODULES = ["observe/monitor.py", "grad/nonfinite.py", "rehearse/rank.py"]
MEMBERS = sorted(name for name in vars(ObservedStrategy) if not name.startswith("_"))


@pytest.mark.parametrize("make", [HeteroDDPStrategy, HeteroFSDPStrategy, lambda: HeteroHybridStrategy([[1, 2]])],
                         ids=["ddp", "fsdp", "hybrid"])
def test_every_strategy_is_observed(make):
    strategy = make()
    assert observed(strategy) is strategy.hetero
    assert isinstance(strategy.hetero, ObservedStrategy) and isinstance(strategy.hetero, HeteroFacade)


def test_no_strategy_lists_the_protocol_members_itself():
    """The face is its own object: the strategy classes keep the few public names the docs give, no more."""
    documented = {"lab", "plan", "share_controller", "emulation", "comm_bytes_last_step"}
    documented.add("sharded")  # a fact of the class, which the rehearsal reads before a strategy exists
    for cls in (HeteroDDPStrategy, HeteroFSDPStrategy, HeteroHybridStrategy):
        assert not (set(MEMBERS) - documented) & set(dir(cls)), cls.__name__


def test_lightning_strategies_are_not():
    assert observed(DDPStrategy()) is None


def test_a_renamed_member_is_no_longer_observed():
    """What a rename does: the face stops satisfying the protocol, and the callbacks see no hetero strategy (so the
    tests above fail)."""
    for name in MEMBERS:
        renamed = type("Renamed", (HeteroFacade,), {name: property(lambda self: (_ for _ in ()).throw(
            AttributeError(name)))})
        strategy = HeteroDDPStrategy()
        strategy.hetero = renamed(strategy)
        assert not isinstance(strategy.hetero, ObservedStrategy), name
        assert observed(strategy) is None, name


def test_the_facade_defines_every_member():
    assert MEMBERS and all(name in dir(HeteroFacade) for name in MEMBERS)


def _probes(path: pathlib.Path) -> list[str]:
    """``getattr(x.strategy, ...)`` / ``hasattr(x.strategy, ...)`` / ``getattr(strategy, ...)`` calls in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if target.endswith("strategy") or target.endswith("_strategy"):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_callback_probes_strategy_attributes():
    assert not [p for module in CALLBACK_MODULES for p in _probes(ROOT / module)]
