"""Per-card micro-batches: a rank whose share of the global batch does not fit runs it in k pieces, exactly.

A rank with share b and a limit of m samples per forward/backward (its profiled memory cap, or an explicit
``micro_batch``) runs k = ceil(b / m) micro-batches of near-equal size inside one training step. The first k - 1 run
forward and backward under DDP's ``no_sync()`` (gradients accumulate locally, nothing is communicated); the last runs
forward in the training step and backward in Lightning's closure as usual, so the all-reduce, the comm hooks and the
optimizer step are Lightning's own. Each micro-batch's loss is scaled by its share of the rank's weight (n_j / b, or
t_j / t with ``loss_denominator="tokens"``), so the accumulated gradient is the rank's exact contribution and the
strategy's b_r / G weighting is unchanged.

Lightning zeroes gradients *after* ``training_step`` and before backward; the first k - 1 micro-batches' gradients
are therefore held aside (:class:`PendingGrads`) and added back just before the last backward. That costs one
gradient-sized buffer while the last micro-batch runs forward.

What the step returns is the rank's true mean loss Σ_j w_j · loss_j (the last micro-batch's other outputs are kept),
and ``self.log`` calls made during the micro-batches are combined into one call per name: the weighted mean for
``reduce_fx="mean"``, the sum, max or min for those, the last value for a torchmetrics ``Metric``.

Example::

    sizes = chunk_sizes(batch_size=12, limit=5)  # [4, 4, 4]
    output, pending = run_micro_batches(batch, sizes, weights, forward, backward, ddp_model.no_sync, params, module)
    # ... Lightning zeroes gradients ...
    pending.restore()  # then the last micro-batch's backward, with the DDP all-reduce
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

def micro_limits(spec: Optional[Union[str, tuple[int, ...]]], caps: Optional[Sequence[int]],
                 world_size: int) -> Optional[list[Optional[int]]]:
    """Per-rank samples per forward/backward: the explicit limit and the memory cap, whichever is smaller.

    ``None`` when micro-batching is off; an entry is ``None`` where a rank has no limit (runs its share whole).
    """
    if spec is None:
        return None
    if spec == "auto":
        return [None if caps is None else int(c) for c in (caps or [None] * world_size)]
    explicit = list(spec) * world_size if len(spec) == 1 else list(spec)
    if len(explicit) != world_size:
        raise ValueError(f"`micro_batch` has {len(explicit)} limits for {world_size} ranks.")
    if caps is None:
        return explicit  # type: ignore[return-value]
    return [min(e, int(c)) for e, c in zip(explicit, caps)]


def chunk_sizes(batch_size: int, limit: Optional[int], minimum: int = 1) -> list[int]:
    """``ceil(batch_size / limit)`` sizes differing by at most one (larger first), summing to ``batch_size``.

    None is below ``minimum`` (2 for BatchNorm layers trained on each rank's own statistics) where ``batch_size`` is
    not: that holds for every batch once ``limit >= 2 * minimum - 1`` (:func:`check_micro_limits`), and a
    ``ValueError`` says so otherwise.
    """
    if limit is None or batch_size <= limit:
        return [batch_size]
    k = math.ceil(batch_size / limit)
    base, extra = divmod(batch_size, k)
    if base < minimum:
        raise ValueError(f"a share of {batch_size} samples cannot run as micro-batches of {minimum} to {limit} "
                         f"samples: {check_micro_limits.__name__} refuses such a limit at set-up.")
    return [base + 1] * extra + [base] * (k - extra)


def check_micro_limits(limits: Sequence[Optional[int]], minimum: int) -> None:
    """Every share of at least ``minimum`` samples splits into micro-batches of ``minimum`` to ``limit`` samples iff
    ``limit >= 2 * minimum - 1`` (at ``minimum`` 2 and ``limit`` 2, a share of 3 runs as [2, 1]); else a
    ``ValueError`` naming ``data.micro_batch`` and the way out."""
    if minimum <= 1:
        return
    least = 2 * minimum - 1
    short = [r for r, m in enumerate(limits) if m is not None and m < least]
    if short:
        raise ValueError(
            f"`data.micro_batch`: rank(s) {short} run at most {[limits[r] for r in short]} samples per forward/backward"
            f" (the explicit limit or the memory cap), but the model's BatchNorm layers train on each rank's own "
            f"statistics and need at least {minimum} samples in every micro-batch, so a share of {least} could not "
            f"be split. Set `data.micro_batch` to at least {least}, or leave `data.micro_batch` off (a rank's "
            "whole share in one forward/backward)."
        )


def slice_batch(batch: Any, start: int, end: int, batch_size: int) -> Any:
    """Samples ``start:end`` of a collated batch: every tensor (and list of strings) whose first dimension is
    ``batch_size`` is sliced (views, no copy); anything else is passed to every micro-batch unchanged."""
    if isinstance(batch, Tensor):
        return batch[start:end] if batch.dim() >= 1 and batch.shape[0] == batch_size else batch
    if isinstance(batch, Mapping):
        items = {k: slice_batch(v, start, end, batch_size) for k, v in batch.items()}
        return type(batch)(items)  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        if len(batch) == batch_size and batch and all(isinstance(v, (str, bytes)) for v in batch):
            return batch[start:end]
        items = [slice_batch(v, start, end, batch_size) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*items)
        return type(batch)(items)
    return batch


def loss_of(output: Any) -> Tensor:
    """The loss a ``training_step`` returned (a tensor or ``{"loss": tensor}``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError("micro-batching needs `training_step` to return the loss tensor (or a dict with 'loss').")
    return loss


def with_loss(output: Any, loss: Tensor) -> Any:
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss


class PendingGrads:
    """Gradients of the first micro-batches, held aside while Lightning zeroes ``.grad``."""

    def __init__(self, params: Sequence[nn.Parameter], grads: Sequence[Optional[Tensor]]) -> None:
        self.params, self.grads = list(params), list(grads)

    def restore(self) -> None:
        """Add the held gradients into ``.grad`` (call right before the last micro-batch's backward)."""
        for p, g in zip(self.params, self.grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self.params, self.grads = [], []


class LogCapture:
    """Collects ``module.log`` calls per micro-batch and replays one combined call per name."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, float, tuple, dict]]] = {}
        self.weight = 1.0

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.setdefault(name, []).append((value, self.weight, args, kwargs))

    @contextmanager
    def patched(self) -> Iterator[None]:
        outer = self.module.__dict__.get("log")  # nested in another patch (profiling silences logging)
        self.module.log = self._log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log
            if outer is not None:
                self.module.log = outer  # type: ignore[method-assign]

    def combined(self) -> list[tuple[str, Any, tuple, dict]]:
        """One (name, value, args, kwargs) per name logged: the weighted combination of its calls."""
        out = []
        for name, calls in self.calls.items():
            value, _, args, kwargs = calls[-1]
            out.append((name, _combine(name, calls, kwargs.get("reduce_fx", "mean")), args, kwargs))
        return out

    def replay(self) -> None:
        for name, value, args, kwargs in self.combined():
            self.module.log(name, value, *args, **kwargs)


def _combine(name: str, calls: list[tuple[Any, float, tuple, dict]], reduce_fx: Any) -> Any:
    last = calls[-1][0]
    if len(calls) == 1 or not isinstance(last, (Tensor, int, float)):
        return last  # a torchmetrics Metric accumulated every micro-batch itself
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(()) for v, *_ in calls])
    weights = torch.tensor([w for _, w, *_ in calls], dtype=torch.float64)
    if reduce_fx in ("mean", "avg", torch.mean):
        combined = (values * weights).sum() / weights.sum().clamp_min(1e-300)
    elif reduce_fx in ("sum", torch.sum):
        combined = values.sum()
    elif reduce_fx in ("max", torch.max):
        combined = values.max()
    elif reduce_fx in ("min", torch.min):
        combined = values.min()
    else:
        rank_zero_warn(f"micro-batching logs the last micro-batch's `{name}`: its reduce_fx is not mean/sum/max/min.")
        return last
    device = last.device if isinstance(last, Tensor) else "cpu"
    dtype = last.dtype if isinstance(last, Tensor) and last.is_floating_point() else torch.float32
    return combined.to(device=device, dtype=dtype)


def run_micro_batches(
    batch: Any,
    sizes: Sequence[int],
    weights: Sequence[float],
    forward: Callable[[Any], Any],
    backward: Callable[[Tensor], None],
    no_sync: Callable[[], AbstractContextManager],
    params: Sequence[nn.Parameter],
    module: nn.Module,
) -> tuple[Any, PendingGrads]:
    """Run ``batch`` as micro-batches of ``sizes``; return the step output and the held gradients.

    ``weights`` are per sample (1 each, or its tokens); ``forward(chunk)`` runs ``training_step``; ``backward(loss)``
    back-propagates (precision scaling, accumulation divisor). The last micro-batch's backward is left to the caller.
    """
    batch_size = sum(sizes)
    if len(weights) != batch_size:
        raise RuntimeError(f"{len(weights)} sample weights for a batch of {batch_size} samples.")
    total = float(sum(weights))
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    shares = [
        (sum(weights[a:b]) / total) if total > 0 else (b - a) / batch_size for a, b in zip(bounds, bounds[1:])
    ]
    held = [p.grad for p in params]  # gradients of earlier accumulation steps (or of the last step, to be zeroed)
    for p in params:
        p.grad = None
    capture = LogCapture(module)
    accumulated: Optional[Tensor] = None
    with capture.patched():
        for j in range(len(sizes) - 1):
            capture.weight = shares[j]
            with no_sync():
                loss = loss_of(forward(slice_batch(batch, bounds[j], bounds[j + 1], batch_size)))
                backward(loss * shares[j])
            part = loss.detach() * shares[j]
            accumulated = part if accumulated is None else accumulated + part
            del loss
        pending = PendingGrads(params, [p.grad for p in params])
        for p, g in zip(params, held):
            p.grad = g
        capture.weight = shares[-1]
        output = forward(slice_batch(batch, bounds[-2], bounds[-1], batch_size))
    capture.replay()
    last = loss_of(output) * shares[-1]
    # The returned value is the rank's true mean; only the last micro-batch's term still carries a graph.
    return with_loss(output, last if accumulated is None else last + accumulated), pending
