"""Compressed gradient communication, composed with capacity weighting inside DDP's comm hook.

:class:`GradientCompression` turns a user config (:mod:`~lightning_hetero.grad.compression_config`) into one DDP comm
hook and its state, counts the bytes of each step and checkpoints per-rank state:

* ``"fp16"`` / ``"bf16"``: torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` (divide first: no overflow).
* ``"powersgd"``: torch's ``PowerSGDState`` + ``powerSGD_hook``, plus checkpointable per-rank state and a guard that
  keeps non-finite steps out of the error and warm-start memories (:mod:`~lightning_hetero.grad.powersgd_hook`).
* ``"topk"``: the largest ``ratio`` of entries by magnitude, sent as values + indices with ``all_gather`` (any world
  size, gloo or NCCL), with error feedback and a DGC-style ratio warm-up.
* ``hierarchical=True``: full precision inside each host (or device class), the compressed exchange only among the
  group leaders, then a broadcast inside the group.

Example::
    >>> compression = GradientCompression(TopKCompression(ratio=0.01), list(model.parameters()), world_size, device)
    >>> ddp_model.register_comm_hook(compression.state, compression.hook)
"""

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

import lightning_hetero._compat as _compat
from lightning_hetero.grad.bucket_state import CommCounter
from lightning_hetero.grad.compress_hooks import (
    CastState,
    HierarchicalState,
    TopKState,
    allreduce_hook,
    cast_hook,
    hierarchical_hook,
    topk_hook,
)
from lightning_hetero.grad.compression_config import (
    CastCompression,
    CompressionConfig,
    NoCompression,
    PowerSGDCompression,
    TopKCompression,
)
from lightning_hetero.grad.powersgd_hook import PowerSGDHookState, powersgd_hook
from lightning_hetero.view import running_strategy


class GradientCompression:
    """Builds the compression hook for one DDP model, counts bytes per step and checkpoints per-rank state.

    ``groups``: the strategy's :class:`~lightning_hetero.lab.groups.LabGroups` (needed for ``hierarchical``).
    """

    def __init__(self, config: Optional[CompressionConfig], params: Sequence[Tensor], world_size: int,
                 device: torch.device, groups: Any = None, pacer: Any = None) -> None:
        self.config = config
        self.counter = CommCounter()
        self.bytes_last_step: Optional[int] = None
        self.bytes_by_hop_last_step: dict[str, int] = {}
        self._dense_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        self.hook: Optional[Callable] = None
        self.state: Any = None
        self._stateful: Any = None
        # Ranks whose hook runs the compression
        self._compressing: tuple[int, ...] = tuple(range(world_size))
        if config is None:
            return
        hierarchical = config.hierarchical and groups is not None
        if hierarchical:
            self._compressing = tuple(groups.leader_ranks[config.group_by])
        process_group = groups.leaders[config.group_by] if hierarchical else None
        hop = "inter" if hierarchical else "all"
        if isinstance(config, NoCompression):
            hook, state = allreduce_hook, CastState("fp16", process_group, self.counter, hop)
        elif isinstance(config, CastCompression):
            hook, state = cast_hook, CastState(config.dtype, process_group, self.counter, hop)
        elif isinstance(config, PowerSGDCompression):
            hook, state = powersgd_hook, PowerSGDHookState(config, process_group, params, device, self.counter, hop)
            self._stateful = state
        else:
            hook, state = topk_hook, TopKState(config, process_group, params, device, self.counter, hop)
            self._stateful = state
        if hierarchical:
            members = groups.members[config.group_by]
            state = HierarchicalState(
                group=groups.groups[config.group_by],
                leader=members[0],
                leaders=groups.leaders[config.group_by],
                num_leaders=len(groups.leader_ranks[config.group_by]),
                world_size=world_size,
                inner_hook=hook,
                inner_state=state,
                counter=self.counter,
                pacer=pacer,
            )
            hook = hierarchical_hook
        self.hook, self.state = hook, state

    def check_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Warn when top-k's momentum correction and the optimizer would both apply momentum."""
        warn_double_momentum(self.config, optimizers)

    def end_step(self) -> None:
        """Close the optimizer step's byte count (hooks fire only on synchronizing steps)."""
        by_hop = self.counter.take()
        if self.config is None:
            # No hook of ours: DDP all-reduces every gradient at full size
            by_hop = {"all": self._dense_bytes}
        self.bytes_by_hop_last_step = by_hop
        self.bytes_last_step = sum(by_hop.values())

    def log_step(self, module: Any) -> None:
        """Close the step's count and log it as ``comm/bytes`` on the steps the logger writes (``self.log`` costs
        ~0.1 ms)."""
        self.end_step()
        trainer = _compat.trainer_of(module)
        if trainer is None or (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) != 0:
            return
        if _compat.inside_lightning_hook(module):
            module.log("comm/bytes", float(self.bytes_last_step or 0), on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        if self._stateful is None:
            return {}
        return {**self._stateful.state_dict(), "group_size": len(self._compressing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._stateful is not None and state:
            self._stateful.load_state_dict(state)

    def reshard(self, states: list[Optional[dict[str, Any]]], rank: int, world_size: int) -> Optional[dict[str, Any]]:
        """This rank's state from a checkpoint of another world size (or other compressing ranks).

        Error-feedback memories (top-k residuals, PowerSGD errors) hold what each rank still owes the average over
        the n compressing ranks, in units of 1/n of the mean gradient; only their sum over ranks enters the math.
        Saved rank i's memory goes to rank i if it still compresses, else to rank 0 (always compressing), rescaled
        by n_new / n_old, so the sum that is owed is kept. PowerSGD's P / Q are the same on every compressing rank
        (all-reduced), so a rank without its own takes rank 0's; counters and the RNG come from rank 0.
        """
        if self._stateful is None or not states or not states[0]:
            return None
        saved_n = int(states[0].get("group_size", len(states)))
        scale = len(self._compressing) / saved_n
        target = [i if i < world_size and i in self._compressing else 0 for i in range(len(states))]
        memory = "residual" if isinstance(self._stateful, TopKState) else "error"
        out = {k: v for k, v in states[0].items() if k != "buckets"}
        own = states[rank] if rank < len(states) and states[rank] else {"buckets": {}}
        buckets = {kind: dict(own["buckets"].get(kind) or tensors)
                   for kind, tensors in states[0]["buckets"].items() if kind != memory}
        owed: dict[int, Tensor] = {}
        for i, state in enumerate(states):
            if target[i] != rank or not state:
                continue
            for param, tensor in state["buckets"].get(memory, {}).items():
                owed[param] = owed[param] + tensor if param in owed else tensor.clone()
        buckets[memory] = {param: tensor * scale for param, tensor in owed.items()}
        if rank == 0 and any(t != i for i, t in enumerate(target)):
            moved = [i for i, t in enumerate(target) if t != i]
            rank_zero_info(
                f"{running_strategy()} resume: error-feedback memory of saved ranks {moved} folded into rank 0; "
                f"all memories scaled by {len(self._compressing)}/{saved_n} compressing ranks."
            )
        out["buckets"] = buckets
        return out


def warn_double_momentum(config: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Warn when top-k's momentum correction (``config``) and an optimizer would both apply momentum."""
    if not isinstance(config, TopKCompression) or config.momentum == 0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            own = group.get("momentum") or (group.get("betas") or (0.0,))[0]
            if own:
                rank_zero_warn(
                    f"`TopKCompression.momentum`={config.momentum} applies momentum in the gradient hook, and "
                    f"{type(optimizer).__name__} adds its own ({own}): momentum is applied twice. Use "
                    "`SGD(momentum=0)` / `Adam(betas=(0, ...))`, or `TopKCompression(momentum=0)`."
                )
                return
