"""lightning-hetero: capacity-weighted data parallelism for mixed GPUs, as a PyTorch Lightning strategy.

Importing the package registers ``"hetero_ddp"`` (and ``_spawn`` / ``_fork`` / ``_notebook`` variants) with
Lightning's strategy registry, so ``Trainer(strategy="hetero_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.autocompress import AutoCompression
from lightning_hetero.capacity import parse_capacities
from lightning_hetero.compression import CastCompression, NoCompression, PowerSGDCompression, TopKCompression
from lightning_hetero.devices import PEAK_TFLOPS, DeviceInfo, describe_device, peak_tflops
from lightning_hetero.emulation import PRESETS, EmulationSpec, Emulator
from lightning_hetero.lab import HeteroLab, LabGroups
from lightning_hetero.monitor import HeteroMonitor
from lightning_hetero.plan import split_batch
from lightning_hetero.precision import HeteroMixedPrecision, PrecisionPolicy
from lightning_hetero.profiling import ProfileResult, RankProfile
from lightning_hetero.rebalance import ShareController
from lightning_hetero.sampler import GlobalOrder, HeteroBatchSampler
from lightning_hetero.state import RankStateCallback
from lightning_hetero.strategy import HeteroDDPStrategy
from lightning_hetero.weighting import WeightingState, weighted_allreduce_hook

HeteroDDPStrategy.register_strategies(StrategyRegistry)

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
    "HeteroLab",
    "HeteroMixedPrecision",
    "HeteroMonitor",
    "LabGroups",
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
