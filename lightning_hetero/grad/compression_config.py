"""What users choose for gradient communication: frozen, JSON-able configs and the parsing of ``compression=``.

Nothing here talks to a process group. The hooks that carry out a config are in
:mod:`~lightning_hetero.grad.compress_hooks` and :mod:`~lightning_hetero.grad.powersgd_hook`; the runtime that picks
and composes them for one DDP model is :mod:`~lightning_hetero.grad.compression`; the measurement behind
``compression="auto"`` is :mod:`~lightning_hetero.grad.autocompress`.

Example::
    >>> trainer = Trainer(strategy=HeteroDDPStrategy(compression=TopKCompression(ratio=0.01, warmup_steps=100)))
    >>> # LightningCLI YAML:
    >>> # strategy: {class_path: lightning_hetero.HeteroDDPStrategy,
    >>> #            init_args: {compression: {class_path: lightning_hetero.PowerSGDCompression,
    >>> #                                      init_args: {rank: 4, hierarchical: true}}}}
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_hetero.config import check, is_int, is_number

CompressionName = Literal["none", "fp16", "bf16", "powersgd", "topk", "auto"]
GroupBy = Literal["host", "class"]


def _check_hop(cls: str, hierarchical: Any, group_by: Any) -> None:
    check(cls, "hierarchical", hierarchical, isinstance(hierarchical, bool), "True or False")
    check(cls, "group_by", group_by, group_by in ("host", "class"), '"host" or "class"')


@dataclass(frozen=True)


class NoCompression:
    """Full-precision all-reduce. ``hierarchical=True``: reduce inside each ``group_by`` group first, exchange one sum
    per group among the leaders, broadcast back (the two-level sync without compression)."""

    hierarchical: bool = True
    group_by: GroupBy = "host"

    def __post_init__(self) -> None:
        _check_hop("NoCompression", self.hierarchical, self.group_by)

    def describe(self) -> str:
        return "fp32"


@dataclass(frozen=True)


class CastCompression:
    """All-reduce in half precision. ``hierarchical``: cast only on the hop between ``group_by`` groups."""

    dtype: Literal["fp16", "bf16"] = "fp16"
    hierarchical: bool = False
    group_by: GroupBy = "host"

    def __post_init__(self) -> None:
        check("CastCompression", "dtype", self.dtype, self.dtype in ("fp16", "bf16"), '"fp16" or "bf16"')
        _check_hop("CastCompression", self.hierarchical, self.group_by)

    def describe(self) -> str:
        return self.dtype


@dataclass(frozen=True)


class PowerSGDCompression:
    """torch's PowerSGD. ``start_iter`` steps of plain all-reduce come first (> 1 with error feedback / warm start,
    because DDP rebuilds its buckets after step 1); tensors below ``min_compression_rate`` go uncompressed."""

    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0
    hierarchical: bool = False
    group_by: GroupBy = "host"

    def __post_init__(self) -> None:
        c = "PowerSGDCompression"
        check(c, "rank", self.rank, is_int(self.rank) and self.rank >= 1, "a positive integer")
        check(c, "start_iter", self.start_iter, is_int(self.start_iter) and self.start_iter >= 0,
               "a non-negative integer")
        check(c, "warm_start", self.warm_start, isinstance(self.warm_start, bool), "True or False")
        check(c, "error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "True or False")
        if (self.warm_start or self.error_feedback) and self.start_iter < 2:
            raise ValueError(
                f"`PowerSGDCompression.start_iter`={self.start_iter!r} must be >= 2 with error feedback or warm start: "
                "DDP rebuilds its buckets after the first step."
            )
        check(c, "min_compression_rate", self.min_compression_rate,
               is_number(self.min_compression_rate) and self.min_compression_rate >= 0, ">= 0")
        check(c, "orthogonalization_epsilon", self.orthogonalization_epsilon,
               is_number(self.orthogonalization_epsilon) and self.orthogonalization_epsilon >= 0, ">= 0")
        check(c, "seed", self.seed, is_int(self.seed) and self.seed >= 0, "a non-negative integer")
        _check_hop(c, self.hierarchical, self.group_by)

    def describe(self) -> str:
        return f"powersgd(r={self.rank})"


@dataclass(frozen=True)


class TopKCompression:
    """Top-k sparsification with error feedback and Deep Gradient Compression's momentum correction.

    During ``warmup_steps`` the kept fraction decays exponentially from ``warmup_ratio`` to ``ratio``.

    ``momentum`` > 0 moves the optimizer's momentum into the hook (DGC's momentum correction): each rank keeps a
    velocity ``u = momentum * u + g`` of its own (weighted) gradient, accumulates ``u`` into the residual and sends
    the largest entries of that. Accumulating gradients alone and applying momentum after the sparse exchange
    would lose the momentum of every entry that waited. **Contract:** the optimizer then receives the velocity and
    must not add momentum of its own: ``SGD(momentum=0)`` (or ``Adam(betas=(0, beta2))``); the strategy warns at
    setup when it does. ``momentum_masking`` zeroes the velocity of the entries just sent (DGC's momentum factor
    masking: their momentum was applied with them and would otherwise push them again, stale). With ``ratio=1``,
    ``momentum_masking=False`` is exactly SGD with momentum, and ``momentum_masking=True`` exactly SGD without.
    """

    ratio: float = 0.01
    warmup_steps: int = 0
    warmup_ratio: float = 0.25
    error_feedback: bool = True
    momentum: float = 0.0
    momentum_masking: bool = True
    hierarchical: bool = False
    group_by: GroupBy = "host"

    def __post_init__(self) -> None:
        c = "TopKCompression"
        check(c, "ratio", self.ratio, is_number(self.ratio) and 0 < self.ratio <= 1, "in (0, 1]")
        check(c, "warmup_steps", self.warmup_steps, is_int(self.warmup_steps) and self.warmup_steps >= 0,
               "a non-negative integer")
        check(c, "warmup_ratio", self.warmup_ratio, is_number(self.warmup_ratio)
               and (self.warmup_steps == 0 or self.ratio <= self.warmup_ratio <= 1), f"in [ratio={self.ratio}, 1]")
        check(c, "error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "True or False")
        check(c, "momentum", self.momentum, isinstance(self.momentum, (int, float)) and not isinstance(
            self.momentum, bool) and 0 <= self.momentum < 1, "in [0, 1)")
        check(c, "momentum_masking", self.momentum_masking, isinstance(self.momentum_masking, bool), "True or False")
        _check_hop(c, self.hierarchical, self.group_by)

    def ratio_at(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.ratio
        return self.warmup_ratio * (self.ratio / self.warmup_ratio) ** (step / self.warmup_steps)

    def describe(self) -> str:
        return f"topk({self.ratio:g})"



@dataclass(frozen=True)


class AutoCompression:
    """Measure the links at setup, then choose (the table is in :mod:`~lightning_hetero.grad.autocompress`).

    Args:
        step_seconds: compute time of one optimizer step, if known; ``None``: judge exposure by ``exposed_seconds``.
        exposed_fraction: share of ``step_seconds`` the fp32 exchange may take before it counts as exposed.
        exposed_seconds: the fp32 exchange time counted as exposed when ``step_seconds`` is not given.
        strong: the method on Ethernet-class links when even a bf16 exchange would be exposed. ``"bf16"`` by
            default: on a 98M GPT over 300 steps (2x H200, 2.6 GB/s) PowerSGD rank 4 and top-k 1 % with momentum
            correction ended 1.46x and 1.66x above the uncompressed held-out loss, fp16 1.04x, so the lossy methods
            are opt-in (``"powersgd"``, ``"topk"``) for users who have checked convergence on their model.
        probe_mb: size of the timed all-reduce.
    """

    step_seconds: Optional[float] = None
    exposed_fraction: float = 0.25
    exposed_seconds: float = 0.02
    strong: Literal["bf16", "powersgd", "topk"] = "bf16"
    probe_mb: float = 16.0

    def __post_init__(self) -> None:
        c = "AutoCompression"
        check(c, "step_seconds", self.step_seconds, self.step_seconds is None or (
            isinstance(self.step_seconds, (int, float)) and self.step_seconds > 0), "None or > 0")
        check(c, "exposed_fraction", self.exposed_fraction,
               isinstance(self.exposed_fraction, (int, float)) and 0 < self.exposed_fraction <= 1, "in (0, 1]")
        check(c, "exposed_seconds", self.exposed_seconds,
               isinstance(self.exposed_seconds, (int, float)) and self.exposed_seconds >= 0, ">= 0")
        check(c, "strong", self.strong, self.strong in ("bf16", "powersgd", "topk"),
               '"bf16", "powersgd" or "topk"')
        check(c, "probe_mb", self.probe_mb, isinstance(self.probe_mb, (int, float)) and 0 < self.probe_mb <= 1024,
               "in (0, 1024]")

    @property
    def hierarchical(self) -> bool:
        # For code that reads it off any config before the choice is made
        return False

    def describe(self) -> str:
        return "auto"


CompressionConfig = Union[NoCompression, CastCompression, PowerSGDCompression, TopKCompression]
CompressionArg = Union[CompressionName, NoCompression, CastCompression, PowerSGDCompression, TopKCompression]


def parse_compression(compression: Any) -> Any:
    """The typed config for ``compression`` (``None`` for ``"none"``; an
    :class:`AutoCompression` for ``"auto"``, resolved once the links are measured);
    a ValueError for anything else."""
    if isinstance(compression, (NoCompression, CastCompression, PowerSGDCompression, TopKCompression,
                                AutoCompression)):
        return compression
    if compression == "auto":
        return AutoCompression()
    if compression is None or compression == "none":
        return None
    if compression in ("fp16", "bf16"):
        return CastCompression(dtype=compression)
    if compression == "powersgd":
        return PowerSGDCompression()
    if compression == "topk":
        return TopKCompression()
    raise ValueError(
        f"`compression`={compression!r} must be one of 'none', 'fp16', 'bf16', 'powersgd', 'topk', 'auto', or a "
        "NoCompression / CastCompression / PowerSGDCompression / TopKCompression / AutoCompression."
    )


def describe_compression(
    config: Optional[CompressionConfig], members: Sequence[Sequence[int]], world: int
) -> list[str]:
    """Per-rank text for the lab table: what each hop of each rank carries."""
    if config is None:
        return ["fp32"] * world
    if not config.hierarchical:
        return [config.describe()] * world
    out = ["fp32 in group"] * world
    for ranks in members:
        out[ranks[0]] = f"fp32 in group, {config.describe()} across"
    return out

