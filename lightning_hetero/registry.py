"""The package's strategies, one line each: the one list that Lightning's registry, the command line and the
rehearsal read.

Importing ``lightning_hetero`` registers every entry's ``name`` and its launcher variants with Lightning's strategy
registry, so ``Trainer(strategy="hetero_ddp_spawn")`` works; ``python -m lightning_hetero doctor --lab ...
--strategy NAME`` offers the names; LightningCLI configs spell the class as ``class_path``. Plain data: no torch or
Lightning import, so the command line starts fast and every layer may read it.

A new strategy is one module (``strategies/<name>.py``, see docs/development.md) and one line here::

    StrategyEntry("hetero_hybrid", "lightning_hetero.HeteroHybridStrategy",
                  "Pipeline stages within a host, data parallel across hosts"),
"""

from dataclasses import dataclass
from typing import Any, Optional

# Registry name suffix → Lightning launcher start method.
LAUNCHERS: tuple[tuple[str, str], ...] = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))
NOTEBOOK: tuple[tuple[str, str], ...] = (("_notebook", "fork"),)


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy of the package.

    Args:
        name: the registry name (``Trainer(strategy=name)``), the class's ``strategy_name``.
        class_path: where LightningCLI finds the class (``trainer.strategy.class_path``).
        description: one line for Lightning's registry.
        launchers: (name suffix, start method) of each variant registered.
    """

    name: str
    class_path: str
    description: str
    launchers: tuple[tuple[str, str], ...] = LAUNCHERS

    def variants(self) -> tuple[tuple[str, str], ...]:
        """(registry name, start method) of every variant: ``("hetero_ddp_spawn", "spawn")``."""
        return tuple((self.name + suffix, start_method) for suffix, start_method in self.launchers)


STRATEGIES: tuple[StrategyEntry, ...] = (
    StrategyEntry("hetero_ddp", "lightning_hetero.HeteroDDPStrategy", "Capacity-weighted DDP for mixed GPUs",
                  launchers=LAUNCHERS + NOTEBOOK),
    StrategyEntry("hetero_fsdp", "lightning_hetero.HeteroFSDPStrategy", "Sharded (FSDP2) training over unequal GPUs"),
    StrategyEntry("hetero_hybrid", "lightning_hetero.HeteroHybridStrategy",
                  "Pipelined replicas of small cards beside data-parallel ones"),
)


def names() -> list[str]:
    """Every entry's name, in the order above."""
    return [entry.name for entry in STRATEGIES]


def entry(name: str) -> StrategyEntry:
    """The entry of ``name`` (a ``ValueError`` naming the choices for another)."""
    for candidate in STRATEGIES:
        if candidate.name == name:
            return candidate
    raise ValueError(f"strategy {name!r} is not one of {names()}.")


def entry_of(name: str) -> Optional[StrategyEntry]:
    """The entry whose name, or a launcher variant's (``"hetero_ddp_spawn"``), is ``name``; ``None`` if none."""
    return next((e for e in STRATEGIES if any(variant == name for variant, _ in e.variants())), None)


def register_with_lightning(strategy_class: Any, strategy_registry: Any) -> None:
    """Register the names of ``strategy_class``'s line (its ``strategy_name``) with Lightning's registry, one per
    launcher variant.

        >>> register_with_lightning(HeteroDDPStrategy, StrategyRegistry)   # "hetero_ddp", "hetero_ddp_spawn", ...
    """
    listed = entry(strategy_class.strategy_name)
    for name, start_method in listed.variants():
        if name not in strategy_registry:
            strategy_registry.register(name, strategy_class, start_method=start_method,
                                       description=f"{listed.description}, start '{start_method}'")
