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
:func:`~lightning_hetero.grad.weighting.loss_weight`). ``set_gradient_divide_factor`` cannot do it: its factor is
applied after the sum on backends without ``PREMUL_SUM`` (gloo), so a per-rank factor would scale the others'
gradients too.

Example::

    >>> mesh = device_mesh(lab.hosts, "cuda")
    >>> shard_module(model, mesh, blocks=(TransformerBlock,), checkpoint=True, offload=False,
    ...              mp_policy=mixed_precision(["bf16-mixed", "bf16-mixed"]))
    >>> shard_module(model, mesh, blocks=(TransformerBlock,), checkpoint=24, offload=6)  # the first 24 / 6 blocks
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import lightning_hetero._compat as _compat
from lightning_hetero._compat import checkpoint_module_in_place, fsdp_flags
from lightning_hetero.plan.blocks import block_units, outermost, tied_parameters


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


def own_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: a tensor output that is a view (``nn.Linear`` on a 3-D input returns one) is returned as a copy.

    FSDP2 registers its pre-backward hook on each output; an in-place op on a view would drop it (FSDP2 warns "returned
    a view tensor"). The copy is the same values and gradient; the view's base is not kept alive by it.

    Example::
        >>> block.register_forward_hook(own_outputs)   # before fully_shard(block): it runs before FSDP2's hook
    """
    if not torch.is_grad_enabled():
        return output
    if isinstance(output, torch.Tensor):
        return output.clone() if output.requires_grad and _compat.is_view(output) else output
    if type(output) in (tuple, list):
        return type(output)(own_outputs(module, args, item) for item in output)
    return output


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
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``module`` in place: ``fully_shard`` each block (inner first) and the root. ``checkpoint`` / ``offload``:
    ``True`` for every block, ``False`` for none, or a count: the first that many top-level blocks
    (:func:`~lightning_hetero.plan.blocks.top_level_blocks`) recompute their activations in the backward / keep
    their shard, gradients and optimizer state in host memory (blocks inside one inherit its choice). The root's own
    parameters (embeddings, heads) are offloaded only when every block is. A module the user already sharded keeps
    its blocks; only the root is added if missing. ``reshard_after_forward=False``: the blocks keep their gathered
    parameters until their backward (one all-gather per block and step instead of two); the same on every rank."""
    ties = tied_parameters(module)
    units = block_units(module, blocks, ties) if not is_sharded(module) else []
    top = outermost(units)
    checkpointed, offloaded = _first(checkpoint, len(top)), _first(offload, len(top))
    inside = {id(m) for m in units}

    def options(offload_this: bool, block: bool = True) -> dict[str, object]:
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_this else OffloadPolicy()
        chosen: dict[str, object] = {"mesh": mesh, "offload_policy": policy}
        if block and not reshard_after_forward:
            chosen["reshard_after_forward"] = False  # the root is FSDP's to decide (it keeps its own gathered)
        if mp_policy is not None:
            chosen["mp_policy"] = mp_policy
        return chosen

    for index, block in reversed(list(enumerate(top))):
        inner = [m for m in block.modules() if m is not block and id(m) in inside]
        # Reversed pre-order: inner blocks are sharded before the blocks that hold them, as FSDP2 requires.
        for unit in reversed(inner):
            unit.register_forward_hook(own_outputs)
            fully_shard(unit, **options(index < offloaded))
        if index < checkpointed:
            checkpoint_module_in_place(block)  # keeps parameter names: checkpoints match across ranks
        block.register_forward_hook(own_outputs)
        fully_shard(block, **options(index < offloaded))
    if not isinstance(module, FSDPModule):
        module.register_forward_hook(own_outputs)
        fully_shard(module, **options(offloaded == len(top) and (len(top) > 0 or bool(offload)), block=False))
    check_ties(module, ties)
    return module


def check_ties(module: nn.Module, ties: Sequence[tuple[str, ...]]) -> None:
    """Raise if sharding made two parameters of one that was tied (each would train apart from the other)."""
    for names in ties:
        found = {id(module.get_parameter(name)) for name in names}
        if len(found) > 1:
            raise ValueError(
                f"the tied parameters {list(names)} were sharded apart and would train as {len(found)} different "
                f"parameters: shard the modules that share a parameter in one `fully_shard` call (e.g. "
                f"`fully_shard([embedding, head])` or only the module that holds both).")


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Skip the reduce-scatter on accumulation micro-steps (each rank sums its unsharded gradients locally)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)


def keep_blocks_gathered(module: nn.Module, keep: bool) -> None:
    """Whether the sharded blocks of ``module`` keep their gathered parameters from forward to backward (FSDP2's
    ``reshard_after_forward``, changed between steps); the root is FSDP's to decide. Every rank must set the same:
    a block that stays gathered skips the all-gather of its backward.

    Example::

        >>> keep_blocks_gathered(model, False)   # on every rank, between steps
    """
    for m in module.modules():
        if isinstance(m, FSDPModule) and m is not module:
            m.set_reshard_after_forward(not keep, recurse=False)


@contextmanager
def gathered_across_micro_batches(module: nn.Module) -> Iterator[None]:
    """Around the forward and backward of every micro-batch but a rank's last in the step: the parameters stay
    gathered (no reshard after forward or backward) and gradients accumulate unsharded (no reduce-scatter).

    A rank that runs k micro-batches so joins exactly the collectives of a rank that runs one: each block's
    all-gather at its first forward, then at the last micro-batch (with FSDP's own settings again) the all-gather of
    backward and the reduce-scatter. The cost is memory: the whole model's parameters and an unsharded gradient are
    held from the first forward to the last backward (:func:`~lightning_hetero.plan.memory.micro_batch_gathered_bytes`).

    Example::

        >>> for chunk in chunks[:-1]:
        ...     with gathered_across_micro_batches(model):
        ...         loss_fn(model(chunk)).backward()
        >>> loss_fn(model(chunks[-1])).backward()  # reshards, reduce-scatters
    """
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    flags = [fsdp_flags(m) for m in sharded]
    if isinstance(module, FSDPModule):
        # Not the step's last backward: FSDP would otherwise reshard every group when the backward ends.
        module.set_is_last_backward(False)
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        # The root never reshards after forward (FSDP sets that at its first forward); only the blocks are changed.
        if m is not module:
            m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(True)
        for m, (after_forward, after_backward, sync) in zip(sharded, flags):
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_reshard_after_backward(after_backward, recurse=False)
            if m is not module:
                m.set_reshard_after_forward(after_forward, recurse=False)

