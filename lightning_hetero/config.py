"""The strategies' option groups: frozen, typed, JSON-able dataclasses, each validated where it is built.

A group is what one concern of the core needs (profiling, rebalancing, the data split, resilience, observation).
In a LightningCLI YAML a group is a nested mapping::

    strategy:
      class_path: lightning_hetero.HeteroDDPStrategy
      init_args:
        capacities: profile
        profiling: {steps: 8, memory_headroom: 0.15}
        rebalance: {every: 50, threshold: 0.05}
        data: {balance: tokens, micro_batch: auto}
        resilience: {resume: auto, timeout: 600}
        observation: {monitor: true}

:func:`from_flat_arguments` maps the flat spellings of earlier releases (``profile_steps=8``, ``resume="auto"`` ...)
onto the groups, with a deprecation warning naming the new spelling.
"""

import inspect
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Optional, TypeVar, Union, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from torch.nn.parallel import DistributedDataParallel


StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
StreamMode = Literal["exact", "shard"]
NonFinite = Literal["ignore", "skip", "stop"]
Balance = Literal["samples", "tokens", "padded_tokens"]
Denominator = Literal["samples", "tokens"]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (``bool`` is not a number here: ``True`` for a count is a mistake)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check(owner: str, name: str, value: Any, ok: bool, what: str) -> None:
    """``ValueError`` naming ``owner.name`` and what it must be, unless ``ok``."""
    if not ok:
        field = f"{owner}.{name}" if owner else name
        raise ValueError(f"`{field}`={value!r} must be {what}.")


# The release that drops the flat (ungrouped) spellings of the grouped options (deprecated in 0.2.0).
FLAT_ARGUMENTS_REMOVED_IN = "0.4.0"


def check_choice(owner: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    check(owner, name, value, value in choices, "one of " + ", ".join(repr(c) for c in choices))


MicroBatchArg = Union[int, list[int], Literal["auto"]]


def parse_micro_batch(value: Optional[MicroBatchArg], owner: str = "") -> Optional[Union[str, tuple[int, ...]]]:
    """``None``, ``"auto"`` or a tuple of positive per-rank limits (one int: the same for all, as a 1-tuple)."""
    if value is None or value == "auto":
        return value
    values = [value] if is_int(value) else value
    check(owner, "micro_batch", value, isinstance(values, (list, tuple)) and bool(values) and all(
        is_int(v) and v >= 1 for v in values), "None, 'auto', a positive integer or a list of one per rank")
    return tuple(values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Profiling:
    """How ``capacities="profile"``/``"auto"`` measures each rank on the user's model.

    Args:
        steps: timed steps per batch size (after 5 warm-up steps; at half and all of an equal share, then at a rank's
            own share if that is far from both).
        memory_headroom: fraction of each CUDA device's memory kept free when profiling derives how many samples a
            rank can hold (its "mem cap"); the split never gives a rank more.
        max_batch_per_rank: an explicit cap on any rank's samples per step (CPU ranks have no measured cap).
    """

    steps: int = 4
    memory_headroom: float = 0.1
    max_batch_per_rank: Optional[int] = None

    def __post_init__(self) -> None:
        check("profiling", "steps", self.steps, is_int(self.steps) and self.steps >= 1, "a positive integer")
        check("profiling", "memory_headroom", self.memory_headroom,
              is_number(self.memory_headroom) and 0 <= self.memory_headroom < 1,
              "a fraction of device memory in [0, 1)")
        check("profiling", "max_batch_per_rank", self.max_batch_per_rank,
              self.max_batch_per_rank is None or (is_int(self.max_batch_per_rank) and self.max_batch_per_rank >= 1),
              "a positive integer or None")


@dataclass(frozen=True)
class Rebalancing:
    """Live rebalancing: shares re-derived while training from each rank's measured compute time per sample.

    Args:
        every: batches between measurement exchanges (one ``all_gather`` each).
        threshold: change shares only when the measured rates predict the new split to shorten the step by more than
            this fraction.
        smoothing: weight of the newest measurement in the moving average of throughput (1: no smoothing).
    """

    every: int = 20
    threshold: float = 0.05
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        check("rebalance", "every", self.every, is_int(self.every) and self.every >= 1,
              "a positive number of batches")
        check("rebalance", "threshold", self.threshold, is_number(self.threshold) and 0 <= self.threshold < 1,
              "a fraction of the step time in [0, 1)")
        check("rebalance", "smoothing", self.smoothing, is_number(self.smoothing) and 0 < self.smoothing <= 1,
              "in (0, 1] (1: no smoothing)")


@dataclass(frozen=True)
class DataSplit:
    """How loaders are split into per-rank shares.

    Args:
        stream_mode: how a loader over an ``IterableDataset`` is split: ``"exact"`` (every rank reads the whole
            stream and keeps its share of each global batch) or ``"shard"`` (each rank reads its own shard; exhausted
            ranks pad with zero-weight steps). See :mod:`lightning_hetero.data.streaming`.
        balance: ``"samples"`` splits each training batch by sample count; ``"tokens"`` by summed per-sample cost
            (sequence length); ``"padded_tokens"`` by sample count times the longest sample (a collate that pads).
        loss_denominator: what the training loss averages over: ``"samples"`` (gradient weight b_r / G) or
            ``"tokens"`` (t_r / T).
        sample_cost: dotted path ``"package.module.function"`` of a function sample -> cost. It is imported and
            called on every sample: a config file naming it is code, as a LightningCLI ``class_path`` is. Default:
            the dataset's ``lengths``, else the LightningModule's ``sample_cost(sample)``, else the length of the
            first sequence tensor of each sample.
        micro_batch: run a rank's share as micro-batches with local accumulation when it exceeds this many samples:
            an int (every rank), a list (one per rank) or ``"auto"`` (the profiled memory cap, or
            ``profiling.max_batch_per_rank``). Shares are then split by capacity alone, never capped.
    """

    stream_mode: StreamMode = "exact"
    balance: Balance = "samples"
    loss_denominator: Denominator = "samples"
    sample_cost: Optional[str] = None
    micro_batch: Optional[MicroBatchArg] = None

    def __post_init__(self) -> None:
        check_choice("data", "stream_mode", self.stream_mode, ("exact", "shard"))
        check_choice("data", "balance", self.balance, ("samples", "tokens", "padded_tokens"))
        check_choice("data", "loss_denominator", self.loss_denominator, ("samples", "tokens"))
        check("data", "sample_cost", self.sample_cost,
              self.sample_cost is None or (isinstance(self.sample_cost, str) and "." in self.sample_cost),
              "a dotted path 'package.module.function' or None")
        parse_micro_batch(self.micro_batch, owner="data")

    @property
    def uses_costs(self) -> bool:
        return self.balance != "samples" or self.loss_denominator != "samples"


@dataclass(frozen=True)
class Resilience:
    """Failing fast and going on after a failure.

    Args:
        timeout: seconds a collective may wait, a rank may make no progress, or a rank may take to join, before every
            rank fails naming the cause (rank, host, device, step, phase). See
            :mod:`lightning_hetero.resilience.watchdog`.
        resume: ``"auto"``: ``fit`` without ``ckpt_path`` goes on from the verified checkpoint recording the most
            training progress (global step, then epoch) in the ``dirpath`` of the trainer's ``ModelCheckpoint``
            callbacks (none there: a fresh start); a directory: that checkpoint in it. A re-run of the same command
            (or ``torchrun --max-restarts``) then continues where that checkpoint stood, also on a different number
            or kind of devices. ``None``: Lightning's ``ckpt_path`` only.
        nonfinite: a non-finite loss or gradient: ``"ignore"`` (plain DDP: no check, no cost), ``"skip"`` the step on
            every rank, warning with the rank(s) and step, or ``"stop"`` every rank before the update, naming them.
            ``skip``/``stop`` add a :class:`~lightning_hetero.grad.nonfinite.NonFiniteCheck` callback (one read of a
            flag from the device per step). See :mod:`lightning_hetero.grad.nonfinite`.
    """

    timeout: float = 1800.0
    resume: Optional[str] = None
    nonfinite: NonFinite = "ignore"

    def __post_init__(self) -> None:
        check("resilience", "timeout", self.timeout, is_number(self.timeout) and self.timeout > 0,
              "a positive number of seconds")
        check("resilience", "resume", self.resume,
              self.resume is None or (isinstance(self.resume, str) and bool(self.resume)),
              "None, 'auto' or a checkpoint directory")
        check_choice("resilience", "nonfinite", self.nonfinite, ("ignore", "skip", "stop"))


@dataclass(frozen=True)
class Observation:
    """What the strategy shows.

    Args:
        monitor: add a :class:`~lightning_hetero.observe.monitor.HeteroMonitor` callback (unless one is among the
            trainer's callbacks; an info line says it was added): per-rank compute, wait, data and communication
            time logged through the Trainer's logger, and a summary at the end.
        print_table: rank 0 prints the lab table once.
    """

    monitor: bool = False
    print_table: bool = True

    def __post_init__(self) -> None:
        check("observation", "monitor", self.monitor, isinstance(self.monitor, bool), "True or False")
        check("observation", "print_table", self.print_table, isinstance(self.print_table, bool), "True or False")


Group = TypeVar("Group", Profiling, Rebalancing, DataSplit, Resilience, Observation)


def as_group(kind: type[Group], name: str, value: Union[None, Group, Mapping[str, Any]]) -> Group:
    """A group from ``None`` (defaults), an instance, or a mapping of its fields (as YAML gives it)."""
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(kind)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"`{name}` has no field(s) {unknown}; {kind.__name__} has {sorted(known)}.")
        return kind(**value)
    raise ValueError(f"`{name}`={value!r} must be a {kind.__name__}, a mapping of its fields, or None.")


def as_rebalancing(value: Union[bool, None, Rebalancing, Mapping[str, Any]]) -> Optional[Rebalancing]:
    """``rebalance``: False/None (off), True (defaults), a :class:`Rebalancing` or a mapping of its fields."""
    if value is None or value is False:
        return None
    if value is True:
        return Rebalancing()
    return as_group(Rebalancing, "rebalance", value)


# What a sharded strategy refuses, and why: both options time each rank's own steps, but a sharded step waits at every
# block for all ranks' all-gathers. Rebalancing measured on CPU (a rank emulated 3x slower, equal start) ran the shares
# to [15, 1] of 16, not [12, 4]: a rank given less work reaches the next all-gather first, and that wait counts as its
# own time.
_SHARDED_REFUSALS = {
    "capacities": "`capacities`='profile' times each rank's own steps, but a sharded step waits at every block for all "
                  "ranks' all-gathers, so every rank would time the slowest: give 'auto' (published rates, and the "
                  "profiled memory caps), 'peak', a mapping from device names or explicit weights.",
    "rebalance": "`rebalance` times each rank's own steps, but a sharded step waits at every block for all ranks' "
                 "all-gathers, so a rank's wait for the slower ones counts as its own time and the shares run to an "
                 "extreme: leave `rebalance` off and give the capacities ('auto', 'peak', a mapping or weights).",
}


def sharded_refusals(capacity_source: Any, rebalance: Any) -> dict[str, str]:
    """The options a sharded strategy refuses, each with the reason: ``capacities`` when its source is ``"profile"``,
    ``rebalance`` when it is on (anything but ``None`` and ``False``, as :func:`as_rebalancing` reads it: an empty
    mapping is the defaults)."""
    rebalancing = rebalance is not None and rebalance is not False
    refused = {"capacities": capacity_source == "profile", "rebalance": rebalancing}
    return {name: _SHARDED_REFUSALS[name] for name, on in refused.items() if on}


# The flat arguments of earlier releases: (group argument, field).
_FLAT = {
    "profile_steps": ("profiling", "steps"),
    "memory_headroom": ("profiling", "memory_headroom"),
    "max_batch_per_rank": ("profiling", "max_batch_per_rank"),
    "rebalance_every": ("rebalance", "every"),
    "rebalance_threshold": ("rebalance", "threshold"),
    "rebalance_smoothing": ("rebalance", "smoothing"),
    "stream_mode": ("data", "stream_mode"),
    "balance": ("data", "balance"),
    "loss_denominator": ("data", "loss_denominator"),
    "sample_cost": ("data", "sample_cost"),
    "micro_batch": ("data", "micro_batch"),
    "timeout": ("resilience", "timeout"),
    "resume": ("resilience", "resume"),
    "monitor": ("observation", "monitor"),
    "print_table": ("observation", "print_table"),
}


@dataclass(frozen=True)
class Options:
    """Every group the core needs, resolved."""

    profiling: Profiling
    rebalance: Optional[Rebalancing]
    data: DataSplit
    resilience: Resilience
    observation: Observation


def _yaml(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def from_flat_arguments(
    profiling: Union[None, Profiling, Mapping[str, Any]],
    rebalance: Union[bool, None, Rebalancing, Mapping[str, Any]],
    data: Union[None, DataSplit, Mapping[str, Any]],
    resilience: Union[None, Resilience, Mapping[str, Any]],
    observation: Union[None, Observation, Mapping[str, Any]],
    flat: Mapping[str, Any],
) -> Options:
    """The groups, with any flat argument of earlier releases (``flat``: name → value, ``None`` = not given) folded
    in and a ``FutureWarning`` naming the new spelling."""
    groups: dict[str, Any] = {
        "profiling": as_group(Profiling, "profiling", profiling),
        "rebalance": as_rebalancing(rebalance),
        "data": as_group(DataSplit, "data", data),
        "resilience": as_group(Resilience, "resilience", resilience),
        "observation": as_group(Observation, "observation", observation),
    }
    for name, value in flat.items():
        if value is None:
            continue
        group, field = _FLAT[name]
        # Rebalancing knobs given while rebalancing is off are checked, and stay off (as before).
        current = groups[group] if groups[group] is not None else Rebalancing()
        try:
            updated = replace(current, **{field: value})
        except ValueError as err:  # name the argument the user wrote
            raise ValueError(str(err).replace(f"`{group}.{field}`", f"`{name}`", 1)) from None
        if groups[group] is not None:
            groups[group] = updated
        warnings.warn(
            f"`{name}={value!r}` is deprecated and will be removed in {FLAT_ARGUMENTS_REMOVED_IN}: write "
            f"`{group}={{'{field}': {value!r}}}` (YAML: `{group}: {{{field}: {_yaml(value)}}}`).",
            FutureWarning,
            stacklevel=3,
        )
    return Options(**groups)


# -- the Lightning-level arguments every strategy takes -----------------------------------------------------------
_BACKENDS = tuple(b for b in dist.Backend.backend_list if b != "undefined")  # torch's, with registered ones
# DistributedDataParallel arguments the strategy owns, and those whose type it checks.
_OWNED_DDP_ARGS = ("self", "module", "device_ids", "output_device", "process_group", "device_mesh")
_BOOL_DDP_ARGS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
                  "skip_all_reduce_unused_params", "init_sync")


def check_ddp_kwargs(ddp_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``ddp_kwargs`` keys must be ``DistributedDataParallel`` arguments the strategy does not own."""
    if ddp_kwargs is None:
        return {}
    check("", "ddp_kwargs", ddp_kwargs, isinstance(ddp_kwargs, Mapping),
          "a dict of DistributedDataParallel arguments or None")
    accepted = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in _OWNED_DDP_ARGS]
    for key, value in ddp_kwargs.items():
        if key in _OWNED_DDP_ARGS:
            raise ValueError(f"`ddp_kwargs` must not set `{key}`: the strategy owns it.")
        check("", "ddp_kwargs", key, key in accepted, f"DistributedDataParallel arguments; accepted: {accepted}")
        if key in _BOOL_DDP_ARGS:
            check("ddp_kwargs", key, value, isinstance(value, bool), "True or False")
        if key == "bucket_cap_mb":
            check("ddp_kwargs", key, value, value is None or (isinstance(value, (int, float)) and not isinstance(
                value, bool) and math.isfinite(value) and value > 0), "a positive number of MiB or None")
    return dict(ddp_kwargs)


def check_strategy_arguments(start_method: Any, backend: Any, accelerator: Any, devices: Any, environment: Any,
                           checkpoint_io: Any, precision_plugin: Any, hook: Any, wrapper: Any) -> None:
    """``ValueError`` naming the argument for a value of the wrong kind (LightningCLI checks types; Python does not)."""
    check_choice("", "start_method", start_method, get_args(StartMethod))
    if backend is not None:  # "gloo", "nccl", ... or a per-device mapping such as "cpu:gloo,cuda:nccl"
        names = [part.split(":")[-1] for part in backend.split(",")] if isinstance(backend, str) else [backend]
        check("", "process_group_backend", backend, all(isinstance(n, str) and n.lower() in _BACKENDS for n in names),
              f"None or one of {list(_BACKENDS)} (or 'cpu:gloo,cuda:nccl')")
    check("", "parallel_devices", devices, devices is None or (isinstance(devices, (list, tuple)) and all(
        isinstance(d, torch.device) for d in devices)), "a list of torch.device or None")
    for name, value, kind in (("cluster_environment", environment, ClusterEnvironment),
                              ("checkpoint_io", checkpoint_io, CheckpointIO), ("precision_plugin", precision_plugin,
                                                                              Precision)):
        check("", name, value, value is None or isinstance(value, kind), f"a {kind.__name__} or None")
    check("", "accelerator", accelerator, accelerator is None or isinstance(accelerator, (str, Accelerator)),
          "an Accelerator, its registry name or None")
    for name, value in (("ddp_comm_hook", hook), ("ddp_comm_wrapper", wrapper)):
        check("", name, value, value is None or callable(value), "callable or None")
