"""Measure every rank's training throughput (and, on CUDA, its memory per sample) on the user's own model.

Before the first training step each rank times forward + backward of its LightningModule's ``training_step`` on
real samples of its own training set, at two micro-batch sizes, in the precision it trains in. The samples are read
straight from the dataset (the training loader's order and position are untouched), the backward pass uses
``torch.autograd.grad`` on the bare LightningModule (no ``.grad`` is written, no DDP all-reduce fires), and
parameters, buffers, gradients, module modes and every RNG are put back exactly as they were.

From the two sizes each rank fits ``time(b) = a + c * b`` (a fixed cost per step plus a cost per sample); the shares
are the split that makes every rank's predicted step time equal, and a rank's capacity is its predicted samples/s at
that split. On CUDA the same two sizes give the peak memory per sample, and with the free memory (minus a headroom)
a cap on the samples the rank can hold, which :func:`lightning_hetero.plan.split.split_batch` honours.

Example::

    result = profile_capacities(module, samples, sizes=(8, 16), global_batch_size=64,
                                forward_context=precision_plugin.forward_context)
    plan.adopt(result.capacities, "profile", caps=result.caps)  # plan: the job's SharePlan
"""

import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import lightning_hetero._compat as _compat
from lightning_hetero.plan.split import split_batch

ContextFactory = Callable[[], AbstractContextManager]


@dataclass(frozen=True)
class RankProfile:
    """One rank's measurements: step seconds at each batch size, peak bytes above the model at each size."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    peak_bytes: tuple[int, ...] = ()
    usable_bytes: Optional[int] = None  # memory this rank may fill (CUDA only)
    cost_s: float = 0.0

    def latency_bound(self) -> bool:
        """The step hardly grows with its batch (fixed costs dominate, or noise does): the fit is ill-conditioned."""
        (b1, b2), (t1, t2) = self.sizes[:1] + self.sizes[-1:], self.seconds[:1] + self.seconds[-1:]
        return b2 <= b1 or (t2 - t1) < 0.25 * t2 * (b2 - b1) / b2

    def cost_model(self) -> tuple[float, float]:
        """(seconds per step, seconds per sample) of ``time(b) = a + c * b``, both kept physical (a >= 0, c > 0)."""
        (b1, b2), (t1, t2) = self.sizes[:1] + self.sizes[-1:], self.seconds[:1] + self.seconds[-1:]
        # An ill-conditioned fit: take time as proportional to samples, which under- rather than over-estimates
        # what the rank could take.
        if self.latency_bound():
            return 0.0, t2 / b2
        per_sample = (t2 - t1) / (b2 - b1)
        return max(0.0, t2 - per_sample * b2), per_sample

    def seconds_at(self, size: int) -> float:
        """Step seconds at ``size``: the measurement when timed there, else read off the line through the two
        timed points (a step never gets faster with more samples)."""
        if size in self.sizes:
            return self.seconds[self.sizes.index(size)]
        (b1, b2), (t1, t2) = self.sizes[:1] + self.sizes[-1:], self.seconds[:1] + self.seconds[-1:]
        line = t1 if b2 <= b1 else t1 + (t2 - t1) * (size - b1) / (b2 - b1)
        if size > b2:
            return max(line, t2)
        if size < b1:
            return max(min(line, t1), 1e-9)
        return max(line, 1e-9)

    def memory_cap(self, max_batch: Optional[int] = None) -> Optional[int]:
        """Most samples that fit in ``usable_bytes`` (``None``: not measured and no explicit limit)."""
        cap = max_batch
        if self.usable_bytes is not None and len(self.peak_bytes) == len(self.sizes) and self.peak_bytes:
            (b1, b2), (m1, m2) = (self.sizes[0], self.sizes[-1]), (self.peak_bytes[0], self.peak_bytes[-1])
            per_sample = max((m2 - m1) / (b2 - b1), 0.0) if b2 > b1 else m2 / b2
            fixed = max(0.0, m2 - per_sample * b2)
            if per_sample > 0:
                fits = math.floor((self.usable_bytes - fixed) / per_sample)
                cap = fits if cap is None else min(cap, fits)
        return cap


@dataclass(frozen=True)
class ProfileResult:
    """All ranks' profiles and what follows from them (identical on every rank)."""

    ranks: tuple[RankProfile, ...]
    global_batch_size: int
    capacities: tuple[float, ...] = ()
    caps: Optional[tuple[int, ...]] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cost_s(self) -> float:
        """Wall time of the slowest rank's profiling."""
        return max(r.cost_s for r in self.ranks)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "ProfileResult":
        ranks = tuple(
            RankProfile(
                sizes=tuple(r["sizes"]),
                seconds=tuple(r["seconds"]),
                peak_bytes=tuple(r["peak_bytes"]),
                usable_bytes=r["usable_bytes"],
                cost_s=r["cost_s"],
            )
            for r in state["ranks"]
        )
        caps = tuple(state["caps"]) if state.get("caps") else None
        return cls(ranks, int(state["global_batch_size"]), tuple(state["capacities"]), caps,
                   dict(state.get("extra", {})))


def balanced_capacities(profiles: Sequence[RankProfile], global_batch_size: int) -> list[float]:
    """Samples/s of each rank at the split where every rank's predicted step time is the same.

    With ``time_r(b) = a_r + c_r b`` and ``Σ b_r = G``, equal times T give ``b_r = (T - a_r) / c_r`` and
    ``T = (G + Σ a_r / c_r) / Σ 1 / c_r``. A rank whose fixed cost alone exceeds T still gets one sample.

    When any rank's fit is ill-conditioned (its step hardly grows with the batch), fixed costs cannot be told from
    noise and every rank is compared at the size all of them were timed at, the equal share: capacity = samples/s
    there. Mixing one rank's noisy fixed cost with another's proportional fallback would push the split to an
    extreme (a 3x slower rank given 1 sample of 64) on nothing but timing noise.
    """
    if any(p.latency_bound() for p in profiles):
        equal = max(1, global_batch_size // len(profiles))
        return [equal / p.seconds_at(equal) for p in profiles]
    models = [p.cost_model() for p in profiles]
    step = (global_batch_size + sum(a / c for a, c in models)) / sum(1.0 / c for _, c in models)
    shares = [max((step - a) / c, 1.0) for a, c in models]
    return [b / (a + c * b) for b, (a, c) in zip(shares, models)]


def profile_sizes(global_batch_size: int, world_size: int, minimum: int = 1) -> tuple[int, int]:
    """Half and all of an equal share: the sizes plain DDP already trains at, so both fit where DDP fits. None below
    ``minimum`` (2 for a model with BatchNorm layers, which cannot train on one sample)."""
    equal = max(minimum, global_batch_size // world_size)
    return max(minimum, equal // 2), equal


def time_rank(
    module: nn.Module,
    batches: Mapping[int, Any],
    loss_fn: Callable[[Any], Optional[torch.Tensor]],
    device: torch.device,
    steps: int = 4,
    warmup: int = 5,
    forward_context: ContextFactory = nullcontext,
    headroom: float = 0.1,
    step_context: ContextFactory = nullcontext,
    lockstep: bool = False,
) -> Optional[RankProfile]:
    """Fastest seconds of forward + backward at each batch size (``batches``: size -> batch on ``device``).

    ``None`` when ``loss_fn`` gives no loss (a ``training_step`` that returns ``None``). ``step_context`` wraps
    forward and backward (e.g. an emulated device's capped stream), ``forward_context`` the forward (autocast).
    ``lockstep``: forward and backward issue collectives (a sharded model), so every rank runs the same steps.
    Writes no ``.grad``; call it inside :func:`preserved` to also restore buffers and RNG.
    """
    start = time.perf_counter()
    cuda = device.type == "cuda"
    params = [p for p in module.parameters() if p.requires_grad]
    sizes, seconds, peaks = [], [], []
    # The device warms up (clocks, allocator, kernel selection) on the largest batch before anything is timed;
    # then each size gets one untimed step of its own.
    # On CUDA the warm-up also lasts at least half a second: clocks ramp up from idle over that time scale.
    min_warm_s = 0.5 if cuda and not lockstep else 0.0
    if not _untimed_steps(module, batches[max(batches)], loss_fn, params, warmup, min_warm_s, forward_context,
                          step_context, device):
        return None
    for size in sorted(batches):
        times = []
        for i in range(1 + steps):
            if cuda:
                torch.cuda.synchronize(device)
                if i == steps:
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            with step_context():
                with forward_context():
                    loss = loss_fn(batches[size])
                if loss is None:
                    return None
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            del loss, grads
        if cuda:
            peaks.append(int(torch.cuda.max_memory_allocated(device) - base))
        sizes.append(size)
        # The fastest timed step: noise (launch jitter, other processes) only ever adds time to a fixed workload.
        seconds.append(min(times[1:]))
    usable = usable_bytes(device, headroom) if cuda else None
    return RankProfile(tuple(sizes), tuple(seconds), tuple(peaks), usable, time.perf_counter() - start)


def usable_bytes(device: torch.device, headroom: float) -> int:
    """The memory this process may still fill on ``device``, less ``headroom`` of what it may hold in all: the device's
    free memory and the allocator's cached blocks, bounded by the allocator's own cap where one is set
    (``set_per_process_memory_fraction``: an emulated card's memory, or ranks sharing one GPU), which the device's
    free memory does not show."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cached = reserved - torch.cuda.memory_allocated(device)
    # torch < 2.9 has no getter for the cap: the device's own memory bounds it there.
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    limit = min(total, int(get_fraction(device) * total)) if get_fraction is not None else total
    return int(min(free, limit - reserved) + cached - headroom * limit)


def _untimed_steps(module: nn.Module, batch: Any, loss_fn: Callable[[Any], Optional[torch.Tensor]], params: list,
                   count: int, min_seconds: float, forward_context: ContextFactory, step_context: ContextFactory,
                   device: torch.device) -> bool:
    """At least ``count`` untimed forward + backward steps lasting ``min_seconds``; False when there is no loss."""
    start, done = time.perf_counter(), 0
    while done < count or time.perf_counter() - start < min_seconds:
        with step_context():
            with forward_context():
                loss = loss_fn(batch)
            if loss is None:
                return False
            torch.autograd.grad(loss, params, allow_unused=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done += 1
    return True


def optimizer_reserve_bytes(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes optimizer state will take at the first step if it does not exist yet (two moments, as Adam keeps)."""
    if any(len(opt.state) for opt in optimizers):
        return 0
    return 2 * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has storage for all its elements: a pipeline stage's placeholder for a parameter it does
    not hold (one element expanded to the shape, :mod:`~lightning_hetero.strategies.stage_memory`) has not."""
    return tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()


@contextmanager
def preserved(module: nn.Module) -> Iterator[None]:
    """Put parameters, buffers, gradients, module train/eval modes and all RNG states back as they were (parameters
    without values of their own, :func:`has_values`, are left alone)."""
    modes = [(m, m.training) for m in module.modules()]
    # Kept in host memory: a forward that writes its weights (even through `.data`, which no version counter sees)
    # is undone without doubling the model on the device.
    params = [(p, p.detach().to("cpu", copy=True)) for p in module.parameters() if has_values(p)]
    grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = _rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in params:
                if has_values(p):  # a pipeline stage may have released another stage's parameter meanwhile
                    p.copy_(saved.to(p.device))
            for p, grad, saved in grads:
                p.grad = grad
                if grad is not None:
                    grad.copy_(saved)
            for b, saved in buffers:
                b.copy_(saved)
        for m, mode in modes:
            m.training = mode
        _set_rng_state(rng)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def gather_profiles(local: Optional[RankProfile]) -> list[Optional[RankProfile]]:
    """Every rank's profile (``None`` where a rank could not profile); a collective."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if local is None else asdict(local))
    return [None if g is None else RankProfile(**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()})
            for g in gathered]


def pool_by_class(profiles: Sequence[RankProfile], classes: Sequence[str],
                  tolerance: float = 1.25) -> list[RankProfile]:
    """Ranks of one device class that measured alike (within ``tolerance``) share the class's mean cost model.

    Identical cards then get identical shares instead of splitting on timing noise; a card of the class that is
    really slower (a co-tenant, throttling: beyond ``tolerance``) keeps its own measurement. Members may have been
    timed at different sizes (after refinement): their fitted models are compared and averaged at the first
    member's sizes.
    """
    if not classes:
        return list(profiles)
    pooled = list(profiles)
    for name in set(classes):
        members = [r for r, c in enumerate(classes) if c == name]
        if len(members) < 2:
            continue
        sizes = profiles[members[0]].sizes
        predicted = []
        for r in members:
            fixed, per_sample = profiles[r].cost_model()
            predicted.append([fixed + per_sample * b for b in sizes])
        longest = [times[-1] for times in predicted]
        if max(longest) > tolerance * min(longest):
            continue
        mean = tuple(sum(column) / len(members) for column in zip(*predicted))
        for r in members:
            pooled[r] = replace(profiles[r], sizes=sizes, seconds=mean)
    return pooled


def combine(
    profiles: Sequence[RankProfile],
    global_batch_size: int,
    reserve_bytes: Sequence[int] = (),
    max_batch_per_rank: Optional[int] = None,
    classes: Sequence[str] = (),
) -> ProfileResult:
    """Capacities and per-rank caps from all ranks' profiles; ``ValueError`` if a rank cannot hold one sample.

    ``classes`` (each rank's device class) pools the timing of interchangeable ranks, see :func:`pool_by_class`.
    """
    capacities = balanced_capacities(pool_by_class(profiles, classes), global_batch_size)
    caps = []
    for r, p in enumerate(profiles):
        reserve = reserve_bytes[r] if r < len(reserve_bytes) else 0
        usable = None if p.usable_bytes is None else p.usable_bytes - reserve
        cap = RankProfile(p.sizes, p.seconds, p.peak_bytes, usable, p.cost_s).memory_cap(max_batch_per_rank)
        if cap is not None and cap < 1:
            raise ValueError(
                f"rank {r} cannot hold one training sample: it measured {p.peak_bytes} bytes at batch sizes "
                f"{p.sizes} and may use {usable} bytes (free memory minus `memory_headroom`). Use a smaller model, "
                "lower `memory_headroom`, or leave this device out."
            )
        caps.append(cap)
    if all(c is None for c in caps):
        final_caps = None
    else:
        # A rank without a measured limit can take the whole batch.
        final_caps = tuple(global_batch_size if c is None else int(c) for c in caps)
    return ProfileResult(tuple(profiles), global_batch_size, tuple(capacities), final_caps)


@contextmanager
def _silenced_logging(module: nn.Module) -> Iterator[None]:
    """``self.log`` inside a profiled ``training_step`` records nothing and syncs nothing."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log


@contextmanager
def profiled(module: nn.Module) -> Iterator[None]:
    """Around timed training steps of ``module``: train mode, gradients on, ``self.log`` silenced, and parameters,
    buffers, gradients, modes and RNG put back afterwards (:func:`preserved`)."""
    with preserved(module), _silenced_logging(module), torch.enable_grad():
        module.train()
        yield


def training_loss(module: nn.Module,
                  step: Optional[Callable[..., Any]] = None) -> Callable[[Any], Optional[torch.Tensor]]:
    """The loss ``module.training_step`` (or ``step``, the strategy's) returns (a tensor or ``{"loss": tensor}``), else
    ``None``."""

    def loss_fn(batch: Any) -> Optional[torch.Tensor]:
        out = (step or module.training_step)(batch, 0)
        if isinstance(out, Mapping):
            out = out.get("loss")
        return out if isinstance(out, torch.Tensor) and out.requires_grad else None

    return loss_fn


def sample_batches(
    dataset: Any, collate_fn: Callable, indices: Sequence[int], sizes: Sequence[int], transfer: Callable[[Any], Any]
) -> dict[int, Any]:
    """Batches of each size made of the first samples of ``indices``, read straight from ``dataset``."""
    return {size: transfer(collate_fn([dataset[i] for i in indices[:size]])) for size in sizes}


def profile_lightning_module(
    module: Any,
    dataset: Any,
    collate_fn: Callable,
    indices: Sequence[int],
    global_batch_size: int,
    device: torch.device,
    forward_context: ContextFactory = nullcontext,
    steps: int = 4,
    headroom: float = 0.1,
    max_batch_per_rank: Optional[int] = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    step_context: ContextFactory = nullcontext,
    classes: Sequence[str] = (),
    lockstep: bool = False,
    training_step: Optional[Callable[..., Any]] = None,
    min_batch: int = 1,
    min_share: int = 1,
) -> Optional[ProfileResult]:
    """Profile ``module`` (a LightningModule, not its DDP wrapper) on this rank and combine all ranks' results.

    A collective: every rank calls it. ``indices`` are the samples this rank reads (any order; up to the global
    batch size are used). Returns ``None`` on every rank if any rank's ``training_step`` gave no loss to time.

    Step time is not quite linear in the batch size (a fast card gets more efficient at large batches), so when the
    first split puts a rank far from both sizes it was timed at, every such rank is timed once more at its share and
    refitted on that point and the nearer of the first two. With ``lockstep`` (a sharded model, whose steps issue
    collectives) every rank runs the same steps and there is no refinement: the times are the slowest rank's, and
    only the memory measurements are this rank's own. ``training_step``: the strategy's, where the module's own
    would miss what the strategy does around it (a sharded root's forward hooks). ``min_batch``: the fewest samples
    a timed batch holds (2 with BatchNorm layers: profiling trains them on this rank's batch alone); ``min_share``:
    the fewest samples the loader gives a rank (the share plan's), so the split judged here is the one it cuts.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = profile_sizes(global_batch_size, world, min_batch)
    reserve = optimizer_reserve_bytes(module, optimizers) if device.type == "cuda" else 0

    def timed(batch_sizes: Sequence[int]) -> Optional[RankProfile]:
        with profiled(module):
            batches = sample_batches(
                dataset, collate_fn, list(indices), batch_sizes,
                lambda b: _compat.move_batch_to_device(module, b, device),
            )
            return time_rank(module, batches, training_loss(module, training_step), device, steps=steps,
                             forward_context=forward_context, headroom=headroom, step_context=step_context,
                             lockstep=lockstep)

    local = timed(sizes)
    profiles = gather_profiles(local)
    if any(p is None for p in profiles):
        return None
    result = combine(profiles, global_batch_size, [reserve] * world, max_batch_per_rank,
                     classes)  # type: ignore[arg-type]
    split = split_batch(global_batch_size, result.capacities, result.caps, min_share)
    far = [min(abs(b - s) for s in sizes) > 0.1 * b for b in split]
    # A latency-bound job is compared at the equal share, which every rank has timed: nothing to refine.
    # Identical on every rank: no collective needed.
    if lockstep or not any(far) or any(p.latency_bound() for p in profiles):
        return result
    assert local is not None
    refined = local
    if far[rank]:
        target = max(min_batch, min(split[rank], len(indices)))
        extra = timed([target])
        if extra is not None:
            near = min(range(len(local.sizes)), key=lambda i: abs(local.sizes[i] - target))
            near_peak = local.peak_bytes[near] if local.peak_bytes else 0
            points = sorted([(local.sizes[near], local.seconds[near], near_peak),
                             (target, extra.seconds[0], extra.peak_bytes[0] if extra.peak_bytes else 0)])
            refined = RankProfile(
                sizes=tuple(p[0] for p in points),
                seconds=tuple(p[1] for p in points),
                peak_bytes=tuple(p[2] for p in points) if local.peak_bytes else (),
                usable_bytes=local.usable_bytes,
                cost_s=local.cost_s + extra.cost_s,
            )
    profiles = gather_profiles(refined)
    return combine(profiles, global_batch_size, [reserve] * world, max_batch_per_rank,
                   classes)  # type: ignore[arg-type]


def table_columns(result: ProfileResult) -> dict[str, list[str]]:
    """Lab-table columns: measured samples/s at the balanced split and the memory cap (max samples)."""
    caps = result.caps or (None,) * len(result.ranks)
    return {
        "samples/s": [f"{c:.4g}" for c in result.capacities],
        "mem cap": ["-" if c is None else str(c) for c in caps],
    }
