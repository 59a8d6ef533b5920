"""The arguments every heterogeneous strategy hands to Lightning's ``DDPStrategy``, checked in one place.

Each strategy keeps its own flat, typed constructor (LightningCLI reads it); its body turns Lightning's share of
those arguments into ``DDPStrategy``'s keywords with one call, and the hetero share into its core
(:func:`~lightning_hetero.strategies.core.core_from_arguments`).

Example::

    options = from_flat_arguments(profiling, rebalance, data, resilience, observation, flat={})
    super().__init__(**parallel_arguments(options, start_method, process_group_backend, accelerator,
                                          parallel_devices, cluster_environment, checkpoint_io, precision_plugin))
"""

from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from lightning_hetero.config import Options, StartMethod, check_strategy_arguments
from lightning_hetero.resilience.checkpoint import AtomicCheckpointIO


def parallel_arguments(options: Options, start_method: StartMethod, process_group_backend: Optional[str],
                       accelerator: Optional[Union[str, Accelerator]], parallel_devices: Optional[list[torch.device]],
                       cluster_environment: Optional[ClusterEnvironment], checkpoint_io: Optional[CheckpointIO],
                       precision_plugin: Optional[Precision], ddp_comm_hook: Optional[Callable] = None,
                       ddp_comm_wrapper: Optional[Callable] = None) -> dict[str, Any]:
    """``DDPStrategy``'s keyword arguments, each checked with its name on a bad value: checkpoints written atomically
    unless ``checkpoint_io`` is given, the process group's timeout from ``resilience.timeout``."""
    check_strategy_arguments(start_method, process_group_backend, accelerator, parallel_devices, cluster_environment,
                             checkpoint_io, precision_plugin, ddp_comm_hook, ddp_comm_wrapper)
    return {
        "accelerator": accelerator, "parallel_devices": parallel_devices, "cluster_environment": cluster_environment,
        "checkpoint_io": checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
        "precision_plugin": precision_plugin, "process_group_backend": process_group_backend,
        "timeout": timedelta(seconds=float(options.resilience.timeout)), "start_method": start_method,
    }
