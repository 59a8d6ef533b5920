"""What each rank keeps in device memory under sharded training, and the check that it fits.

A rank's device holds its shard of the parameters, their gradients and the optimizer state (each 1/S of the model
over a shard group of S ranks), the gathered parameters and gradients of the block being computed, and the
activations of its b_r samples. Two per-rank choices trade time for memory without changing the math:

- ``"checkpoint"``: recompute each block's activations in the backward pass (keeps about two blocks' worth);
- ``"offload"``: the shard, its gradients and the optimizer state live in host memory (the optimizer steps there);
- ``"checkpoint_offload"``: both; ``"keep"``: neither.

The ``memory`` policy, in the style of ``precision_policy``: ``"auto"`` (the cheapest mode that fits, rank by rank),
one mode for all, or a mapping from device-name substring or ``"rank:N"`` to a mode. A job that cannot fit fails
before its first step, naming each rank's numbers.

Example::

    >>> HeteroFSDPStrategy(memory="auto")
    >>> HeteroFSDPStrategy(memory={"3090": "checkpoint", "A100": "keep"})
    >>> HeteroFSDPStrategy(memory=MemoryPolicy(rules={"rank:2": "offload", "*": "auto"}, headroom=0.15))
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, get_args

import torch
from torch import nn

from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.config import check, is_int, is_number
from lightning_hetero.rules import RankRules

MemoryMode = Literal["keep", "checkpoint", "offload", "checkpoint_offload"]
MemoryRule = Literal["auto", "keep", "checkpoint", "offload", "checkpoint_offload"]
MEMORY_MODES: tuple[str, ...] = get_args(MemoryMode)  # in the order "auto" tries them: fastest first
MEMORY_RULES: tuple[str, ...] = get_args(MemoryRule)
GIB = 2**30


@dataclass(frozen=True)
class MemoryPolicy:
    """How each rank picks what it keeps in device memory.

    Args:
        rules: device-name substring (case-insensitive, longest match wins, ``"*"`` any device) or ``"rank:N"``
            (wins over names) -> ``"auto"`` or a mode. ``None``: ``{"*": "auto"}``.
        headroom: fraction of each device's memory left free (allocator fragmentation, the CUDA context).
        activation_bytes_per_sample: activation memory one sample needs in a forward/backward without
            checkpointing. ``None``: not counted (the fit check then covers parameters, gradients and optimizer
            state only).
        checkpointed_fraction: the share of a sample's activations that checkpointing leaves in memory: the blocks'
            inputs, one block recomputed at a time, and everything outside the blocks (embeddings, logits, the loss),
            which no block checkpoint frees. It depends on the model (a large vocabulary keeps much outside).
    """

    rules: Optional[dict[str, MemoryRule]] = None
    headroom: float = 0.1
    activation_bytes_per_sample: Optional[int] = None
    checkpointed_fraction: float = 0.5

    @property
    def rank_rules(self) -> RankRules[str]:
        """The rules, checked (``None``: ``{"*": "auto"}``)."""
        return RankRules.parse("memory", {"*": "auto"} if self.rules is None else self.rules, _check_memory_rule)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", dict(self.rank_rules.rules))
        check("memory", "headroom", self.headroom, is_number(self.headroom) and 0 <= self.headroom < 1,
              "a number in [0, 1)")
        fraction = self.checkpointed_fraction
        check("memory", "checkpointed_fraction", fraction, is_number(fraction) and 0 < fraction <= 1,
              "a number in (0, 1]")
        per_sample = self.activation_bytes_per_sample
        check("memory", "activation_bytes_per_sample", per_sample, per_sample is None or (
            is_int(per_sample) and per_sample >= 0), "a non-negative integer or None")


def _check_memory_rule(key: str, mode: Any) -> str:
    if mode not in MEMORY_RULES:
        raise ValueError(f"`memory`[{key!r}]={mode!r} is not one of {MEMORY_RULES}.")
    return str(mode)


MemoryPolicyArg = Union[MemoryRule, dict[str, MemoryRule], MemoryPolicy]


def parse_memory_policy(value: MemoryPolicyArg) -> MemoryPolicy:
    """Validate the strategy's ``memory`` argument."""
    if isinstance(value, MemoryPolicy):
        return value
    if isinstance(value, str):
        if value not in MEMORY_RULES:
            raise ValueError(f"`memory`={value!r} is not one of {MEMORY_RULES}, a mapping or a MemoryPolicy.")
        return MemoryPolicy(rules={"*": value})  # type: ignore[dict-item]
    if isinstance(value, Mapping):
        return MemoryPolicy(rules=dict(value))
    raise ValueError(f"`memory`={value!r} must be a string, a mapping or a MemoryPolicy.")


def optimizer_slots(optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Parameter-sized tensors of optimizer state per parameter (Adam's two moments, SGD's momentum buffer)."""
    if optimizer is None:
        return 2  # not built yet: assume Adam, the common case and the larger
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if any(g.get("amsgrad", False) for g in optimizer.param_groups) else 2
    return 2


@dataclass(frozen=True)
class ModelFootprint:
    """What sharding a model costs each rank, independent of the rank (bytes)."""

    parameter_bytes: int  # the whole model's fp32 parameters
    largest_block_bytes: int  # the largest block's parameters, gathered while it computes
    blocks: int
    optimizer_slots: int

    @classmethod
    def of(cls, module: nn.Module, blocks: tuple[type[nn.Module], ...], slots: int) -> "ModelFootprint":
        def nbytes(m: nn.Module) -> int:
            return sum(p.numel() * p.element_size() for p in m.parameters())

        units = [m for m in module.modules() if m is not module and isinstance(m, blocks)]
        total = nbytes(module)
        block_bytes = [nbytes(m) for m in units] or [total]
        rest = total - sum(block_bytes) if units else 0  # parameters outside every block gather with the root
        return cls(total, max(max(block_bytes), rest), max(1, len(units)), slots)


@dataclass(frozen=True)
class RankMemory:
    """One rank's device-memory estimate under one mode (bytes)."""

    rank: int
    device: str
    mode: str
    shard: int  # parameters + gradients of its shard
    optimizer_state: int
    gathered: int  # parameters and gradients of the computing block, and the next one prefetched
    activations_per_sample: int
    samples: int
    budget: int  # device memory minus headroom

    @property
    def activations(self) -> int:
        return self.activations_per_sample * self.samples

    @property
    def needed(self) -> int:
        return self.shard + self.optimizer_state + self.gathered + self.activations

    @property
    def fits(self) -> bool:
        return self.needed <= self.budget

    def describe(self) -> str:
        return (
            f"rank {self.rank} ({self.device}, {self.mode}): parameters+gradients {self.shard / GIB:.3g} GiB, "
            f"optimizer state {self.optimizer_state / GIB:.3g} GiB, gathered blocks {self.gathered / GIB:.3g} GiB, "
            f"activations {self.activations_per_sample / 2**20:.3g} MiB/sample x {self.samples} = "
            f"{self.activations / GIB:.3g} GiB; needs {self.needed / GIB:.3g} GiB of {self.budget / GIB:.3g} GiB free"
        )


def estimate(footprint: ModelFootprint, mode: str, device: DeviceInfo, shard_ranks: int, samples: int,
             activation_bytes_per_sample: int, budget: int, checkpointed_fraction: float = 0.5) -> RankMemory:
    """A rank's device memory under ``mode``: offload moves shard, gradients and optimizer state to the host;
    checkpointing keeps ``checkpointed_fraction`` of the activations (at least two blocks' worth)."""
    shard = 2 * math.ceil(footprint.parameter_bytes / shard_ranks)
    state = footprint.optimizer_slots * math.ceil(footprint.parameter_bytes / shard_ranks)
    if "offload" in mode:
        shard, state = 0, 0
    per_sample = activation_bytes_per_sample
    if "checkpoint" in mode:
        per_sample = math.ceil(per_sample * max(checkpointed_fraction, min(1.0, 2 / footprint.blocks)))
    gathered = 2 * 2 * footprint.largest_block_bytes  # parameters + gradients, current block + prefetched one
    return RankMemory(device.rank, device.name, mode, shard, state, gathered, per_sample, samples, budget)


def micro_batch_gathered_bytes(footprint: ModelFootprint, micro_batches: int) -> int:
    """What a rank that runs its share in ``micro_batches`` > 1 pieces holds on its device beyond one-piece FSDP: the
    whole model's parameters, gathered at its first forward and kept until its last backward, and their unsharded
    gradient accumulated across the pieces (fp32 sizes). 0 for one piece: FSDP gathers block by block as usual."""
    return 0 if micro_batches <= 1 else 2 * footprint.parameter_bytes


def device_budget(device: DeviceInfo, headroom: float, free_bytes: Optional[int] = None) -> int:
    """Bytes a rank may fill: its free memory (measured on CUDA, else the device's total) minus the headroom."""
    available = device.memory_bytes if free_bytes is None else min(free_bytes, device.memory_bytes)
    return int(available * (1 - headroom))


class MemoryFitError(RuntimeError):
    """The job cannot fit on some rank under any mode the policy allows; the message has every rank's numbers."""


def resolve_memory(policy: MemoryPolicy, footprint: ModelFootprint, devices: Sequence[DeviceInfo],
                   samples: Sequence[int], budgets: Sequence[int], shard_ranks: int,
                   activation_bytes_per_sample: Optional[int] = None) -> list[RankMemory]:
    """Every rank's mode and estimate: the rule's mode, or under ``"auto"`` the first of :data:`MEMORY_MODES` that
    fits. Deterministic in its inputs, so every rank derives the same list. Raises :class:`MemoryFitError` naming
    every rank's numbers when some rank does not fit."""
    per_sample = policy.activation_bytes_per_sample
    if per_sample is None:
        per_sample = activation_bytes_per_sample or 0
    plans = []
    for device, count, budget in zip(devices, samples, budgets):
        rule = policy.rank_rules.for_device(device)
        modes = MEMORY_MODES if rule == "auto" else (rule,)
        options = [estimate(footprint, m, device, shard_ranks, count, per_sample, budget, policy.checkpointed_fraction)
                   for m in modes]
        plans.append(next((o for o in options if o.fits), options[-1]))
    short = [p for p in plans if not p.fits]
    if short:
        raise MemoryFitError(
            "the model does not fit: " + "; ".join(p.describe() for p in short)
            + ". Every rank: " + "; ".join(p.describe() for p in plans)
            + ". Allow 'offload'/'checkpoint' on the short ranks (`memory`), lower their share (`capacities`, "
            "`max_batch_per_rank`), or use more ranks."
        )
    return plans


def memory_column(plans: Sequence[RankMemory], policy: MemoryPolicy) -> list[str]:
    """Lab-table column: each rank's mode (``auto: ...`` when the policy chose it) and its estimate."""
    rules = policy.rank_rules
    column = []
    for p in plans:
        chosen = "auto: " if rules.lookup(p.rank, p.device) == "auto" else ""
        column.append(f"{chosen}{p.mode} {p.needed / GIB:.2g}/{p.budget / GIB:.2g} GiB")
    return column
