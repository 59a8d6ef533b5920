"""The strategies are listed once (lightning_hetero/registry.py): Lightning's registry, the command line and a new
strategy's names all come from that list."""

import importlib

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero import HeteroDDPStrategy, registry
from lightning_hetero.__main__ import main


def test_every_entry_is_registered_with_each_launcher():
    expected = {"hetero_ddp": "popen", "hetero_ddp_spawn": "spawn", "hetero_ddp_fork": "fork",
                "hetero_ddp_notebook": "fork", "hetero_fsdp": "popen", "hetero_fsdp_spawn": "spawn",
                "hetero_fsdp_fork": "fork",
                "hetero_hybrid": "popen", "hetero_hybrid_spawn": "spawn", "hetero_hybrid_fork": "fork"}
    assert {name: start for entry in registry.STRATEGIES for name, start in entry.variants()} == expected
    for entry in registry.STRATEGIES:
        module, _, name = entry.class_path.rpartition(".")
        strategy_class = getattr(importlib.import_module(module), name)
        assert strategy_class.strategy_name == entry.name
        for variant, start_method in entry.variants():
            assert StrategyRegistry[variant]["strategy"] is strategy_class
            assert StrategyRegistry[variant]["init_params"] == {"start_method": start_method}


def test_the_command_line_offers_the_listed_names(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--strategy", "hetero_nothing"])
    assert "choose from " + ", ".join(f"'{n}'" for n in registry.names()) in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"'hetero_nothing' is not one of \['hetero_ddp', 'hetero_fsdp', 'hetero_hybrid'\]"):
        registry.entry("hetero_nothing")


class HeteroNextStrategy(HeteroDDPStrategy):
    strategy_name = "hetero_next"


def test_a_new_strategy_is_its_class_and_one_line(monkeypatch):
    line = registry.StrategyEntry("hetero_next", f"{__name__}.HeteroNextStrategy", "The next layout")
    monkeypatch.setattr(registry, "STRATEGIES", registry.STRATEGIES + (line,))
    fresh = type(StrategyRegistry)()
    HeteroNextStrategy.register_strategies(fresh)
    assert {name: fresh[name]["init_params"]["start_method"] for name in fresh} == {
        "hetero_next": "popen", "hetero_next_spawn": "spawn", "hetero_next_fork": "fork"}
    assert fresh["hetero_next_fork"]["strategy"] is HeteroNextStrategy
    assert "hetero_next" in registry.names()
