"""Sharded checkpoints for FSDP: each rank writes its own shard with torch's distributed checkpoint (DCP).

Layout (Lightning's ``ModelParallelStrategy`` layout, so Lightning's own consolidation tool reads it too): a
directory with DCP's files for ``{"state_dict": model, "optimizer_0": ..., ...}`` and ``meta.pt``, rank 0's
``torch.save`` of the rest of the Lightning checkpoint (loops, callbacks, the per-rank state gathered by
:class:`~lightning_hetero.resilience.state.RankStateCallback`: shares, profile, RNG, sampler position).

Atomic: every rank writes into ``<path>.partial``; after a barrier rank 0 moves any previous ``<path>`` aside,
renames the partial directory into place and removes the old one, so a crash leaves either the old checkpoint or
the new one, never half of one. DCP reshards on load: a checkpoint of 2 ranks resumes on 3 and back.

:func:`export_full_checkpoint` turns a sharded directory into one ordinary Lightning ``.ckpt`` file, without a
process group, for ``Trainer(devices=1)``, ``LightningModule.load_from_checkpoint`` or any tool that reads one.
"""

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_hetero._compat import PathType
from lightning_hetero.resilience.progress import META_FILENAME

PARTIAL_SUFFIX = ".partial"


def is_sharded_checkpoint(path: PathType) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILENAME).is_file()


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def save_sharded(
    path: PathType,
    checkpoint: dict[str, Any],
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    rank: int,
    barrier: Callable[[], None],
    before_publish: Optional[Callable[[Path], None]] = None,
) -> None:
    """Write ``checkpoint`` (Lightning's dict; its ``state_dict`` / ``optimizer_states`` entries are replaced by the
    live sharded model and optimizers) to the directory ``path``. Collective: every rank calls it with the same path.

    ``before_publish(partial_dir)`` runs on rank 0 once every shard is on disk, before the rename: the place for a
    checksum manifest of the directory.
    """
    final = Path(path)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crashed earlier save
        partial.mkdir(parents=True)
    barrier()
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for index, optimizer in enumerate(optimizers):
        state[_optimizer_key(index)] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=partial)
    if rank == 0:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        torch.save(meta, partial / META_FILENAME)
    barrier()
    if rank == 0:
        if before_publish is not None:
            before_publish(partial)
        _publish(partial, final)
    barrier()


def _publish(partial: Path, final: Path) -> None:
    """Rename the finished directory into place; an existing one is moved aside first and removed after."""
    old = None
    if final.exists() or final.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
        os.replace(final, old / final.name)
    os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename is durable only once the directory entry is
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_sharded(
    path: PathType, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load the shards of this rank's mesh position (any saved world size) into ``model`` and ``optimizers``;
    returns the rest of the Lightning checkpoint. Collective."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a sharded checkpoint directory (no {META_FILENAME}).")
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for index, optimizer in enumerate(optimizers):
        state[_optimizer_key(index)] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[_optimizer_key(index)])
    return torch.load(path / META_FILENAME, weights_only=False)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers on the host, on every rank (an all-gather per tensor). Collective.
    (``cpu_offload=True`` would leave every rank but 0 with an empty dict.)"""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().cpu() for name, tensor in full.items()}


def export_full_checkpoint(sharded_dir: PathType, output_file: PathType) -> None:
    """Write the sharded checkpoint ``sharded_dir`` as one Lightning ``.ckpt`` (full model and optimizer states,
    as one process would have saved them), loadable by ``Trainer(devices=1).fit(ckpt_path=...)`` and
    ``load_from_checkpoint``. Runs in one process, no process group."""
    sharded_dir = Path(sharded_dir)
    if not is_sharded_checkpoint(sharded_dir):
        raise FileNotFoundError(f"{os.fspath(sharded_dir)!r} is not a sharded checkpoint directory.")
    with tempfile.TemporaryDirectory() as scratch:
        flat = Path(scratch) / "flat.pt"
        dcp_to_torch_save(sharded_dir, flat)
        tensors = torch.load(flat, weights_only=False)
    checkpoint = torch.load(sharded_dir / META_FILENAME, weights_only=False)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizer_keys = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_by_parameter_index(tensors[k]) for k in optimizer_keys]
    from lightning_hetero.resilience.checkpoint import AtomicCheckpointIO

    AtomicCheckpointIO().save_checkpoint(checkpoint, output_file)


def _by_parameter_index(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """DCP keys optimizer state by parameter name; ``Optimizer.load_state_dict`` wants indices in the order of
    the parameter groups' ``params`` lists (names there too)."""
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups = [dict(group, params=[index[n] for n in group["params"]]) for group in optimizer_state["param_groups"]]
    return {"state": {index[n]: s for n, s in optimizer_state["state"].items()}, "param_groups": groups}
