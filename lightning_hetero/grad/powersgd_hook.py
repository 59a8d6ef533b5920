"""PowerSGD as a DDP comm hook: torch's ``PowerSGDState`` and the math of its ``powerSGD_hook``, batched for speed,
with per-parameter checkpoints and a guard that keeps non-finite steps out of the error and warm-start memories."""

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

import lightning_hetero._compat as _compat
from lightning_hetero.grad.bucket_state import BucketStates, CommCounter, Segments, elementwise_segments, nbytes
from lightning_hetero.grad.compression_config import PowerSGDCompression


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
            "error": (lambda: ps.error_dict, elementwise_segments, True),
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
        state.counter.add(state.hop, nbytes(buffer))
        # Torch's plain all-reduce for the first iterations
        return powerSGD_hook(ps, bucket)
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
    # Q is rewritten in place
    q_before = ps.q_memory_dict[idx].clone() if ps.warm_start else None
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
    # CUDA: a stream wait only
    dist.all_reduce(ps.p_memory_dict[idx], group=group, async_op=True).wait()
    # No division by W: orthogonalized anyway
    _orthogonalize(ps_, ps.orthogonalization_epsilon)
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
            for i, tensor in enumerate(copied):
                # A stacked copy: write back into the bucket
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

