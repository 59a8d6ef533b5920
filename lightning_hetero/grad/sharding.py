"""How one rank's copy of the model is sharded: FSDP2 over a 1-D mesh (one host) or a 2-D HSDP mesh (several).

The whole composition is :func:`shard_module`: per-block activation checkpointing, then ``fully_shard`` on every
block (inner first) and on the root, with the job's mixed-precision policy and, for as many blocks as the rank's
memory plan says, CPU offload of their shard and optimizer state (an offload policy per ``fully_shard`` call). What a
rank recomputes or offloads changes nothing in the math: the same sums are computed, only where the tensors live
differs, so these choices may differ per rank and per block. What must be the
same on every rank is what crosses the wire: the block boundaries (one collective per block) and the dtypes of the
all-gather and the reduce-scatter (``MixedPrecisionPolicy``).

Capacity weighting needs nothing from FSDP: each rank scales its loss by b_r · W / G and FSDP's averaging
reduce-scatter (÷ W) leaves Σ_r (b_r / G) g_r, the gradient of the mean loss over the global batch (see
:func:`~lightning_hetero.grad.weighting.loss_weight`). ``set_gradient_divide_factor`` cannot do it: its factor is applied after the sum on backends
without ``PREMUL_SUM`` (gloo), so a per-rank factor would scale the others' gradients too.

Example::

    >>> mesh = device_mesh(lab.hosts, "cuda")
    >>> shard_module(model, mesh, blocks=(TransformerBlock,), checkpoint=True, offload=False,
    ...              mp_policy=mixed_precision(["bf16-mixed", "bf16-mixed"]))
    >>> shard_module(model, mesh, blocks=(TransformerBlock,), checkpoint=24, offload=6)  # the first 24 / 6 blocks
"""

from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_hetero._compat import checkpoint_module_in_place


def default_blocks(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """Block classes to shard when none are given: the entries of every ``nn.ModuleList`` (transformer layers), else
    every module that holds parameters of its own (``Linear``, ``Embedding``, convolutions ...)."""
    listed = {type(child) for m in module.modules() if isinstance(m, nn.ModuleList) for child in m}
    if listed:
        return tuple(sorted(listed, key=lambda t: t.__qualname__))
    own = {type(m) for m in module.modules() if m is not module and any(True for _ in m.parameters(recurse=False))}
    return tuple(sorted(own, key=lambda t: t.__qualname__))


def is_sharded(module: nn.Module) -> bool:
    """Whether the module (or one inside it) was already sharded, e.g. by the user's ``configure_model``."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def device_mesh(hosts: Mapping[str, Sequence[int]], device_type: str) -> DeviceMesh:
    """1-D mesh on one host; on equal hosts a 2-D HSDP mesh (replicate across hosts, shard inside one), so only the
    replicated gradient all-reduce crosses the slow link. Unequal hosts (2 + 1 GPUs) cannot form a 2-D mesh: they
    shard over all ranks (every collective spans the hosts). Collective: every rank calls it."""
    sizes = {len(ranks) for ranks in hosts.values()}
    world = sum(len(ranks) for ranks in hosts.values())
    if len(hosts) > 1 and len(sizes) == 1:
        # Rank r sits at (r // per_host, r % per_host): Lightning numbers ranks host by host.
        return init_device_mesh(device_type, (len(hosts), world // len(hosts)), mesh_dim_names=("replicate", "shard"))
    # The world group itself, not a new one: ranks sharing one GPU over gloo cannot create groups (see
    # lightning_hetero.lab.shared_gpu), and a 1-D mesh over every rank needs none.
    return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("shard",))


def mixed_precision(modes: Sequence[str]) -> Optional[MixedPrecisionPolicy]:
    """bf16 all-gather and reduce-scatter when every rank runs ``bf16-mixed`` (fp32 master weights stay in the
    shard); otherwise ``None``: fp32 on the wire, and each rank's autocast (its precision plugin) picks its own compute
    dtype. The collectives' dtype must be one for the job, so one rank without bf16 keeps the whole job at fp32."""
    if modes and all(mode == "bf16-mixed" for mode in modes):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return None


def top_level_blocks(module: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The modules of ``blocks`` classes not inside another one, in module order (the forward order of a layer list):
    the units a memory plan counts ("the first k blocks")."""
    targets = [m for m in module.modules() if m is not module and isinstance(m, blocks)]
    nested = {id(inner) for block in targets for inner in block.modules() if inner is not block}
    return [m for m in targets if id(m) not in nested]


BlockCount = Union[bool, int]


def _first(count: BlockCount, total: int) -> int:
    if isinstance(count, bool):
        return total if count else 0
    if not 0 <= count <= total:
        raise ValueError(f"a block count of {count} is outside [0, {total}] (the model has {total} blocks).")
    return count


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    blocks: tuple[type[nn.Module], ...],
    checkpoint: BlockCount,
    offload: BlockCount,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
) -> nn.Module:
    """Shard ``module`` in place: ``fully_shard`` each block (inner first) and the root. ``checkpoint`` / ``offload``:
    ``True`` for every block, ``False`` for none, or a count: the first that many top-level blocks
    (:func:`top_level_blocks`) recompute their activations in the backward / keep their shard, gradients and optimizer
    state in host memory (blocks inside one inherit its choice). The root's own parameters (embeddings, heads) are
    offloaded only when every block is. A module the user already sharded keeps its blocks; only the root is added
    if missing."""
    top = top_level_blocks(module, blocks) if not is_sharded(module) else []
    checkpointed, offloaded = _first(checkpoint, len(top)), _first(offload, len(top))

    def options(offload_this: bool) -> dict[str, object]:
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_this else OffloadPolicy()
        chosen = {"mesh": mesh, "offload_policy": policy}
        if mp_policy is not None:
            chosen["mp_policy"] = mp_policy
        return chosen

    for index, block in reversed(list(enumerate(top))):
        inner = [m for m in block.modules() if m is not block and isinstance(m, blocks)]
        # Reversed pre-order: inner blocks are sharded before the blocks that hold them, as FSDP2 requires.
        for unit in reversed(inner):
            fully_shard(unit, **options(index < offloaded))
        if index < checkpointed:
            checkpoint_module_in_place(block)  # keeps parameter names: checkpoints match across ranks
        fully_shard(block, **options(index < offloaded))
    if not isinstance(module, FSDPModule):
        fully_shard(module, **options(offloaded == len(top) and (len(top) > 0 or bool(offload))))
    return module


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Skip the reduce-scatter on accumulation micro-steps (each rank sums its unsharded gradients locally)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)
