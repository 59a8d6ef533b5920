"""lightning-hetero: capacity-weighted data parallelism for mixed GPUs, as a PyTorch Lightning strategy.

Importing the package registers ``"hetero_ddp"`` (and ``_spawn`` / ``_fork`` / ``_notebook`` variants) and ``"hetero_fsdp"`` (and ``_spawn`` / ``_fork``) with
Lightning's strategy registry, so ``Trainer(strategy="hetero_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.grad.autocompress import AutoCompression
from lightning_hetero.plan.capacity import parse_capacities
from lightning_hetero.grad.compression import CastCompression, NoCompression, PowerSGDCompression, TopKCompression
from lightning_hetero.lab.devices import PEAK_TFLOPS, DeviceInfo, describe_device, peak_tflops
from lightning_hetero.lab.emulation import PRESETS, EmulationSpec, Emulator
from lightning_hetero.lab.groups import HeteroLab, LabGroups
from lightning_hetero.observe.monitor import HeteroMonitor
from lightning_hetero.plan.split import split_batch
from lightning_hetero.grad.precision import HeteroMixedPrecision, PrecisionPolicy
from lightning_hetero.plan.profiling import ProfileResult, RankProfile
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler
from lightning_hetero.resilience.state import RankStateCallback
from lightning_hetero.strategies.ddp import HeteroDDPStrategy
from lightning_hetero.strategies.fsdp import HeteroFSDPStrategy
from lightning_hetero.plan.memory import MemoryPolicy
from lightning_hetero.grad.weighting import WeightingState, weighted_allreduce_hook

HeteroDDPStrategy.register_strategies(StrategyRegistry)
HeteroFSDPStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "PEAK_TFLOPS",
    "PRESETS",
    "AutoCompression",
    "CastCompression",
    "DeviceInfo",
    "EmulationSpec",
    "Emulator",
    "GlobalOrder",
    "HeteroBatchSampler",
    "HeteroDDPStrategy",
    "HeteroFSDPStrategy",
    "HeteroLab",
    "HeteroMixedPrecision",
    "HeteroMonitor",
    "LabGroups",
    "MemoryPolicy",
    "NoCompression",
    "PowerSGDCompression",
    "PrecisionPolicy",
    "ProfileResult",
    "RankProfile",
    "RankStateCallback",
    "ShareController",
    "TopKCompression",
    "WeightingState",
    "describe_device",
    "parse_capacities",
    "peak_tflops",
    "split_batch",
    "weighted_allreduce_hook",
]
