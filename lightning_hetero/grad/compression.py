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
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

import lightning_hetero._compat as _compat
from lightning_hetero.config import check, is_int, is_number
from lightning_hetero.observe.naming import running_strategy

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


CompressionConfig = Union[NoCompression, CastCompression, PowerSGDCompression, TopKCompression]
CompressionArg = Union[CompressionName, NoCompression, CastCompression, PowerSGDCompression, TopKCompression]


def parse_compression(compression: Any) -> Any:
    """The typed config for ``compression`` (``None`` for ``"none"``; an
    :class:`~lightning_hetero.grad.autocompress.AutoCompression` for ``"auto"``, resolved once the links are measured);
    a ValueError for anything else."""
    from lightning_hetero.grad.autocompress import AutoCompression  # it builds the configs of this module

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


def allreduce_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's averaging all-reduce hook, counted (``state.dtype`` unused)."""
    state.counter.add(state.hop, _nbytes(bucket.buffer()))
    return default_hooks.allreduce_hook(state.process_group, bucket)


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
            if _compat.powersgd_should_compress(n, m, r, min_rate)[0]:
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


def _orthogonalize(matrices: Sequence[Tensor], epsilon: float) -> None:
    """Orthonormalize the columns of every ``(batch, rows, r)`` tensor in place, in one batched call per ``r``:
    shorter matrices are padded with zero rows, which change no norm, inner product or Householder reflection.

    On CUDA torch's Gram-Schmidt (about 8 small kernels per column, whatever the batch); elsewhere torch's choice
    (LAPACK's QR for r > 2 in full precision: faster on a CPU). torch's hook runs a QR per matrix on CUDA too.
    """
    cuda = bool(matrices) and matrices[0].is_cuda
    orthogonalize = _compat.powersgd_orthogonalize_gram_schmidt if cuda else _compat.powersgd_orthogonalize
    by_rank: dict[int, list[Tensor]] = {}
    for x in matrices:
        by_rank.setdefault(x.shape[2], []).append(x)
    for group in by_rank.values():
        if len(group) == 1:
            orthogonalize(group[0], epsilon)
            continue
        padded = group[0].new_zeros(sum(x.shape[0] for x in group), max(x.shape[1] for x in group), group[0].shape[2])
        views, offset = [], 0
        for x in group:
            views.append(padded[offset:offset + x.shape[0], :x.shape[1]])
            views[-1].copy_(x)
            offset += x.shape[0]
        orthogonalize(padded, epsilon)
        for x, view in zip(group, views):
            x.copy_(view)


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (rank r, error feedback, warm start) on ``PowerSGDState``, the math of torch's ``powerSGD_hook``.

    Per bucket: M += error; P = M Q (Q warm-started, orthogonalized); all-reduce P; orthogonalize P; Q = Mᵀ P;
    all-reduce Q; M ≈ P Qᵀ / W; error = M - P Qᵀ / W. Tensors that would not shrink by ``min_compression_rate``
    are all-reduced as they are. P and Q memories keep torch's layout (matrices grouped by shape, in order), so they
    checkpoint the same way. What differs from torch's hook, for speed: on CUDA same-shape matrices go through one
    batched matmul; each orthogonalization of a bucket is one batched call (Gram-Schmidt on CUDA, where torch's hook
    runs a QR per matrix for r > 2); Q is drawn in one host-to-device copy; and there is no device-wide synchronize
    per bucket. The collectives are issued in the caller's thread, in the same order on every rank. A non-finite step
    (on any rank) leaves the error and Q memories as they were.

    Example::
        >>> state = PowerSGDHookState(PowerSGDCompression(rank=4), None, list(model.parameters()), device,
        ...                           CommCounter(), "all")
        >>> ddp_model.register_comm_hook(state, powersgd_hook)
    """
    ps = state.powersgd
    state.buckets.observe(bucket)
    idx = bucket.index()
    buffer = bucket.buffer()
    if ps.iter < ps.start_powerSGD_iter:
        state.counter.add(state.hop, _nbytes(buffer))
        return powerSGD_hook(ps, bucket)  # torch's plain all-reduce for the first iterations
    group = ps.process_group if ps.process_group is not None else dist.group.WORLD
    world = group.size()
    error = ps.error_dict.get(idx)
    if ps.use_error_feedback and error is not None:
        buffer.add_(error)
    memory = buffer.detach().clone() if ps.use_error_feedback else None

    # Which tensors are compressed, grouped by matrix shape in order of appearance (torch's P / Q layout).
    shapes: dict[tuple[int, int], list[Tensor]] = {}
    uncompressed: list[Tensor] = []
    for tensor in bucket.gradients():
        n = tensor.shape[0] if tensor.dim() > 0 else 1
        m = tensor.numel() // n
        compress, before, after = _compat.powersgd_should_compress(n, m, min(n, m, ps.matrix_approximation_rank),
                                                   ps.min_compression_rate)
        ps.total_numel_before_compression += before
        ps.total_numel_after_compression += after if compress else before
        if compress:
            shapes.setdefault((n, m), []).append(tensor.view(n, m))
        else:
            uncompressed.append(tensor)
    flat = torch.cat([t.reshape(-1) for t in uncompressed]) if uncompressed else buffer.new_empty(0)
    flat_fut = dist.all_reduce(flat, group=group, async_op=True).get_future()

    sizes = [(len(ts), n, m, min(n, m, ps.matrix_approximation_rank)) for (n, m), ts in shapes.items()]
    fresh = not ps.warm_start or idx not in ps.p_memory_dict
    if fresh:
        ps.p_memory_dict[idx] = buffer.new_empty(sum(b * n * r for b, n, _, r in sizes))
        # Drawn on the host like torch does (one seed per bucket and step from the state's RNG, one draw per matrix:
        # the same Q as torch's hook), then copied to the device at once.
        rng = torch.Generator().manual_seed(int(ps.rng.randint(1_000_000_000)))
        draws = [torch.randn(m * r, generator=rng, dtype=buffer.dtype) for b, _, m, r in sizes for _ in range(b)]
        ps.q_memory_dict[idx] = (torch.cat(draws) if draws else buffer.new_empty(0).cpu()).to(buffer.device)
    q_before = ps.q_memory_dict[idx].clone() if ps.warm_start else None  # Q is rewritten in place
    # On CUDA same-shape matrices are stacked into one batch (one kernel, not one per matrix); on a CPU the copy
    # costs more than the calls it saves. The P / Q layout is the same either way.
    stack = buffer.is_cuda
    mats, ps_, qs, copies = [], [], [], []
    p_off = q_off = 0
    for ((n, m), ts), (b, _, _, r) in zip(shapes.items(), sizes):
        for batch in ([ts] if stack else [[t] for t in ts]):
            k = len(batch)
            mats.append(batch[0].unsqueeze(0) if k == 1 else torch.stack(batch))
            copies.append(batch if k > 1 else [])
            ps_.append(ps.p_memory_dict[idx][p_off:p_off + k * n * r].view(k, n, r))
            qs.append(ps.q_memory_dict[idx][q_off:q_off + k * m * r].view(k, m, r))
            p_off += k * n * r
            q_off += k * m * r
    _orthogonalize(qs, ps.orthogonalization_epsilon)
    for mat, q, p in zip(mats, qs, ps_):
        torch.bmm(mat, q, out=p)
    dist.all_reduce(ps.p_memory_dict[idx], group=group, async_op=True).wait()  # CUDA: a stream wait only
    _orthogonalize(ps_, ps.orthogonalization_epsilon)  # no division by W: orthogonalized anyway
    for mat, p, q in zip(mats, ps_, qs):
        torch.bmm(mat.transpose(1, 2), p, out=q)
    q_fut = dist.all_reduce(ps.q_memory_dict[idx], group=group, async_op=True).get_future()
    state.counter.add(state.hop, (flat.numel() + p_off + q_off) * buffer.element_size())
    ps.maybe_increase_iter(bucket)

    def decompress(fut: torch.futures.Future[Any]) -> Tensor:
        fut.wait()
        reduced = flat_fut.wait()[0].div_(world)
        offset = 0
        for tensor in uncompressed:
            tensor.copy_(reduced[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        ps.q_memory_dict[idx].div_(world)
        for mat, p, q, copied in zip(mats, ps_, qs, copies):
            torch.bmm(p, q.transpose(1, 2), out=mat)
            for i, tensor in enumerate(copied):  # a stacked copy: write back into the bucket
                tensor.copy_(mat[i])
        # Any rank's inf / NaN reaches every rank's Q (through P = M Q and its all-reduce) or the uncompressed sum:
        # checking those small tensors is checking the bucket.
        ok = torch.isfinite(ps.q_memory_dict[idx]).all() & torch.isfinite(reduced).all()
        if memory is not None:
            # In place (no second full-size buffer): M - P Qᵀ / W where finite, else the previous error.
            previous = error if error is not None else memory.new_zeros(())
            ps.error_dict[idx] = torch.where(ok, memory.sub_(buffer), previous, out=memory)
        if q_before is not None:
            ps.q_memory_dict[idx] = torch.where(ok, ps.q_memory_dict[idx], q_before)
        if not ps.warm_start:
            ps.p_memory_dict.pop(idx, None)
            ps.q_memory_dict.pop(idx, None)
        return buffer

    return q_fut.then(decompress)


class TopKState:
    """Residuals and momentum-correction velocities (per bucket, checkpointed per parameter) and the step counter of
    the ratio warm-up."""

    def __init__(self, config: TopKCompression, process_group: Optional[dist.ProcessGroup],
                 params: Sequence[Tensor], device: torch.device, counter: CommCounter, hop: str) -> None:
        self.config = config
        self.process_group = process_group
        self.residuals: dict[int, Tensor] = {}
        self.velocities: dict[int, Tensor] = {}
        self.buckets = BucketStates(params, device, {"residual": (lambda: self.residuals, _elementwise, True),
                                                     "velocity": (lambda: self.velocities, _elementwise, True)})
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

    With error feedback, what is not sent is added to the next step's bucket. With ``momentum`` the bucket first goes
    into this rank's velocity, and the velocity is what accumulates and is sent (see :class:`TopKCompression`). A
    non-finite bucket is selected first (so every rank receives the inf / NaN and skips the step alike) and leaves
    the residual and the velocity as they were.

    Example::
        >>> state = TopKState(TopKCompression(ratio=0.01), None, list(model.parameters()), device, CommCounter(), "all")
        >>> ddp_model.register_comm_hook(state, topk_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    state.buckets.observe(bucket)
    idx = bucket.index()
    buffer = bucket.buffer()
    config = state.config
    acc = buffer
    velocity = state.velocities.get(idx)
    if config.momentum > 0:  # new tensors, never in place: a non-finite step restores the previous ones
        acc = velocity * config.momentum + buffer if velocity is not None else buffer.clone()
        updated_velocity = acc
    if config.error_feedback:
        residual = state.residuals.get(idx)
        acc = acc + residual if residual is not None else acc
    k = state.k_for(buffer.numel())
    inf = float("inf")
    _, indices = torch.topk(acc.abs().nan_to_num(nan=inf, posinf=inf), k, sorted=False)
    values = acc[indices]
    if config.error_feedback or config.momentum > 0:
        finite = torch.isfinite(acc).all()
    if config.error_feedback:
        unsent = acc.index_fill(0, indices, 0)
        state.residuals[idx] = torch.where(finite, unsent, residual if residual is not None else 0.0)
    if config.momentum > 0:
        if config.momentum_masking:
            updated_velocity = updated_velocity.index_fill(0, indices, 0)
        state.velocities[idx] = torch.where(finite, updated_velocity, velocity if velocity is not None else 0.0)
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
        pacer: Any = None,
    ) -> None:
        self.group = group
        self.leader = leader
        self.leaders = leaders
        self.num_leaders = num_leaders
        self.world_size = world_size
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.counter = counter
        self.pacer = pacer  # an emulated inter-host link (emulation.LinkPacer) on the leaders' hop, or None
        self.stream: Optional[torch.cuda.Stream] = None  # CUDA: the side stream the two-level exchange runs on


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average over all ranks with the inner (compressed) hook on the slow hop only.

    Group sums S_g are scaled by L / W before the inner hook averages over the L leaders: Σ_g S_g / W, the right
    mean for groups of any size. Each step waits for the previous one before issuing the next collective, so the
    order of collectives on every group is the same on all its ranks (with NCCL the waits are stream waits). On CUDA
    the three steps run on a side stream, so the backward pass goes on while a bucket crosses the hosts.
    """
    buffer = bucket.buffer()
    stream = None
    if buffer.is_cuda:
        if state.stream is None:
            state.stream = torch.cuda.Stream(device=buffer.device)
        stream = state.stream
        stream.wait_stream(torch.cuda.current_stream(buffer.device))  # the bucket's gradients are ready there
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        state.counter.add("intra", _nbytes(buffer))
        dist.all_reduce(buffer, group=state.group)
        if state.leaders is not None:
            buffer.mul_(state.num_leaders / state.world_size)
            sent = state.counter.pending.get("inter", 0)
            out = state.inner_hook(state.inner_state, bucket).wait()
            if out.data_ptr() != buffer.data_ptr():
                buffer.copy_(out)
            if state.pacer is not None:
                state.pacer.transfer(state.counter.pending.get("inter", 0) - sent)
                if bucket.is_last():
                    state.pacer.settle()  # before the broadcast: the group waits for what crossed the slow link
        state.counter.add("intra", _nbytes(buffer))
        dist.broadcast(buffer, src=state.leader, group=state.group)
        # A CUDA result needs a device-aware future: set here, it records the side stream, which DDP then waits on.
        fut: torch.futures.Future[Tensor] = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        fut.set_result(buffer)
    return fut


# -- what the strategy holds ----------------------------------------------------------------------------------------
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
        self._compressing: tuple[int, ...] = tuple(range(world_size))  # ranks whose hook runs the compression
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
        if not isinstance(self.config, TopKCompression) or self.config.momentum == 0:
            return
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                own = group.get("momentum") or (group.get("betas") or (0.0,))[0]
                if own:
                    rank_zero_warn(
                        f"`TopKCompression.momentum`={self.config.momentum} applies momentum in the gradient hook, and "
                        f"{type(optimizer).__name__} adds its own ({own}): momentum is applied twice. Use "
                        "`SGD(momentum=0)` / `Adam(betas=(0, ...))`, or `TopKCompression(momentum=0)`."
                    )
                    return

    def end_step(self) -> None:
        """Close the optimizer step's byte count (hooks fire only on synchronizing steps)."""
        by_hop = self.counter.take()
        if self.config is None:
            by_hop = {"all": self._dense_bytes}  # no hook of ours: DDP all-reduces every gradient at full size
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
