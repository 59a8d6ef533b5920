"""What each rank keeps in device memory under sharded training, and the check that it fits.

A rank's device holds its shard of the parameters, their gradients and the optimizer state (each 1/S of the model
over a shard group of S ranks), the gathered parameters and gradients of the block being computed, and the
activations of its b_r samples. A rank that runs its share as k > 1 micro-batches (``data.micro_batch``) keeps the
whole model's parameters gathered and its gradients unsharded from the first micro-batch's forward to the last one's
backward (:func:`micro_batch_gathered_bytes`), and holds the activations of one micro-batch at a time. Two choices
per block trade time for memory without changing the math:

- checkpoint: recompute the block's activations in the backward pass (one more forward of that block);
- offload: the block's shard, its gradients and their optimizer state live in host memory (the optimizer steps there).

A rank's plan is how many blocks do each, counted from the first block in module order: ``"offload:4"``,
``"checkpoint:10"``, ``"offload:4,checkpoint:all"``. The whole-rank spellings stay: ``"keep"`` (no block),
``"checkpoint"`` / ``"offload"`` (every block; an offloaded rank's root parameters too) and ``"checkpoint_offload"``.
Only placement and recomputation differ per rank: the block boundaries and the collectives' dtypes are the job's.

The ``memory`` policy, in the style of ``precision_policy``: ``"auto"`` (per rank, the fewest offloaded blocks, then
the fewest recomputed ones, that fit its budget: recomputing a block costs a fraction of its step, offloading one moves
its optimizer step to the CPU), one rule for all, or a mapping from device-name substring or ``"rank:N"`` to a rule.
One choice is the job's, not a rank's: ``keep_gathered`` (every block's parameters held gathered from its forward to
its backward, one all-gather per block and step instead of two), which ``"auto"`` takes where every rank's plan
still fits with it (:func:`resolve_memory`).
A job that cannot fit fails before its first step, naming each rank's numbers; after the first steps the measured peak
of each rank is set beside its estimate (:func:`peak_report`).

Example::

    >>> HeteroFSDPStrategy(memory="auto")
    >>> HeteroFSDPStrategy(memory={"3090": "offload:6,checkpoint:all", "A100": "keep"})
    >>> HeteroFSDPStrategy(memory=MemoryPolicy(rules={"rank:2": "offload", "*": "auto"}, headroom=0.15))
    >>> HeteroFSDPStrategy(memory=MemoryPolicy(granularity="rank"))  # one whole-rank mode each, as before
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, get_args

import torch
from torch import nn

from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.config import check, check_choice, is_int, is_number
from lightning_hetero.plan.activations import StepBytes
from lightning_hetero.plan.blocks import top_level_blocks
from lightning_hetero.rules import RankRules

MemoryMode = Literal["keep", "checkpoint", "offload", "checkpoint_offload"]
MEMORY_MODES: tuple[str, ...] = get_args(MemoryMode)  # in the order whole-rank "auto" tries them: fastest first
MEMORY_RULES: tuple[str, ...] = ("auto",) + MEMORY_MODES
# A rule: "auto", a whole-rank mode, or per-block counts ("offload:N", "checkpoint:N", "offload:N,checkpoint:M";
# N a number of blocks or "all").
MemoryRule = str
Granularity = Literal["block", "rank"]
GIB = 2**30
# A plan whose estimate comes this close to its budget says so: an allocator fragment more and the rank is out.
NEAR_BUDGET = 0.02
_BLOCK_RULE_HINT = "or per-block counts such as 'offload:4', 'checkpoint:all', 'offload:4,checkpoint:10'"


@dataclass(frozen=True)
class BlockCounts:
    """A rule's block counts; ``None``: every block (known once the model is)."""

    offload: Optional[int]
    checkpoint: Optional[int]


def parse_rule(rule: str, where: str = "`memory`") -> BlockCounts:
    """The block counts a whole-rank mode or a per-block rule names; ``ValueError`` naming ``where`` otherwise."""
    whole = {"keep": (0, 0), "checkpoint": (0, None), "offload": (None, 0), "checkpoint_offload": (None, None)}
    if isinstance(rule, str) and rule in whole:
        return BlockCounts(*whole[rule])
    counts: dict[str, Optional[int]] = {"offload": 0, "checkpoint": 0}
    seen: set[str] = set()
    for part in rule.split(",") if isinstance(rule, str) and rule else [""]:
        name, _, value = part.strip().partition(":")
        if name not in counts or name in seen or not (value == "all" or value.isdigit()):
            raise ValueError(f"{where}={rule!r} is not one of {MEMORY_RULES}, {_BLOCK_RULE_HINT}.")
        seen.add(name)
        counts[name] = None if value == "all" else int(value)
    return BlockCounts(counts["offload"], counts["checkpoint"])


def rule_name(offload: int, checkpoint: int, blocks: int) -> str:
    """The canonical rule for block counts: a whole-rank mode's name where one fits, else ``offload:N,checkpoint:M``
    (parsed back by :func:`parse_rule`)."""
    whole = {(0, 0): "keep", (0, blocks): "checkpoint", (blocks, 0): "offload", (blocks, blocks): "checkpoint_offload"}
    if (offload, checkpoint) in whole:
        return whole[(offload, checkpoint)]
    parts = [f"{name}:{'all' if n == blocks else n}" for name, n in (("offload", offload), ("checkpoint", checkpoint))
             if n]
    return ",".join(parts)


# How the parameters in host memory are stepped (:mod:`lightning_hetero.grad.host_optimizer`).
HostStepMode = Literal["overlap", "fused", "plain"]
HOST_STEP_MODES: tuple[str, ...] = get_args(HostStepMode)


@dataclass(frozen=True)
class HostStepConfig:
    """How offloaded parameters are stepped.

    Args:
        mode: ``"overlap"`` (fused, each block started as its gradient arrives, where exact; else fused),
            ``"fused"`` (torch's fused CPU kernel after the backward) or ``"plain"`` (the user's optimizer as is).
        threads: intra-op threads of the host step (``None``: this process's ``torch.get_num_threads()``).
    """

    mode: HostStepMode = "overlap"
    threads: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice("memory", "host_step", self.mode, HOST_STEP_MODES)
        threads = self.threads
        check("memory", "host_threads", threads, threads is None or (is_int(threads) and threads > 0),
              "None or a positive integer")


@dataclass(frozen=True)
class MemoryPolicy:
    """How each rank picks what it keeps in device memory.

    Args:
        rules: device-name substring (case-insensitive, longest match wins, ``"*"`` any device) or ``"rank:N"``
            (wins over names) -> ``"auto"``, a whole-rank mode or per-block counts (``"offload:4,checkpoint:all"``).
            ``None``: ``{"*": "auto"}``.
        headroom: fraction of each device's memory left free (allocator fragmentation, the CUDA context).
        activation_bytes_per_sample: activation memory one sample needs in a forward/backward without
            checkpointing. ``None``: not counted (the fit check then covers parameters, gradients and optimizer
            state only).
        checkpointed_fraction: the share of a sample's activations that checkpointing leaves in memory: the blocks'
            inputs, one block recomputed at a time, and everything outside the blocks (embeddings, logits, the loss),
            which no block checkpoint frees. It depends on the model (a large vocabulary keeps much outside).
        granularity: what ``"auto"`` chooses: ``"block"`` (how many blocks offload and recompute, filling each card
            to its budget) or ``"rank"`` (the first whole-rank mode that fits: keep, checkpoint, offload, both).
        measure: before the first step, measure each rank's step (a trial forward and backward of its share and of
            half of it, under its plan; see :mod:`lightning_hetero.plan.activations`) and check and report that
            instead of the counted activations. ``False``: count (for a training step whose side effects a trial
            would disturb: the trial restores parameters, gradients, buffers, random state and the modules' plain
            attributes only).
        keep_gathered: keep each block's gathered parameters from its forward to its backward (FSDP's
            ``reshard_after_forward=False``) on every rank: one all-gather per block and step instead of two, a third
            less traffic on a slow link, for the whole model's parameters held on each device (counted by the plan).
            ``"auto"``: kept where every rank's plan still fits with them held (the blocks it offloads and recomputes
            unchanged), else resharded. One setting for the job: it decides which collectives every rank joins.
        host_step: how the parameters in host memory (offloaded blocks) are stepped
            (:mod:`lightning_hetero.grad.host_optimizer`): ``"overlap"`` (torch's fused CPU Adam/AdamW, each block
            started as soon as its gradient is on the host, while the backward goes on; after the backward where
            that would not be exact, e.g. with gradient clipping), ``"fused"`` (after the backward) or ``"plain"``
            (the optimizer's own step). Other optimizers than Adam/AdamW step as they are.
        host_threads: intra-op threads of the host step (``None``: the process's ``torch.get_num_threads()``).
    """

    rules: Optional[dict[str, MemoryRule]] = None
    headroom: float = 0.1
    activation_bytes_per_sample: Optional[int] = None
    checkpointed_fraction: float = 0.5
    granularity: Granularity = "block"
    measure: bool = True
    keep_gathered: Union[bool, Literal["auto"]] = "auto"
    host_step: HostStepMode = "overlap"
    host_threads: Optional[int] = None

    @property
    def host(self) -> HostStepConfig:
        """The host step's settings."""
        return HostStepConfig(self.host_step, self.host_threads)

    @property
    def rank_rules(self) -> RankRules[str]:
        """The rules, checked (``None``: ``{"*": "auto"}``)."""
        return RankRules.parse("memory", {"*": "auto"} if self.rules is None else self.rules, _check_memory_rule)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", dict(self.rank_rules.rules))
        check("memory", "headroom", self.headroom, is_number(self.headroom) and 0 <= self.headroom < 1,
              "a number in [0, 1)")
        check("memory", "granularity", self.granularity, self.granularity in get_args(Granularity),
              f"one of {get_args(Granularity)}")
        check("memory", "measure", self.measure, isinstance(self.measure, bool), "True or False")
        keep = self.keep_gathered
        check("memory", "keep_gathered", keep, isinstance(keep, bool) or keep == "auto", "True, False or 'auto'")
        self.host  # checks host_step and host_threads
        fraction = self.checkpointed_fraction
        check("memory", "checkpointed_fraction", fraction, is_number(fraction) and 0 < fraction <= 1,
              "a number in (0, 1]")
        per_sample = self.activation_bytes_per_sample
        check("memory", "activation_bytes_per_sample", per_sample, per_sample is None or (
            is_int(per_sample) and per_sample >= 0), "a non-negative integer or None")


def _check_memory_rule(key: str, mode: Any) -> str:
    if mode != "auto":
        parse_rule(mode, f"`memory`[{key!r}]")
    return str(mode)


MemoryPolicyArg = Union[MemoryRule, dict[str, MemoryRule], MemoryPolicy]


def parse_memory_policy(value: MemoryPolicyArg) -> MemoryPolicy:
    """Validate the strategy's ``memory`` argument."""
    if isinstance(value, MemoryPolicy):
        return value
    if isinstance(value, str):
        if value != "auto":
            try:
                parse_rule(value)
            except ValueError:
                raise ValueError(f"`memory`={value!r} is not one of {MEMORY_RULES}, {_BLOCK_RULE_HINT}, a mapping or "
                                 "a MemoryPolicy.") from None
        return MemoryPolicy(rules={"*": value})
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
    blocks: int  # top-level blocks: the units a plan counts
    optimizer_slots: int
    outside_bytes: int = 0  # parameters outside every block (embeddings, heads): sharded with the root

    @classmethod
    def of(cls, module: nn.Module, blocks: tuple[type[nn.Module], ...], slots: int) -> "ModelFootprint":
        def nbytes(m: nn.Module) -> int:
            return sum(p.numel() * p.element_size() for p in m.parameters())

        units = top_level_blocks(module, blocks)
        total = nbytes(module)
        block_bytes = [nbytes(m) for m in units] or [total]
        rest = total - sum(block_bytes) if units else 0
        return cls(total, max(max(block_bytes), rest), max(1, len(units)), slots, rest)

    def block_state_bytes(self, offloaded: int) -> int:
        """Parameters of the first ``offloaded`` blocks (the mean block's size each; the root's too with all)."""
        if offloaded >= self.blocks:
            return self.parameter_bytes
        return (self.parameter_bytes - self.outside_bytes) * offloaded // self.blocks


@dataclass(frozen=True)
class RankMemory:
    """One rank's device-memory estimate under one plan (bytes)."""

    rank: int
    device: str
    mode: str  # the plan as a rule (:func:`rule_name`): "keep", "offload", "offload:4,checkpoint:all" ...
    shard: int  # parameters + gradients of its shard kept on the device
    optimizer_state: int
    gathered: int  # parameters and gradients of the computing block, and the next one prefetched
    activations_per_sample: int
    samples: int
    budget: int  # device memory minus headroom
    offload_blocks: int = 0
    checkpoint_blocks: int = 0
    blocks: int = 1
    # Pieces the rank runs its share in; ``samples`` is then the largest piece's (activations exist for one at a time).
    micro_batches: int = 1
    # Where the step's bytes come from: "formula" (counted from the model's sizes and the policy), or measured by a
    # forward and backward at setup (:mod:`lightning_hetero.plan.activations`: "allocator", "live tensors").
    source: str = "formula"
    resident: int = 0  # measured: what the device holds besides the model's state (buffers, kernel workspaces)
    keep_gathered: bool = False  # the job's blocks stay gathered from forward to backward (:class:`MemoryPolicy`)

    @property
    def activations(self) -> int:
        return self.activations_per_sample * self.samples

    @property
    def needed(self) -> int:
        return self.shard + self.optimizer_state + self.gathered + self.activations + self.resident

    @property
    def fits(self) -> bool:
        return self.needed <= self.budget

    @property
    def near_budget(self) -> bool:
        """It fits with less than :data:`NEAR_BUDGET` of its budget to spare."""
        return self.fits and self.needed > (1 - NEAR_BUDGET) * self.budget

    @property
    def gathered_what(self) -> str:
        if self.micro_batches <= 1:
            return "blocks kept gathered forward to backward" if self.keep_gathered else "gathered blocks"
        return f"model gathered over {self.micro_batches} micro-batches"

    @property
    def per_piece(self) -> str:
        return "" if self.micro_batches <= 1 else " (one micro-batch)"

    @property
    def resident_part(self) -> str:
        return f", other resident {self.resident / GIB:.3g} GiB" if self.resident else ""

    def describe(self) -> str:
        return (
            f"rank {self.rank} ({self.device}, {self.mode}): parameters+gradients {self.shard / GIB:.3g} GiB, "
            f"optimizer state {self.optimizer_state / GIB:.3g} GiB, "
            f"{self.gathered_what} {self.gathered / GIB:.3g} GiB, "
            f"activations {self.activations_per_sample / 2**20:.3g} MiB/sample x {self.samples}{self.per_piece} = "
            f"{self.activations / GIB:.3g} GiB{self.resident_part}; needs {self.needed / GIB:.3g} GiB of "
            f"{self.budget / GIB:.3g} GiB free"
            f" ({'measured: ' + self.source if self.source != 'formula' else 'formula'}"
            f"{', within 2 % of its budget' if self.near_budget else ''})"
        )


def estimate(footprint: ModelFootprint, mode: str, device: DeviceInfo, shard_ranks: int, samples: int,
             activation_bytes_per_sample: int, budget: int, checkpointed_fraction: float = 0.5,
             micro_limit: Optional[int] = None, step: Optional[StepBytes] = None,
             keep_gathered: bool = False) -> RankMemory:
    """A rank's device memory under ``mode`` (a whole-rank mode or per-block counts, see :func:`parse_rule`):
    offloaded blocks keep their shard, gradients and optimizer state on the host; each checkpointed block frees its
    share of the activations, down to ``checkpointed_fraction`` of them (at least two blocks' worth) with all.
    ``micro_limit``: the rank's samples per forward/backward (``data.micro_batch``); a share above it runs as several
    micro-batches (:func:`micro_batches`), which hold the whole model gathered and one micro-batch's activations.
    ``step``: the rank's step bytes measured under ``mode``
    (:func:`~lightning_hetero.plan.activations.measure_step_bytes`): they replace the counted activations, and the
    gathered blocks with what the step holds whatever its batch; what the device held besides the model's state is
    added (``resident``). ``keep_gathered``: every block's parameters stay
    gathered from its forward to its backward (:class:`MemoryPolicy`), the whole model's counted at fp32 size (a bound
    under bf16 collectives; a measured step holds them already)."""
    counts = parse_rule(mode)
    n = footprint.blocks
    offload = n if counts.offload is None else counts.offload
    checkpoint = n if counts.checkpoint is None else counts.checkpoint
    if offload > n or checkpoint > n:
        raise ValueError(f"`memory` rule {mode!r} for rank {device.rank} names more blocks than the model's {n}.")
    on_device = footprint.parameter_bytes - footprint.block_state_bytes(offload)
    shard = 2 * math.ceil(on_device / shard_ranks)
    state = footprint.optimizer_slots * math.ceil(on_device / shard_ranks)
    kept_fraction = max(checkpointed_fraction, min(1.0, 2 / n))
    per_sample = math.ceil(activation_bytes_per_sample * (1 - (1 - kept_fraction) * checkpoint / n))
    pieces, piece_samples = micro_batches(samples, micro_limit)
    # Parameters + gradients of the computing block and the prefetched one; with micro-batches the whole model's,
    # offloaded blocks included (they are gathered on the device like the others).
    gathered = max(2 * 2 * footprint.largest_block_bytes, micro_batch_gathered_bytes(footprint, pieces))
    if keep_gathered and pieces <= 1:
        gathered += footprint.parameter_bytes
    source, resident = "formula", 0
    if step is not None:
        # What the step holds over its resting state. The gradients `shard` counts are the last step's: alive through
        # the forward (Lightning frees them before the backward), when the peak is often reached. The trial ran one
        # piece with its blocks gathered one at a time: micro-batches add the whole model held gathered (a bound).
        gathered = step.fixed + micro_batch_gathered_bytes(footprint, pieces)
        per_sample, source, resident = step.per_sample, step.source, step.resident
    return RankMemory(device.rank, device.name, rule_name(offload, checkpoint, n), shard, state, gathered, per_sample,
                      piece_samples, budget, offload, checkpoint, n, pieces, source, resident, keep_gathered)


def micro_batches(samples: int, micro_limit: Optional[int]) -> tuple[int, int]:
    """How many micro-batches a share of ``samples`` runs as under ``micro_limit`` (``None``: whole), and the largest
    one's samples, as the training step splits it (:func:`~lightning_hetero.data.microbatch.chunk_sizes`).

    Example::

        >>> micro_batches(6, 2), micro_batches(6, None), micro_batches(5, 2)
        ((3, 2), (1, 6), (3, 2))
    """
    if not micro_limit or samples <= micro_limit:
        return 1, samples
    pieces = math.ceil(samples / micro_limit)
    return pieces, math.ceil(samples / pieces)


def micro_batch_gathered_bytes(footprint: ModelFootprint, micro_batches: int) -> int:
    """What a rank that runs its share in ``micro_batches`` > 1 pieces holds gathered on its device: the whole
    model's parameters, gathered at its first forward and kept until its last backward, and their unsharded gradient
    accumulated across the pieces (fp32 sizes: an upper bound under bf16 collectives). 0 for one piece: FSDP gathers
    block by block (:func:`estimate` counts the computing block and the prefetched one)."""
    return 0 if micro_batches <= 1 else 2 * footprint.parameter_bytes


def device_budget(device: DeviceInfo, headroom: float, free_bytes: Optional[int] = None) -> int:
    """Bytes a rank may fill: its free memory (measured on CUDA, else the device's total) minus the headroom."""
    available = device.memory_bytes if free_bytes is None else min(free_bytes, device.memory_bytes)
    return int(available * (1 - headroom))


class MemoryFitError(RuntimeError):
    """The job cannot fit on some rank under any plan the policy allows; the message has every rank's numbers."""


def _auto_plan(footprint: ModelFootprint, granularity: str, estimate_for: Callable[[str], RankMemory]) -> RankMemory:
    """The fastest plan that fits: whole-rank modes in :data:`MEMORY_MODES` order, or per block the fewest offloaded
    blocks and, with those, the fewest checkpointed ones. ``estimate_for(rule)`` estimates one rule."""
    if granularity == "rank":
        options = [estimate_for(m) for m in MEMORY_MODES]
        return next((o for o in options if o.fits), options[-1])
    n = footprint.blocks
    for offload in range(n + 1):
        everything = estimate_for(rule_name(offload, n, n))
        if not everything.fits:
            continue
        # Activations shrink with each checkpointed block: bisect the fewest that fit.
        low, high = -1, n
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if estimate_for(rule_name(offload, middle, n)).fits else (middle, high)
        return estimate_for(rule_name(offload, high, n))
    return estimate_for(rule_name(n, n, n))


def resolve_memory(policy: MemoryPolicy, footprint: ModelFootprint, devices: Sequence[DeviceInfo],
                   samples: Sequence[int], budgets: Sequence[int], shard_ranks: int,
                   activation_bytes_per_sample: Optional[int] = None,
                   micro_limits: Optional[Sequence[Optional[int]]] = None,
                   steps: Optional[Sequence[Optional[StepBytes]]] = None) -> list[RankMemory]:
    """Every rank's plan and estimate: the rule's, or under ``"auto"`` the fastest that fits (see
    :func:`_auto_plan`), and the job's ``keep_gathered`` (:func:`_keep_gathered`). ``micro_limits``: each rank's
    samples per forward/backward (``None``: no micro-batches), so a rank that splits its share is planned with the
    model gathered across its micro-batches and one micro-batch's activations. ``steps``: each rank's step bytes
    measured under its rule (``None``: counted); ``"auto"`` (a rule or ``keep_gathered``) with a measurement is an
    error (the measurement holds for the plan it ran). Deterministic in its inputs, so every rank derives the same
    list. Raises :class:`MemoryFitError` naming every rank's numbers when some rank does not fit."""
    per_sample = policy.activation_bytes_per_sample
    if per_sample is None:
        per_sample = activation_bytes_per_sample or 0
    limits = list(micro_limits) if micro_limits is not None else [None] * len(devices)
    measured = list(steps) if steps is not None else [None] * len(devices)
    if policy.keep_gathered == "auto" and any(s is not None for s in measured):
        raise ValueError("a measured step holds for the plan it ran, not for `memory.keep_gathered` 'auto'.")
    plans, estimators = [], []
    for device, count, budget, limit, step in zip(devices, samples, budgets, limits, measured):
        rule = policy.rank_rules.for_device(device)
        if rule == "auto" and step is not None:
            raise ValueError(f"rank {device.rank}: a measured step holds for the plan it ran, not for `memory` 'auto'.")

        def estimate_for(mode: str, keep: bool = policy.keep_gathered is True, device: DeviceInfo = device,
                         count: int = count, budget: int = budget, limit: Optional[int] = limit,
                         step: Optional[StepBytes] = step) -> RankMemory:
            return estimate(footprint, mode, device, shard_ranks, count, per_sample, budget,
                            policy.checkpointed_fraction, limit, step, keep)

        plans.append(_auto_plan(footprint, policy.granularity, estimate_for) if rule == "auto" else estimate_for(rule))
        estimators.append(estimate_for)
    if policy.keep_gathered == "auto" and shard_ranks > 1:  # a shard group of one gathers nothing over a link
        plans = _keep_gathered(plans, estimators)
    short = [p for p in plans if not p.fits]
    if short:
        # A rank that splits its share holds the whole model gathered: running it whole may be what fits.
        split = any(p.micro_batches > 1 for p in short)
        raise MemoryFitError(
            "the model does not fit: " + "; ".join(p.describe() for p in short)
            + ". Every rank: " + "; ".join(p.describe() for p in plans)
            + ". Allow 'offload'/'checkpoint' on the short ranks (`memory`), lower their share (`capacities`, "
            "`max_batch_per_rank`), "
            + ("run their share whole (`data.micro_batch`: several micro-batches hold the whole model gathered), "
               if split else "")
            + ("set `memory.keep_gathered` to 'auto' or False (True holds every block's parameters from its forward "
               "to its backward), " if policy.keep_gathered is True else "")
            + "or use more ranks."
        )
    return plans


def _keep_gathered(plans: list[RankMemory], estimators: Sequence[Callable[..., RankMemory]]) -> list[RankMemory]:
    """``keep_gathered="auto"``: the plans with every block kept gathered from its forward to its backward where each
    rank's plan (its offloaded and recomputed blocks as chosen without) still fits with that, else ``plans``. One
    choice for the job: a rank that kept its blocks gathered would skip the backward's all-gathers the others join.
    It is taken only where it costs no block recomputed or offloaded more, and with shard groups of more than one rank
    (one rank's all-gather is a local copy: nothing to save for the memory it would hold)."""
    kept = [estimate_for(p.mode, True) for p, estimate_for in zip(plans, estimators)]
    return kept if all(p.fits for p in kept) else plans


def memory_column(plans: Sequence[RankMemory], policy: MemoryPolicy) -> list[str]:
    """Lab-table column: each rank's plan (``auto: ...`` when the policy chose it), its estimate, and the blocks kept
    gathered from forward to backward where they are (``(auto)`` when the policy chose it; ``resharded (auto)`` when
    it chose not to)."""
    rules = policy.rank_rules
    auto = " (auto)" if policy.keep_gathered == "auto" else ""
    column = []
    for p in plans:
        chosen = "auto: " if rules.lookup(p.rank, p.device) == "auto" else ""
        pieces = ""
        if p.micro_batches > 1:
            pieces = f", {p.micro_batches} micro-batches: {p.gathered / GIB:.2g} GiB gathered"
        kept = f", kept gathered{auto}" if p.keep_gathered else (f", resharded{auto}" if auto else "")
        column.append(f"{chosen}{p.mode} {p.needed / GIB:.2g}/{p.budget / GIB:.2g} GiB{pieces}{kept}")
    return column


def measured_peak(device: torch.device) -> Optional[int]:
    """This rank's peak allocated device memory so far (CUDA's caching allocator); ``None`` elsewhere."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def peak_report(plans: Sequence[RankMemory], peaks: Sequence[Optional[int]], headroom_bytes: Sequence[int],
                steps: int) -> tuple[str, list[int]]:
    """A table of each rank's plan, estimate and measured peak after ``steps`` steps, and the ranks whose estimate
    was low by more than their headroom (the bytes the plan left free for what it does not count).

    Example::

        >>> text, low = peak_report(strategy.memory_plan, [26 * GIB, None], [8 * GIB, 2 * GIB], steps=2)
    """
    rows = [("rank", "device", "plan", "estimate", "from", "peak", "peak - estimate")]
    low = []
    for p, peak, spare in zip(plans, peaks, headroom_bytes):
        gap = "n/a" if peak is None else f"{(peak - p.needed) / GIB:+.2f} GiB ({(peak - p.needed) / p.needed:+.1%})"
        rows.append((str(p.rank), p.device, p.mode, f"{p.needed / GIB:.2f} GiB", p.source,
                     "n/a" if peak is None else f"{peak / GIB:.2f} GiB", gap))
        if peak is not None and peak - p.needed > spare:
            low.append(p.rank)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return f"memory plan against the measured peak after {steps} steps (peak: torch.cuda.max_memory_allocated):\n" \
        + "\n".join(lines), low


def report_peaks(plans: Sequence[RankMemory], devices: Sequence[DeviceInfo], headroom: float, device: torch.device,
                 steps: int, rank: int) -> list[Optional[int]]:
    """Gather every rank's measured peak (a collective), log the :func:`peak_report` table on rank 0 and warn about
    estimates that were low by more than their headroom. Returns the peaks by rank."""
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    peaks: list[Optional[int]] = [measured_peak(device)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, measured_peak(device))
    spare = [int(d.memory_bytes * headroom) for d in devices]
    text, low = peak_report(plans, peaks, spare, steps)
    if rank == 0:
        rank_zero_info(text)
        if low:
            rank_zero_warn(
                "the memory plan's estimate was low by more than its headroom on "
                + ", ".join(f"rank {r} ({plans[r].needed / GIB:.2f} GiB planned, peak {(peaks[r] or 0) / GIB:.2f} "
                            f"GiB, headroom {spare[r] / GIB:.2f} GiB)" for r in low)
                + ": raise `memory.headroom` or give `memory.activation_bytes_per_sample`, or the rank may run out "
                "of memory on a longer or larger step."
            )
    return peaks
