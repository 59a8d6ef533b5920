"""Per-rank mixed precision with one loss scale for the whole job.

Ranks of a mixed lab need different autocast dtypes: Ampere and newer (compute capability >= 8.0) train fastest in
bf16, older cards (V100, T4, 2080 Ti) have no bf16 and need fp16 with loss scaling. The autocast dtype may differ
per rank, but DDP sums the ranks' gradients, so the loss scale must not: a scaled fp16 gradient summed with an
unscaled fp32 one is garbage. The rule here:

- each rank picks its autocast mode from the ``precision_policy`` (``"auto"``, a mode for all, or a mapping from
  device-name substring / ``"rank:N"`` to a mode);
- whenever any rank runs ``"16-mixed"``, *every* rank scales its loss with a GradScaler of the same settings, so the
  all-reduced gradients are scaled alike and identical on every rank after the reduction;
- the inf/NaN check is reduced over ranks too (torch's ``ShardedGradScaler``), so a step is skipped everywhere or
  nowhere and the scale grows and backs off in lockstep, even where a gradient can differ per rank (parameters DDP
  ignores, a comm hook whose result is rank-local).

Master weights and optimizer state stay fp32 (autocast only casts inside the forward pass). The scale is the same on
every rank, so Lightning's rank-0 checkpoint of the plugin state restores every rank.

Example::

    >>> HeteroDDPStrategy(precision_policy="auto")  # bf16 on cc >= 8.0, fp16 + scaling below, fp32 on CPU
    >>> HeteroDDPStrategy(precision_policy={"V100": "16-mixed", "A100": "bf16-mixed", "*": "32-true"})
    >>> HeteroDDPStrategy(precision_policy=PrecisionPolicy(rules={"*": "auto"}, tf32=False, init_scale=2.0**12))
"""

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union, get_args

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from typing_extensions import override

from lightning_hetero.config import check, is_int, is_number
from lightning_hetero.lab.devices import DeviceInfo, has_bf16_hardware
from lightning_hetero.rules import RankRules
from lightning_hetero.view import StrategyView

PrecisionMode = Literal["32-true", "16-mixed", "bf16-mixed"]
PrecisionRule = Literal["auto", "32-true", "16-mixed", "bf16-mixed"]
PRECISION_MODES: tuple[str, ...] = get_args(PrecisionMode)
PRECISION_RULES: tuple[str, ...] = get_args(PrecisionRule)


@dataclass(frozen=True)
class PrecisionPolicy:
    """How each rank picks its precision.

    Args:
        rules: device-name substring (case-insensitive, longest match wins, ``"*"`` matches any device; CPU ranks
            are named ``"cpu"``) or ``"rank:N"`` (wins over names) -> ``"auto"``, ``"32-true"``, ``"16-mixed"`` or
            ``"bf16-mixed"``. ``None``: ``{"*": "auto"}``.
        tf32: let fp32 matmuls and convolutions use TF32 on ranks with compute capability >= 8.0.
        init_scale: the GradScaler's initial loss scale (the same on every rank).
        growth_interval: steps without inf/NaN after which the scale doubles.
    """

    rules: Optional[dict[str, PrecisionRule]] = None
    tf32: bool = True
    init_scale: float = 2.0**16
    growth_interval: int = 2000

    @property
    def rank_rules(self) -> RankRules[str]:
        """The rules, checked (``None``: ``{"*": "auto"}``)."""
        return RankRules.parse("precision_policy", {"*": "auto"} if self.rules is None else self.rules,
                               _check_precision_rule)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", dict(self.rank_rules.rules))
        check("precision_policy", "tf32", self.tf32, isinstance(self.tf32, bool), "a bool")
        check("precision_policy", "init_scale", self.init_scale, is_number(self.init_scale) and self.init_scale > 0,
              "a positive finite number")
        check("precision_policy", "growth_interval", self.growth_interval,
              is_int(self.growth_interval) and self.growth_interval >= 1, "a positive integer")


def _check_precision_rule(key: str, mode: Any) -> str:
    if mode not in PRECISION_RULES:
        raise ValueError(f"`precision_policy`[{key!r}]={mode!r} is not one of {PRECISION_RULES}.")
    return str(mode)


PrecisionPolicyArg = Union[PrecisionRule, dict[str, PrecisionRule], PrecisionPolicy]


def parse_precision_policy(value: Optional[PrecisionPolicyArg]) -> Optional[PrecisionPolicy]:
    """Validate the strategy's ``precision_policy`` argument; ``None`` keeps the Trainer's precision."""
    if value is None or isinstance(value, PrecisionPolicy):
        return value
    if isinstance(value, str):
        if value not in PRECISION_RULES:
            raise ValueError(
                f"`precision_policy`={value!r} is not one of {PRECISION_RULES}, a mapping or a PrecisionPolicy.")
        return PrecisionPolicy(rules={"*": value})  # type: ignore[dict-item]
    if isinstance(value, Mapping):
        return PrecisionPolicy(rules=dict(value))
    raise ValueError(f"`precision_policy`={value!r} must be a string, a mapping or a PrecisionPolicy.")


def _gpu_capability(device: DeviceInfo) -> Optional[tuple[int, int]]:
    """The compute capability a rank trains as: its card's, or the one the lab emulator gives a CPU rank."""
    if device.type == "cuda" or device.capability != (0, 0):
        return device.capability
    return None


def _bf16_capable(device: DeviceInfo) -> bool:
    """From the capability, never torch.cuda.is_bf16_supported() (which may report emulation)."""
    if _gpu_capability(device) is None:
        return True  # CPU autocast has bf16
    return has_bf16_hardware(replace(device, type="cuda"))


def resolve_rank_precision(policy: PrecisionPolicy, device: DeviceInfo) -> str:
    """The precision mode ``device`` (one rank) trains in; ``ValueError`` naming the rank when it cannot."""
    rule = policy.rank_rules.for_device(device)
    if rule == "auto":
        if _gpu_capability(device) is None:
            return "32-true"
        return "bf16-mixed" if _bf16_capable(device) else "16-mixed"
    if rule == "bf16-mixed" and not _bf16_capable(device):
        major, minor = device.capability
        where = f"rank {device.rank} ({device.name!r} on {device.host}, cc {major}.{minor})"
        raise ValueError(
            f"`precision_policy` asks {where} for 'bf16-mixed', but bf16 needs compute capability >= 8.0; "
            "use '16-mixed' (loss-scaled fp16) or 'auto' for this device."
        )
    return str(rule)


def resolve_precisions(policy: PrecisionPolicy, devices: Sequence[DeviceInfo]) -> tuple[str, ...]:
    """Every rank's mode. Deterministic in (policy, devices), so every rank derives the same tuple locally."""
    return tuple(resolve_rank_precision(policy, d) for d in devices)


def job_compute_dtype(modes: Sequence[str]) -> torch.dtype:
    """One matmul dtype for the published-rate capacity table (which rates bf16 as fp16 on cards without bf16)."""
    if any(m != "32-true" for m in modes):
        return torch.bfloat16
    return torch.float32


def uses_tf32(policy: PrecisionPolicy, device: DeviceInfo) -> bool:
    """TF32 exists from Ampere on; an emulated older card (capability override) keeps full fp32."""
    return policy.tf32 and device.type == "cuda" and device.capability >= (8, 0)


def precision_column(policy: PrecisionPolicy, devices: Sequence[DeviceInfo], modes: Sequence[str]) -> list[str]:
    """The lab table's per-rank precision: mode, '+scaler' where the shared loss scale applies, '+tf32'."""
    scaled = "16-mixed" in modes
    column = []
    for device, mode in zip(devices, modes):
        text = mode + ("+scaler" if scaled else "")
        column.append(text + ("+tf32" if uses_tf32(policy, device) else ""))
    return column


def apply_tf32(policy: PrecisionPolicy, device: DeviceInfo) -> None:
    """Set this process's TF32 switches for a CUDA rank (process-wide torch settings; CPU ranks are left alone)."""
    if device.type != "cuda":
        return
    enabled = uses_tf32(policy, device)
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


class HeteroMixedPrecision(MixedPrecision):
    """Lightning's AMP plugin with the autocast dtype of this rank and the loss scaler of the job.

    ``precision`` is this rank's mode (``"32-true"`` runs without autocast). ``scaler`` is given to every rank as soon
    as any rank runs ``"16-mixed"``, even to bf16 and fp32 ranks: the gradients DDP sums must carry the same scale.
    Unscaling before clipping, skipping non-finite steps and checkpointing the scaler are Lightning's.

    Example::
        >>> scaler = ShardedGradScaler("cuda", process_group=None)  # found_inf is reduced over all ranks
        >>> plugin = HeteroMixedPrecision("bf16-mixed", device="cuda", scaler=scaler)
    """

    def __init__(self, precision: PrecisionMode, device: str, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        if precision not in PRECISION_MODES:
            raise ValueError(f"`precision`={precision!r} is not one of {PRECISION_MODES}.")
        if precision == "16-mixed" and scaler is None:
            raise ValueError("`precision`='16-mixed' needs the job's shared `scaler`.")
        # MixedPrecision ties the scaler to fp16; here the scaler belongs to the job and the dtype to the rank.
        super().__init__("bf16-mixed", device)
        self.precision = precision  # type: ignore[assignment]
        self.scaler = scaler

    @override
    def autocast_context_manager(self) -> torch.autocast:
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with nullcontext() if self.precision == "32-true" else self.autocast_context_manager():
            yield

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:  # a checkpoint from a job without fp16 ranks holds no scale
            self.scaler.load_state_dict(state_dict)


def build_precision_plugin(
    policy: PrecisionPolicy, modes: Sequence[str], rank: int, device_type: str
) -> HeteroMixedPrecision:
    """This rank's plugin. Every rank gets a scaler with the same settings when any rank runs fp16."""
    scaler = None
    if "16-mixed" in modes:
        # ShardedGradScaler is torch's GradScaler whose unscale_ all-reduces found_inf over the process group.
        scaler = ShardedGradScaler(
            device_type, init_scale=policy.init_scale, growth_interval=policy.growth_interval, process_group=None
        )
    return HeteroMixedPrecision(modes[rank], device=device_type, scaler=scaler)  # type: ignore[arg-type]


def check_no_conflict(policy: PrecisionPolicy, current: Precision) -> None:
    """``precision_policy`` owns precision: refuse a non-default ``Trainer(precision=...)`` or precision plugin."""
    if type(current) is Precision or isinstance(current, HeteroMixedPrecision):
        return
    raise ValueError(
        f"`precision_policy` decides each rank's precision, but the Trainer also asks for "
        f"precision={getattr(current, 'precision', type(current).__name__)!r}. Leave `Trainer(precision=...)` at its "
        "default ('32-true') or drop `precision_policy`."
    )


class RankPrecision:
    """The precision policy of one job once its devices are known: every rank's mode, this rank's plugin installed.

    Owned by :class:`~lightning_hetero.strategies.core.HeteroCore`; with no policy it installs nothing and the
    compute dtype is the Trainer's precision.

    Example::

        precision = RankPrecision(view, parse_precision_policy("auto"))
        precision.install(devices)  # after every rank's device is gathered: the same modes on every rank
        precision.compute_dtype()  # the dtype the published-rate capacity table is read at
    """

    def __init__(self, view: StrategyView, policy: Optional[PrecisionPolicy]) -> None:
        self.view = view
        self.policy = policy
        self.modes: Optional[tuple[str, ...]] = None

    def install(self, devices: Sequence[DeviceInfo]) -> None:
        """Every rank's mode, this rank's TF32 switches and precision plugin (no collective)."""
        if self.policy is None:
            return
        view = self.view
        check_no_conflict(self.policy, view.precision_plugin)
        # Derived from the gathered devices, hence identical on every rank without another collective.
        self.modes = resolve_precisions(self.policy, devices)
        apply_tf32(self.policy, devices[view.global_rank])
        view.precision_plugin = build_precision_plugin(self.policy, self.modes, view.global_rank,
                                                       view.root_device.type)

    def table_columns(self, devices: Sequence[DeviceInfo]) -> dict[str, list[str]]:
        """The lab table's precision column (none without a policy)."""
        if self.policy is None or self.modes is None:
            return {}
        return {"precision": precision_column(self.policy, devices, self.modes)}

    def compute_dtype(self) -> torch.dtype:
        """The dtype this rank's matmuls run in, for the published-rate table."""
        if self.modes is not None:
            # One dtype for all ranks: capacities must agree.
            return job_compute_dtype(self.modes)
        precision = str(getattr(self.view.precision_plugin, "precision", "32-true"))
        if "bf16" in precision:
            return torch.bfloat16
        return torch.float16 if precision.startswith("16") else torch.float32
