"""Where the hybrid layout's pipelines and stage boundaries come from, and the model every rank starts from: plain
functions the strategy calls at set-up.

Example::

    pipelines = auto_pipelines(module, devices, capacities, headroom=0.1)  # [[2, 3]]: the cards that need it
    split = split_points_for(module, [capacities[r] for r in pipelines[0]])  # ["blocks.6"]
"""

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_hetero.config import DataSplit, check, check_choice
from lightning_hetero.plan.blocks import default_blocks, top_level_blocks
from lightning_hetero.plan.layout import HybridLayout, PipelineChoice, balanced_starts, choose_pipelines
from lightning_hetero.plan.memory import device_budget, optimizer_slots
from lightning_hetero.view import running_strategy


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


def plan_layout(pipelines: Union[list[list[int]], str], module: nn.Module, devices: Sequence[Any],
                capacities: Sequence[float], headroom: float, world_size: int) -> HybridLayout:
    """The job's layout from the constructor's ``pipelines`` (``"auto"``: :func:`auto_pipelines`, the choice and its
    reasons logged on rank 0); rank 0 must be data-parallel."""
    if pipelines == "auto":
        choice = auto_pipelines(module, devices, capacities, headroom)
        pipelines = [list(p) for p in choice.pipelines]
        rank_zero_info(f"{running_strategy()} pipelines='auto': {pipelines}; " + "; ".join(choice.reasons))
    assert not isinstance(pipelines, str)
    layout = HybridLayout.from_pipelines(pipelines, world_size)
    check("", "pipelines", pipelines, 0 in layout.data_parallel,
          "pipelines without rank 0: rank 0 is data-parallel (it writes checkpoints and is the source of buffers)")
    return layout


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


def check_pipeline_modes(modes: Optional[Sequence[str]], pipelines: Sequence[Sequence[int]]) -> None:
    """One precision mode per pipeline: autocast sets the dtype of the activations on the wire, and a stage's receive
    buffer has one."""
    for ranks in pipelines if modes else ():
        assert modes is not None
        check("", "precision_policy", [modes[r] for r in ranks], len({modes[r] for r in ranks}) == 1,
              f"one mode for all ranks of the pipeline {list(ranks)}")


def check_pipelined_run(precision: Precision, module: LightningModule, pipelined_fit: bool) -> None:
    """Refuse at set-up what a pipelined replica cannot run: fp16 loss scaling, and in a fit with pipelines manual
    optimization (its step runs its own backward)."""
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(f"{running_strategy()}: fp16 loss scaling is not supported on a pipelined replica; use "
                         "bf16 or fp32 (`precision_policy`).")
    if pipelined_fit and not module.automatic_optimization:
        raise ValueError(f"{running_strategy()}: manual optimization (`automatic_optimization = False`) cannot "
                         "drive a pipelined replica, whose step runs its own backward; use automatic "
                         "optimization, or strategy='hetero_ddp' / 'hetero_fsdp' (no pipelines).")


def check_hybrid_arguments(pipelines: Any, micro_batches: Any, schedule: Any, overlap_stage_exchange: Any,
                           pipelined_evaluation: Any, split_points: Any, data: DataSplit) -> None:
    """``HeteroHybridStrategy``'s own constructor arguments, each checked with its name (a clear error, not a later
    failure inside the pipeline)."""
    check("", "pipelines", pipelines, pipelines == "auto" or isinstance(pipelines, list) and all(
        isinstance(p, list) and all(isinstance(r, int) for r in p) for p in pipelines),
        "'auto' or a list of pipelines, each a list of global ranks in stage order (e.g. [[2, 3]])")
    check("", "micro_batches", micro_batches, micro_batches is None or (
        isinstance(micro_batches, int) and micro_batches >= 1), "a positive integer or None")
    check_choice("", "schedule", schedule, ("gpipe", "1f1b"))
    check("", "overlap_stage_exchange", overlap_stage_exchange, isinstance(overlap_stage_exchange, bool),
          "True or False")
    check("", "pipelined_evaluation", pipelined_evaluation, isinstance(pipelined_evaluation, bool),
          "True or False")
    check("", "split_points", split_points, split_points is None or (
        isinstance(split_points, list) and all(isinstance(s, str) for s in split_points)),
        "a list of module names or None")
    check("data", "micro_batch", data.micro_batch, data.micro_batch is None,
          "None with pipelines (a pipeline runs its share as its own micro-batches)")
    check("data", "loss_denominator", data.loss_denominator, data.loss_denominator == "samples",
          "'samples' with pipelines (a pipeline weights its micro-batches by their samples, not their tokens)")
