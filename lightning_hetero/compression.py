"""Compressed gradient communication, composed with capacity weighting inside DDP's comm hook.

Every hook here is an *averaging* hook: the weighting hook (weighting.py) hands it the bucket already scaled by
b_r · W / G, so the residuals of error feedback hold weighted gradients and dividing by W gives the global mean.

* ``"fp16"`` / ``"bf16"``: torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` (divide first: no overflow).
* ``"powersgd"``: torch's ``PowerSGDState`` + ``powerSGD_hook``, plus checkpointable per-rank state and a guard that
  keeps non-finite steps out of the error and warm-start memories.
* ``"topk"``: the largest ``ratio`` of entries by magnitude, sent as values + indices with ``all_gather`` (any world
  size, gloo or NCCL), with error feedback and a DGC-style ratio warm-up.
* ``hierarchical=True``: full precision inside each host (or device class), the compressed exchange only among the
  group leaders, then a broadcast inside the group.

Example::
    >>> trainer = Trainer(strategy=HeteroDDPStrategy(compression=TopKCompression(ratio=0.01, warmup_steps=100)))
    >>> # LightningCLI YAML:
    >>> # strategy: {class_path: lightning_hetero.HeteroDDPStrategy,
    >>> #            init_args: {compression: {class_path: lightning_hetero.PowerSGDCompression,
    >>> #                                      init_args: {rank: 4, hierarchical: true}}}}
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

CompressionName = Literal["none", "fp16", "bf16", "powersgd", "topk"]
GroupBy = Literal["host", "class"]


def _check(cls: str, name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"`{cls}.{name}`={value!r} must be {what}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_hop(cls: str, hierarchical: Any, group_by: Any) -> None:
    _check(cls, "hierarchical", hierarchical, isinstance(hierarchical, bool), "True or False")
    _check(cls, "group_by", group_by, group_by in ("host", "class"), '"host" or "class"')


@dataclass(frozen=True)
class CastCompression:
    """All-reduce in half precision. ``hierarchical``: cast only on the hop between ``group_by`` groups."""

    dtype: Literal["fp16", "bf16"] = "fp16"
    hierarchical: bool = False
    group_by: GroupBy = "host"

    def __post_init__(self) -> None:
        _check("CastCompression", "dtype", self.dtype, self.dtype in ("fp16", "bf16"), '"fp16" or "bf16"')
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
        _check(c, "rank", self.rank, _is_int(self.rank) and self.rank >= 1, "a positive integer")
        _check(c, "start_iter", self.start_iter, _is_int(self.start_iter) and self.start_iter >= 0,
               "a non-negative integer")
        _check(c, "warm_start", self.warm_start, isinstance(self.warm_start, bool), "True or False")
        _check(c, "error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "True or False")
        if (self.warm_start or self.error_feedback) and self.start_iter < 2:
            raise ValueError(
                f"`PowerSGDCompression.start_iter`={self.start_iter!r} must be >= 2 with error feedback or warm start: "
                "DDP rebuilds its buckets after the first step."
            )
        _check(c, "min_compression_rate", self.min_compression_rate,
               _is_num(self.min_compression_rate) and self.min_compression_rate >= 0, ">= 0")
        _check(c, "orthogonalization_epsilon", self.orthogonalization_epsilon,
               _is_num(self.orthogonalization_epsilon) and self.orthogonalization_epsilon >= 0, ">= 0")
        _check(c, "seed", self.seed, _is_int(self.seed) and self.seed >= 0, "a non-negative integer")
        _check_hop(c, self.hierarchical, self.group_by)

    def describe(self) -> str:
        return f"powersgd(r={self.rank})"


@dataclass(frozen=True)
class TopKCompression:
    """Top-k sparsification with error feedback. During ``warmup_steps`` the kept fraction decays exponentially from
    ``warmup_ratio`` to ``ratio`` (as in Deep Gradient Compression)."""

    ratio: float = 0.01
    warmup_steps: int = 0
    warmup_ratio: float = 0.25
    error_feedback: bool = True
    hierarchical: bool = False
    group_by: GroupBy = "host"

    def __post_init__(self) -> None:
        c = "TopKCompression"
        _check(c, "ratio", self.ratio, _is_num(self.ratio) and 0 < self.ratio <= 1, "in (0, 1]")
        _check(c, "warmup_steps", self.warmup_steps, _is_int(self.warmup_steps) and self.warmup_steps >= 0,
               "a non-negative integer")
        _check(c, "warmup_ratio", self.warmup_ratio, _is_num(self.warmup_ratio)
               and (self.warmup_steps == 0 or self.ratio <= self.warmup_ratio <= 1), f"in [ratio={self.ratio}, 1]")
        _check(c, "error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "True or False")
        _check_hop(c, self.hierarchical, self.group_by)

    def ratio_at(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.ratio
        return self.warmup_ratio * (self.ratio / self.warmup_ratio) ** (step / self.warmup_steps)

    def describe(self) -> str:
        return f"topk({self.ratio:g})"


CompressionConfig = Union[CastCompression, PowerSGDCompression, TopKCompression]
CompressionArg = Union[CompressionName, CastCompression, PowerSGDCompression, TopKCompression]


def parse_compression(compression: Any) -> Optional[CompressionConfig]:
    """The typed config for ``compression`` (``None`` for ``"none"``); a ValueError for anything else."""
    if isinstance(compression, (CastCompression, PowerSGDCompression, TopKCompression)):
        return compression
    if compression is None or compression == "none":
        return None
    if compression in ("fp16", "bf16"):
        return CastCompression(dtype=compression)
    if compression == "powersgd":
        return PowerSGDCompression()
    if compression == "topk":
        return TopKCompression()
    raise ValueError(
        f"`compression`={compression!r} must be one of 'none', 'fp16', 'bf16', 'powersgd', 'topk', or a "
        "CastCompression / PowerSGDCompression / TopKCompression."
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


# -- accounting -----------------------------------------------------------------------------------------------------
def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CommCounter:
    """Bytes this rank handed to collectives since the last optimizer step, by hop ("all", "intra", "inter")."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def add(self, hop: str, nbytes: int) -> None:
        self.pending[hop] = self.pending.get(hop, 0) + nbytes

    def take(self) -> dict[str, int]:
        out, self.pending = self.pending, {}
        return out


# -- per-parameter view of per-bucket state -------------------------------------------------------------------------
Segments = Callable[[Sequence[torch.Size]], list[tuple[int, int]]]  # bucket param shapes -> (position, length)
# A kind of per-bucket state: the getter of its {bucket index: flat tensor} dict, its segments, and whether a
# parameter missing from restored state may start at zero (error feedback: yes; PowerSGD's P / Q: no).
StateKind = tuple[Callable[[], dict], Segments, bool]


def _elementwise(shapes: Sequence[torch.Size]) -> list[tuple[int, int]]:
    return [(i, math.prod(s)) for i, s in enumerate(shapes)]


class BucketStates:
    """Flat per-bucket tensors (residuals, PowerSGD error / P / Q) that checkpoint per parameter.

    DDP rebuilds its buckets after the first step, in gradient-ready order, and a resumed run starts again from the
    initial layout; a flat buffer saved in one layout would land on the wrong parameters in the other. So state is
    saved per parameter and rebuilt for whatever layout a bucket has when the hook next sees it.
    """

    def __init__(self, params: Sequence[Tensor], device: torch.device, kinds: dict[str, StateKind]) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._shapes = [p.shape for p in params]
        self._device = device
        self._kinds = kinds
        self._layouts: dict[int, tuple[int, ...]] = {}
        self._pending: dict[str, dict[int, Tensor]] = {name: {} for name in kinds}

    def observe(self, bucket: dist.GradBucket) -> None:
        """Record the bucket's layout; re-lay its state out if the layout changed or restored state waits."""
        idx = bucket.index()
        layout = tuple(self._index[id(p)] for p in bucket.parameters())
        old = self._layouts.get(idx)
        if old is not None and old != layout:
            self._split(idx, old)
        self._layouts[idx] = layout
        shapes = [self._shapes[i] for i in layout]
        for name, (get, segments, zero_fill) in self._kinds.items():
            pending = self._pending[name]
            if idx in get() or not pending:
                continue
            parts = [(layout[pos], n) for pos, n in segments(shapes)]
            present = [pending[p] for p, _ in parts if p in pending]
            if not present:
                continue
            if zero_fill or len(present) == len(parts):
                # Bucket boundaries can differ too (the first bucket is smaller until DDP rebuilds them).
                flat = [pending.pop(p).reshape(-1) if p in pending else present[0].new_zeros(n) for p, n in parts]
                get()[idx] = torch.cat(flat).to(self._device)
            else:  # a partial P / Q is of no use: torch draws a fresh one for this bucket
                for p, _ in parts:
                    pending.pop(p, None)

    def _split(self, idx: int, layout: tuple[int, ...]) -> None:
        shapes = [self._shapes[i] for i in layout]
        for name, (get, segments, _) in self._kinds.items():
            flat = get().pop(idx, None)
            if flat is None:
                continue
            offset = 0
            for pos, n in segments(shapes):
                self._pending[name][layout[pos]] = flat[offset:offset + n].detach().clone()
                offset += n

    def state_dict(self) -> dict[str, dict[int, Tensor]]:
        out = {name: {p: t.cpu() for p, t in pending.items()} for name, pending in self._pending.items()}
        for idx, layout in self._layouts.items():
            shapes = [self._shapes[i] for i in layout]
            for name, (get, segments, _) in self._kinds.items():
                flat = get().get(idx)
                if flat is None:
                    continue
                offset = 0
                for pos, n in segments(shapes):
                    out[name][layout[pos]] = flat[offset:offset + n].detach().cpu().clone()
                    offset += n
        return out

    def load_state_dict(self, state: dict[str, dict[int, Tensor]]) -> None:
        for name, (get, _, _) in self._kinds.items():
            get().clear()
            self._pending[name] = {int(p): t for p, t in state.get(name, {}).items()}
        self._layouts.clear()


# -- hooks ----------------------------------------------------------------------------------------------------------
class CastState:
    def __init__(self, dtype: str, process_group: Optional[dist.ProcessGroup], counter: CommCounter, hop: str) -> None:
        self.dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
        self.process_group = process_group
        self.counter = counter
        self.hop = hop


def cast_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16 / bf16 compress hook, counted."""
    state.counter.add(state.hop, bucket.buffer().numel() * state.dtype.itemsize)
    hook = default_hooks.fp16_compress_hook if state.dtype == torch.float16 else default_hooks.bf16_compress_hook
    return hook(state.process_group, bucket)


def _powersgd_segments(rank: int, min_rate: float, part: str) -> Segments:
    """Where each compressed tensor's P (or Q) sits in torch's flat memory: grouped by matrix shape, in order."""

    def segments(shapes: Sequence[torch.Size]) -> list[tuple[int, int]]:
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for pos, shape in enumerate(shapes):
            n = shape[0]
            m = math.prod(shape) // n
            r = min(n, m, rank)
            if _should_compress(n, m, r, min_rate)[0]:
                groups.setdefault((n, m), []).append((pos, (n if part == "p" else m) * r))
        return [seg for group in groups.values() for seg in group]

    return segments


class PowerSGDHookState:
    """torch's ``PowerSGDState`` plus what the strategy needs: accounting and per-parameter checkpoints."""

    def __init__(self, config: PowerSGDCompression, process_group: Optional[dist.ProcessGroup],
                 params: Sequence[Tensor], device: torch.device, counter: CommCounter, hop: str) -> None:
        self.powersgd = PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=config.rank,
            start_powerSGD_iter=config.start_iter,
            min_compression_rate=config.min_compression_rate,
            use_error_feedback=config.error_feedback,
            warm_start=config.warm_start,
            orthogonalization_epsilon=config.orthogonalization_epsilon,
            random_seed=config.seed,
        )
        ps = self.powersgd
        self.buckets = BucketStates(params, device, {
            "error": (lambda: ps.error_dict, _elementwise, True),
            "p": (lambda: ps.p_memory_dict, _powersgd_segments(config.rank, config.min_compression_rate, "p"), False),
            "q": (lambda: ps.q_memory_dict, _powersgd_segments(config.rank, config.min_compression_rate, "q"), False),
        })
        self.counter = counter
        self.hop = hop

    _SCALARS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self.powersgd, name) for name in self._SCALARS}
        # Plain types and tensors only: checkpoints load with `weights_only=True`.
        name, keys, pos, has_gauss, gauss = self.powersgd.rng.get_state()
        out["rng"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}
        out["buckets"] = self.buckets.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self._SCALARS:
            setattr(self.powersgd, name, state[name])
        rng = state["rng"]
        keys = rng["keys"].numpy().astype("uint32")
        self.powersgd.rng.set_state((rng["name"], keys, rng["pos"], rng["has_gauss"], rng["gauss"]))
        self.buckets.load_state_dict(state["buckets"])


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook``, counted, with error / warm-start memories kept out of non-finite steps."""
    ps = state.powersgd
    state.buckets.observe(bucket)
    idx = bucket.index()
    buffer = bucket.buffer()
    if ps.iter < ps.start_powerSGD_iter:
        state.counter.add(state.hop, _nbytes(buffer))
        return powerSGD_hook(ps, bucket)
    local_finite = torch.isfinite(buffer).all()
    error = ps.error_dict.get(idx)  # torch replaces, never mutates, the error tensor
    q = ps.q_memory_dict.get(idx)
    q = q.clone() if q is not None and ps.warm_start else None  # torch rewrites Q in place
    before = ps.total_numel_after_compression
    fut = powerSGD_hook(ps, bucket)
    state.counter.add(state.hop, (ps.total_numel_after_compression - before) * buffer.element_size())

    def guard(fut: torch.futures.Future[Tensor]) -> Tensor:
        out = fut.value()
        ok = local_finite & torch.isfinite(out).all()  # another rank's inf reaches us through P and Q
        if ps.use_error_feedback and idx in ps.error_dict:
            keep = error if error is not None else torch.zeros_like(ps.error_dict[idx])
            ps.error_dict[idx] = torch.where(ok, ps.error_dict[idx], keep)
        if q is not None and idx in ps.q_memory_dict:
            ps.q_memory_dict[idx] = torch.where(ok, ps.q_memory_dict[idx], q)
        return out

    return fut.then(guard)


class TopKState:
    """Residuals (per bucket, checkpointed per parameter) and the step counter of the ratio warm-up."""

    def __init__(self, config: TopKCompression, process_group: Optional[dist.ProcessGroup],
                 params: Sequence[Tensor], device: torch.device, counter: CommCounter, hop: str) -> None:
        self.config = config
        self.process_group = process_group
        self.residuals: dict[int, Tensor] = {}
        self.buckets = BucketStates(params, device, {"residual": (lambda: self.residuals, _elementwise, True)})
        self.steps = 0
        self.counter = counter
        self.hop = hop

    def k_for(self, numel: int) -> int:
        return max(1, int(numel * self.config.ratio_at(self.steps)))

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "buckets": self.buckets.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.buckets.load_state_dict(state["buckets"])


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the ``k`` largest-magnitude entries of every rank (values + indices through ``all_gather``).

    With error feedback, what is not sent is added to the next step's bucket. A non-finite bucket is selected first
    (so every rank receives the inf / NaN and skips the step alike) and leaves the residual as it was.

    Example::
        >>> state = TopKState(TopKCompression(ratio=0.01), None, list(model.parameters()), device, CommCounter(), "all")
        >>> ddp_model.register_comm_hook(state, topk_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    state.buckets.observe(bucket)
    idx = bucket.index()
    buffer = bucket.buffer()
    acc = buffer
    if state.config.error_feedback:
        residual = state.residuals.get(idx)
        acc = buffer + residual if residual is not None else buffer
    k = state.k_for(buffer.numel())
    inf = float("inf")
    _, indices = torch.topk(acc.abs().nan_to_num(nan=inf, posinf=inf), k, sorted=False)
    values = acc[indices]
    if state.config.error_feedback:
        unsent = acc.index_fill(0, indices, 0)
        previous = residual if residual is not None else torch.zeros_like(unsent)
        state.residuals[idx] = torch.where(torch.isfinite(acc).all(), unsent, previous)
    indices = indices.to(torch.int32 if buffer.numel() < 2**31 else torch.int64)
    all_values = values.new_empty(world * k)
    all_indices = indices.new_empty(world * k)
    # Both collectives are issued here, in the caller's thread, so every rank issues them in the same order.
    values_fut = dist.all_gather_into_tensor(all_values, values, group=group, async_op=True).get_future()
    indices_fut = dist.all_gather_into_tensor(all_indices, indices, group=group, async_op=True).get_future()
    state.counter.add(state.hop, _nbytes(values) + _nbytes(indices))
    if bucket.is_last():
        state.steps += 1

    def decompress(_: Any) -> Tensor:
        values_fut.wait()  # chained on a collective's own future, so a CUDA result keeps its stream semantics
        buffer.zero_()
        # One rank at a time: a rank's indices are distinct, so each index_add_ is free of races (deterministic).
        for v, i in zip(all_values.view(world, k), all_indices.view(world, k)):
            buffer.index_add_(0, i.long(), v)
        return buffer.div_(world)

    return indices_fut.then(decompress)


class HierarchicalState:
    """Full-precision sum inside this rank's group; ``inner_hook`` among the group leaders; broadcast back."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        leader: int,
        leaders: Optional[dist.ProcessGroup],
        num_leaders: int,
        world_size: int,
        inner_hook: Callable,
        inner_state: Any,
        counter: CommCounter,
    ) -> None:
        self.group = group
        self.leader = leader
        self.leaders = leaders
        self.num_leaders = num_leaders
        self.world_size = world_size
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.counter = counter


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average over all ranks with the inner (compressed) hook on the slow hop only.

    Group sums S_g are scaled by L / W before the inner hook averages over the L leaders: Σ_g S_g / W, the right
    mean for groups of any size. Each step waits for the previous one before issuing the next collective, so the
    order of collectives on every group is the same on all its ranks (with NCCL the waits are stream waits).
    """
    buffer = bucket.buffer()
    state.counter.add("intra", _nbytes(buffer))
    dist.all_reduce(buffer, group=state.group)
    if state.leaders is not None:
        buffer.mul_(state.num_leaders / state.world_size)
        out = state.inner_hook(state.inner_state, bucket).wait()
        if out.data_ptr() != buffer.data_ptr():
            buffer.copy_(out)
    state.counter.add("intra", _nbytes(buffer))
    dist.broadcast(buffer, src=state.leader, group=state.group)
    # A CUDA result needs a device-aware future (it records the stream the collectives ran on).
    fut: torch.futures.Future[Tensor] = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    fut.set_result(buffer)
    return fut


# -- what the strategy holds ----------------------------------------------------------------------------------------
class GradientCompression:
    """Builds the compression hook for one DDP model, counts bytes per step and checkpoints per-rank state.

    ``groups``: the strategy's :class:`~lightning_hetero.lab.LabGroups` (needed for ``hierarchical``).
    """

    def __init__(self, config: Optional[CompressionConfig], params: Sequence[Tensor], world_size: int,
                 device: torch.device, groups: Any = None) -> None:
        self.config = config
        self.counter = CommCounter()
        self.bytes_last_step: Optional[int] = None
        self.bytes_by_hop_last_step: dict[str, int] = {}
        self._dense_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        self.hook: Optional[Callable] = None
        self.state: Any = None
        self._stateful: Any = None
        if config is None:
            return
        hierarchical = config.hierarchical and groups is not None
        process_group = groups.leaders[config.group_by] if hierarchical else None
        hop = "inter" if hierarchical else "all"
        if isinstance(config, CastCompression):
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
            )
            hook = hierarchical_hook
        self.hook, self.state = hook, state

    def end_step(self) -> None:
        """Close the optimizer step's byte count (hooks fire only on synchronizing steps)."""
        by_hop = self.counter.take()
        if self.config is None:
            by_hop = {"all": self._dense_bytes}  # no hook of ours: DDP all-reduces every gradient at full size
        self.bytes_by_hop_last_step = by_hop
        self.bytes_last_step = sum(by_hop.values())

    def state_dict(self) -> dict[str, Any]:
        return self._stateful.state_dict() if self._stateful is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._stateful is not None and state:
            self._stateful.load_state_dict(state)
