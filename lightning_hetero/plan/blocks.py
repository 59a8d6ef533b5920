"""The model's blocks: the units FSDP2 shards one by one and a per-block memory plan counts ("the first k blocks").

The memory plan (:mod:`~lightning_hetero.plan.memory`) and the sharding (:mod:`~lightning_hetero.grad.sharding`) must
agree on them, block for block, so both take them from here: the block classes (given, or :func:`default_blocks`),
their outermost instances in module order, and never a block that holds only some users of a tied parameter.

Example::

    >>> blocks = default_blocks(model)              # (TransformerBlock,): the entries of the model's ModuleList
    >>> top_level_blocks(model, blocks)[:2]         # the first two blocks, in forward order
"""

from collections.abc import Sequence

from torch import nn


def default_blocks(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """Block classes to shard when none are given: the entries of every ``nn.ModuleList`` (transformer layers), else
    every module that holds parameters of its own (``Linear``, ``Embedding``, convolutions ...)."""
    listed = {type(child) for m in module.modules() if isinstance(m, nn.ModuleList) for child in m}
    if listed:
        return tuple(sorted(listed, key=lambda t: t.__qualname__))
    own = {type(m) for m in module.modules() if m is not module and any(True for _ in m.parameters(recurse=False))}
    return tuple(sorted(own, key=lambda t: t.__qualname__))


def top_level_blocks(module: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The modules of ``blocks`` classes that :func:`~lightning_hetero.grad.sharding.shard_module` shards and that are
    not inside another one, in module order (the forward order of a layer list): the units a memory plan counts ("the
    first k blocks")."""
    return outermost(block_units(module, blocks, tied_parameters(module)))


def block_units(module: nn.Module, blocks: tuple[type[nn.Module], ...],
                ties: Sequence[tuple[str, ...]]) -> list[nn.Module]:
    """Every module of a ``blocks`` class that ``fully_shard`` may take on its own (``ties``: :func:`tied_parameters`),
    nested ones included."""
    # A block holding only some users of a tied parameter would shard it apart from the others: such a block is left
    # to the block (or root) that holds all of them, where FSDP2 keeps the parameter one.
    return [m for name, m in module.named_modules() if m is not module and isinstance(m, blocks)
            and not _splits_a_tie(name, ties)]


def outermost(units: Sequence[nn.Module]) -> list[nn.Module]:
    """The units not inside another one, in the given order."""
    nested = {id(inner) for block in units for inner in block.modules() if inner is not block}
    return [m for m in units if id(m) not in nested]


def tied_parameters(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter reachable under more than one name (tied weights, e.g. an output head sharing
    the embedding's weight), one tuple per parameter."""
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def _splits_a_tie(block_name: str, ties: Sequence[tuple[str, ...]]) -> bool:
    prefix = block_name + "."
    return any(0 < sum(name.startswith(prefix) for name in names) < len(names) for names in ties)
