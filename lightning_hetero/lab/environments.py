"""Cluster environments for labs whose hosts hold different numbers of GPUs (a 2-GPU server + a 1-GPU workstation).

Lightning assumes every node runs ``devices`` processes: ``TorchElasticEnvironment.validate_settings`` demands
``devices × num_nodes == WORLD_SIZE``, which no single ``devices`` satisfies for 2 + 1. torchrun itself knows each
node's count (``--nproc-per-node``, exported as ``LOCAL_WORLD_SIZE``) and hands every process its global ``RANK``
and the ``WORLD_SIZE``, so the check that matters is per node: ``devices`` (given on each host's command line) must
equal this node's process count. :class:`PerNodeTorchElasticEnvironment` checks exactly that; the strategy uses it
in place of Lightning's whenever torchrun launched the job.
"""

import os
from typing import Optional

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from typing_extensions import override


class PerNodeTorchElasticEnvironment(TorchElasticEnvironment):
    """torchrun's environment with per-node process counts: ``devices`` must match this node's ``--nproc-per-node``."""

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) != num_devices:
            raise ValueError(
                f"You set `devices={num_devices}` but torchrun started {local} processes on this node "
                f"(--nproc-per-node={local}). Set `devices={local}` on this host (hosts may differ)."
            )
        nodes = os.environ.get("GROUP_WORLD_SIZE")
        if nodes is not None and int(nodes) != num_nodes:
            raise ValueError(f"You set `num_nodes={num_nodes}` but torchrun runs {nodes} nodes (--nnodes). "
                             f"Set `num_nodes={nodes}`.")


def per_node_environment(environment: Optional[ClusterEnvironment], devices: Optional[list[torch.device]],
                         ) -> tuple[Optional[ClusterEnvironment], Optional[list[torch.device]]]:
    """The environment and devices a strategy launches with: under torchrun, :class:`PerNodeTorchElasticEnvironment`
    in place of Lightning's, and CPU processes counted as torchrun started them on this node (``--nproc-per-node``:
    they have no device to count). Otherwise both unchanged.

        >>> strategy.cluster_environment, strategy.parallel_devices = per_node_environment(
        ...     strategy.cluster_environment, strategy.parallel_devices)
    """
    if type(environment) is not TorchElasticEnvironment:
        return environment, devices
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if local and devices and all(d.type == "cpu" for d in devices) and len(devices) != local:
        devices = [torch.device("cpu")] * local
    return PerNodeTorchElasticEnvironment(), devices
