"""Where the hybrid layout's pipelines and stage boundaries come from, and the model every rank starts from: plain
functions the strategy calls at set-up.

Example::

    pipelines = auto_pipelines(module, devices, capacities, headroom=0.1)  # [[2, 3]]: the cards that need it
    split = split_points_for(module, [capacities[r] for r in pipelines[0]])  # ["blocks.6"]
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hetero.plan.blocks import default_blocks, top_level_blocks
from lightning_hetero.plan.layout import PipelineChoice, balanced_starts, choose_pipelines
from lightning_hetero.plan.memory import device_budget, optimizer_slots


def auto_pipelines(module: nn.Module, devices: Sequence[Any], capacities: Sequence[float],
                   headroom: float) -> PipelineChoice:
    """``pipelines="auto"``: the cards that cannot hold a replica paired into pipelines
    (:func:`~lightning_hetero.plan.layout.choose_pipelines`), alike on every rank (the lab is every rank's)."""
    params = [p for p in module.parameters() if p.requires_grad]
    # Parameters, gradients and optimizer state (not built yet: Adam's two moments); activations must fit in the
    # profiling headroom.
    replica = sum(p.numel() * p.element_size() for p in params) * (2 + optimizer_slots(None))
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    return choose_pipelines([device_budget(d, headroom) for d in devices], list(capacities), replica,
                            weight_bytes=weights)


def split_points_for(module: nn.Module, capacities: Sequence[float]) -> list[str]:
    """Where each stage after the first begins: the model's repeated blocks cut in proportion to the stage ranks'
    ``capacities``."""
    names = {id(m): n for n, m in module.named_modules()}
    blocks = [names[id(b)] for b in top_level_blocks(module, default_blocks(module))]
    return [blocks[i] for i in balanced_starts(len(blocks), capacities)]


def broadcast_start(module: nn.Module, parked: Mapping[str, Tensor], device: torch.device) -> None:
    """Every rank starts from rank 0's parameters and buffers (no DDP wrapper broadcasts them; a parked stage rank's
    values are in host memory, ``parked``, and NCCL sends device tensors), each tensor once, by the name ``parked``
    knows it by (``state_dict`` also lists a tied weight's aliases). Collective over all ranks."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        tensor = parked.get(name, tensor.detach())
        staged = tensor.to(device)
        dist.broadcast(staged, src=0)
        if staged is not tensor:
            tensor.copy_(staged)
