"""lightning-hetero: capacity-weighted data parallelism for mixed GPUs, as a PyTorch Lightning strategy.

Importing the package registers every strategy of :mod:`lightning_hetero.registry` with Lightning's strategy
registry: ``"hetero_ddp"`` (and ``_spawn`` / ``_fork`` / ``_notebook`` variants) and ``"hetero_fsdp"`` (and ``_spawn``
/ ``_fork``), so ``Trainer(strategy="hetero_ddp")`` works.
"""

import importlib

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.config import DataSplit, Observation, Profiling, Rebalancing, Resilience
from lightning_hetero.grad.compression_config import (
    AutoCompression,
    CastCompression,
    NoCompression,
    PowerSGDCompression,
    TopKCompression,
)
from lightning_hetero.grad.periodic import PeriodicSync
from lightning_hetero.grad.precision import PrecisionPolicy
from lightning_hetero.lab.devices import describe_device
from lightning_hetero.lab.presets import PRESETS
from lightning_hetero.lab.groups import HeteroLab
from lightning_hetero.observe.monitor import HeteroMonitor
from lightning_hetero.plan.split import split_batch
from lightning_hetero.strategies.ddp import HeteroDDPStrategy
from lightning_hetero.strategies.fsdp import HeteroFSDPStrategy
from lightning_hetero.strategies.hybrid import HeteroHybridStrategy
from lightning_hetero.plan.memory import MemoryPolicy
from lightning_hetero.registry import STRATEGIES

for _entry in STRATEGIES:
    # A class path names the package itself ("lightning_hetero.HeteroDDPStrategy": imported above) or its module.
    _module, _, _class = _entry.class_path.rpartition(".")
    getattr(importlib.import_module(_module), _class).register_strategies(StrategyRegistry)
del _entry, _module, _class

__version__ = "0.2.0"

__all__ = [
    "PRESETS",
    "AutoCompression",
    "CastCompression",
    "DataSplit",
    "HeteroDDPStrategy",
    "HeteroFSDPStrategy",
    "HeteroHybridStrategy",
    "HeteroLab",
    "HeteroMonitor",
    "MemoryPolicy",
    "NoCompression",
    "Observation",
    "PeriodicSync",
    "PowerSGDCompression",
    "PrecisionPolicy",
    "Profiling",
    "Rebalancing",
    "Resilience",
    "TopKCompression",
    "describe_device",
    "split_batch",
]
