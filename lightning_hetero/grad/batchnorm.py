"""BatchNorm over the global batch when ranks hold unequal shares of it: count-weighted statistics, on any device.

One device normalises each global batch of G samples with its mean and variance. Rank r of a heterogeneous job holds
b_r of them, so a BatchNorm layer left alone normalises over b_r samples (over 6 and 2 where one device uses 8) and
cannot train on one. :class:`SyncedBatchNorm` computes what one device computes:

- forward: each rank's count, per-channel mean and M2 (sum of squared deviations) go into one all-reduce; the
  global mean and variance follow by Chan's pairwise combination (sound in fp32, unlike a sum of squares), every
  rank normalises with them, and the running statistics take the unbiased global variance (G' / (G' - 1) with G'
  the values per channel over all ranks), so running_mean, running_var and num_batches_tracked are one device's on
  every rank;
- backward: each rank's per-channel sums of dy and dy·x̂ go into one all-reduce, as torch's ``SyncBatchNorm`` does,
  and each rank's input gradient is the global batch's; the layer's own weight and bias gradients stay local (the
  data-parallel reduction sums them).

Why the per-rank loss weighting stays exact when BatchNorm couples the ranks. Rank r back-propagates
L'_r = (b_r·W/G)·mean_r(ℓ) = (W/G)·Σ_{i∈r} ℓ_i, so Σ_r L'_r = W·L, with L the one device's mean loss over the global
batch. With global statistics every rank's forward is the one device's forward on its own samples, and the synced
backward hands each rank exactly its samples' part of ∇(Σ_s L'_s): a rank's input gradient carries the terms of every
rank's loss through the all-reduced sums. The parameter gradients of all ranks therefore add up to ∇(W·L), and the
averaging all-reduce (DDP) or reduce-scatter (FSDP) divides by W: ∇L, one device's gradient. The argument needs
every rank's loss weight to be applied *before* the coupling, on the loss; the strategy does so on every path, a comm
hook's too (:mod:`lightning_hetero.grad.weighting`), so the layer itself never weights anything.

A padding step (a rank without a sample of its own in the last global batch) re-reads a sample to keep the
collectives in step; it counts as 0 samples here, so it changes no statistic. Outside a training step (profiling,
evaluation, ``eval()``) the layer is a plain BatchNorm: no collective. Activation checkpointing's recomputation
normalises with the statistics of the forward it repeats, without a collective (see :class:`BatchNormSync`).

Example::

    plugin = SyncedBatchNormPlugin()
    model = plugin.apply(model)  # every BatchNorm layer of the model syncs while `with plugin.sync.step(...)` is open
    with plugin.sync.step(padding=False):
        loss = model(x).mean()   # forward: global statistics; backward (even after the block): global sums
    model = plugin.revert(model)  # plain BatchNorm1d/2d/3d again, for checkpoints and export
"""

from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero._compat import BatchNormBase, BatchNormXd


class Moments(NamedTuple):
    """One synced forward's statistics: what its backward and its recomputation read."""

    count: Tensor  # values per channel over all ranks
    mean: Tensor
    var: Tensor  # biased
    padding: bool  # this rank's input was a padding step's (counted as 0 samples)


class BatchNormSync:
    """What the synced layers of one model read while a training step runs: whether this step pads, and the statistics
    of each synced forward since the step began. They sync over every rank (the default group), which together hold
    the global batch.

    ``active`` is True only inside :meth:`step`: profiling runs each rank's steps on its own, and a collective there
    would wait for ranks that never join it.

    Activation checkpointing runs a block's forward again inside the backward (after the step's context has closed,
    or inside it under manual optimization). That recomputation must not communicate: the ranks' memory plans differ,
    so one rank may recompute a block another keeps, and a collective there would not pair up. It normalises with the
    statistics its first forward computed (kept per layer, in call order, until the next step) and leaves the running
    statistics alone (the first forward updated them), so it recomputes exactly what the first forward computed.
    """

    def __init__(self) -> None:
        self.active = False
        self.padding = False
        self._recorded: dict[int, deque[tuple[torch.Size, Moments]]] = {}

    @contextmanager
    def step(self, padding: bool) -> Iterator[None]:
        """Sync the forwards inside (their backwards sync whenever they run); a padding step counts 0 samples."""
        self.active, self.padding = True, padding
        self._recorded.clear()
        try:
            yield
        finally:
            self.active, self.padding = False, False

    def syncs(self) -> bool:
        return self.active and self.spans_ranks()

    def spans_ranks(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def record(self, layer: nn.Module, shape: torch.Size, moments: Moments) -> None:
        """A synced forward's statistics, for the layer's recomputation in the backward (if any)."""
        self._recorded.setdefault(id(layer), deque()).append((shape, moments))

    def forget(self, layer: nn.Module) -> None:
        """A plain forward of ``layer`` (outside a step): its recomputation is plain too."""
        self._recorded.pop(id(layer), None)

    def replay(self, layer: nn.Module, shape: torch.Size) -> Optional[Moments]:
        """The statistics of ``layer``'s oldest forward not yet recomputed (``None``: it ran plain)."""
        queue = self._recorded.get(id(layer))
        if not queue:
            return None
        recorded, moments = queue.popleft()
        if recorded != shape:
            raise RuntimeError(
                f"a synced BatchNorm layer is recomputed (activation checkpointing) on an input of shape {list(shape)} "
                f"where its forward saw {list(recorded)}: recomputations must follow the forwards' order per layer."
            )
        return moments


def _reduced_dims(x: Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _per_channel(v: Tensor, x: Tensor) -> Tensor:
    """A (C,) tensor shaped to broadcast over ``x`` (N, C, ...)."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def global_moments(x: Tensor, count_local: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(values per channel over all ranks, global mean, global biased variance), in ``x``'s dtype (fp32 or more).

    One all-reduce of a (W, 2C + 1) table in which each rank fills its own row (count, mean, M2) and leaves the others
    0, so the sum is exact; the rows are then combined in order, the same arithmetic on every rank.
    """
    channels, world, rank = x.shape[1], dist.get_world_size(), dist.get_rank()
    per_channel = x.numel() // max(channels, 1)
    table = x.new_zeros(world, 2 * channels + 1)
    if count_local and per_channel > 0:
        dims = _reduced_dims(x)
        mean = x.mean(dim=dims)
        table[rank, 0] = per_channel
        table[rank, 1 : channels + 1] = mean
        table[rank, channels + 1 :] = ((x - _per_channel(mean, x)) ** 2).sum(dim=dims)
    dist.all_reduce(table, op=dist.ReduceOp.SUM)
    count, mean, m2 = table.new_zeros(()), table.new_zeros(channels), table.new_zeros(channels)
    for row in table:
        n = row[0]
        if n == 0:
            continue
        total = count + n
        delta = row[1 : channels + 1] - mean
        mean = mean + delta * (n / total)
        m2 = m2 + row[channels + 1 :] + delta * delta * (count * n / total)
        count = total
    return count, mean, m2 / count.clamp_min(1)


def synced_moments(x: Tensor, padding: bool) -> Moments:
    """The global batch's statistics of ``x`` (one all-reduce; see :func:`global_moments`)."""
    with torch.no_grad():
        compute = x.detach() if x.dtype in (torch.float32, torch.float64) else x.detach().float()
        count, mean, var = global_moments(compute, not padding)
    if count <= 1:
        # One device raises the same for a global batch of one sample; every rank sees the same count.
        raise ValueError(f"Expected more than 1 value per channel when training, got {int(count)} over all ranks "
                         f"(this rank's input size {list(x.shape)})")
    return Moments(count, mean, var, padding)


class _SyncedBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                moments: Moments) -> Tensor:
        compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
        count, mean, var = moments.count, moments.mean, moments.var
        invstd = torch.rsqrt(var + eps)
        xhat = (compute - _per_channel(mean, compute)) * _per_channel(invstd, compute)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.to(compute.dtype), compute)
        if bias is not None:
            y = y + _per_channel(bias.to(compute.dtype), compute)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.sync_count = count
        ctx.padding = moments.padding
        ctx.has_bias = bias is not None
        ctx.input_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        xhat, invstd, weight = ctx.saved_tensors
        dy = dy.to(xhat.dtype)
        dims = _reduced_dims(xhat)
        # The layer's own parameters: this rank's part, summed over ranks by the data-parallel reduction.
        grad_weight = (dy * xhat).sum(dim=dims) if weight is not None else None
        grad_bias = dy.sum(dim=dims) if ctx.has_bias else None
        channels = xhat.shape[1]
        # A padding step's re-read sample adds nothing to the global sums (but still joins the all-reduce).
        if ctx.padding or not xhat.numel():
            sums = xhat.new_zeros(2 * channels)
        else:
            sums = torch.cat([dy.sum(dim=dims), (dy * xhat).sum(dim=dims)])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        mean_dy, mean_dy_xhat = sums[:channels] / ctx.sync_count, sums[channels:] / ctx.sync_count
        if ctx.padding:
            # Nothing of a padding step may reach the model.
            grad_x = torch.zeros_like(xhat)
        else:
            gain = invstd if weight is None else invstd * weight.to(xhat.dtype)
            grad_x = _per_channel(gain, xhat) * (
                dy - _per_channel(mean_dy, xhat) - xhat * _per_channel(mean_dy_xhat, xhat))
        return (grad_x.to(ctx.input_dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype if weight is not None else dy.dtype),
                None, None, None)


class SyncedBatchNorm(BatchNormBase):
    """A BatchNorm layer (1-D over (N, C) or (N, C, L), 2-D, 3-D) whose training statistics are the global batch's
    while its :class:`BatchNormSync` is active (see the module docstring); a plain BatchNorm otherwise.

    Made in place from an existing layer by :class:`SyncedBatchNormPlugin` (its parameters, buffers and hooks are the
    same objects), and turned back the same way.
    """

    sync: BatchNormSync
    original_class: type

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        sync = self.sync
        if self.training and sync.spans_ranks() and _compat.in_backward():
            # Activation checkpointing's recomputation: the first forward's statistics, no collective, no update.
            moments = sync.replay(self, input.shape)
            if moments is not None:
                return _SyncedBatchNormFunction.apply(input, self.weight, self.bias, self.eps, moments)
            return super().forward(input)
        if not (self.training and sync.syncs()):
            sync.forget(self)
            return super().forward(input)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        factor = self.momentum
        if factor is None:  # a cumulative moving average, as torch's BatchNorm
            factor = 1.0 / float(self.num_batches_tracked) if self.num_batches_tracked is not None else 0.0
        moments = synced_moments(input, sync.padding)
        sync.record(self, input.shape, moments)
        y = _SyncedBatchNormFunction.apply(input, self.weight, self.bias, self.eps, moments)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            count = moments.count
            unbiased = moments.var * count / (count - 1)
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(moments.mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return y


def batchnorm_layers(model: nn.Module) -> list[nn.Module]:
    """The model's BatchNorm layers (any ``_BatchNorm``: 1-D, 2-D, 3-D, torch's ``SyncBatchNorm``, ours)."""
    return [m for m in model.modules() if isinstance(m, BatchNormBase)]


class SyncedBatchNormPlugin(LayerSync):
    """``Trainer(sync_batchnorm=True)`` under the heterogeneous strategies: every BatchNorm layer becomes a
    :class:`SyncedBatchNorm` on any device (torch's ``SyncBatchNorm`` runs on CUDA only, counts a padding step's
    re-read sample, and communicates again when activation checkpointing recomputes a block on some ranks only).

    The layers are changed in place (their class only), so parameters, buffers, hooks and the optimizer's references
    stay the same objects, whether or not the model is sharded afterwards; :meth:`revert` gives each its own class
    back (torch's ``SyncBatchNorm`` becomes Lightning's plain ``_BatchNormXd``, as Lightning's revert does).
    """

    def __init__(self) -> None:
        self.sync = BatchNormSync()

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        for layer in batchnorm_layers(model):
            if isinstance(layer, SyncedBatchNorm):
                continue
            original = type(layer)
            layer.__class__ = _synced_class(original)
            layer.sync = self.sync
            layer.original_class = original
        return model

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        for layer in batchnorm_layers(model):
            if not isinstance(layer, SyncedBatchNorm):
                continue
            original = layer.original_class
            if original is nn.SyncBatchNorm:
                original = BatchNormXd
            layer.__class__ = _reverted_class(type(layer), original)
            del layer.sync, layer.original_class
        return model


def _synced_class(original: type) -> type:
    """The class a BatchNorm layer has while synced.

    - torch's and Lightning's own classes, and subclasses of torch's ``SyncBatchNorm`` (whose CUDA-only forward
      would come first): ``SyncedBatchNorm``;
    - a user's subclass (``class MyNorm(nn.BatchNorm2d)``): ``SyncedMyNorm(MyNorm, SyncedBatchNorm)``, so its own
      methods stay and its ``forward``'s ``super().forward(x)`` is the synced one (a ``forward`` that never calls it
      stays per-rank: :func:`_warn_own_forward` says so);
    - a class that sharding made (FSDP2 makes ``FSDPBatchNorm2d(FSDPModule, BatchNorm2d)``): the same mix with the
      synced class of its BatchNorm base in that base's place.
    """
    bases = tuple(b for b in original.__bases__ if not issubclass(b, BatchNormBase))
    if bases:
        norms = tuple(_synced_class(b) for b in original.__bases__ if issubclass(b, BatchNormBase))
        return _mixed(f"Synced{original.__name__}", bases + norms, original)
    if _is_library_class(original) or issubclass(original, nn.SyncBatchNorm):
        return SyncedBatchNorm
    _warn_own_forward(original)
    return _mixed(f"Synced{original.__name__}", (original, SyncedBatchNorm), None)


def _is_library_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("torch", "lightning", "pytorch_lightning", __name__.split(".")[0])


_WARNED_FORWARD: set[type] = set()


def _warn_own_forward(user_class: type) -> None:
    """Say once per class when a user's BatchNorm subclass defines its own ``forward``: it is synced only through
    ``super().forward(...)``."""
    own = [c for c in user_class.__mro__ if not _is_library_class(c) and "forward" in vars(c)]
    if own and user_class not in _WARNED_FORWARD:
        _WARNED_FORWARD.add(user_class)
        rank_zero_warn(
            f"lightning_hetero: `sync_batchnorm=True` keeps your BatchNorm class {user_class.__qualname__} and its own "
            f"`forward` ({own[0].__qualname__}.forward); its statistics are over the global batch only where that "
            "`forward` calls `super().forward(...)` (BatchNorm's), otherwise over this rank's share."
        )


def _reverted_class(current: type, original: type) -> type:
    """The layer's own class back; where sharding mixed a class in after the conversion, that mix with the layer's
    own class in place of ``SyncedBatchNorm``."""
    if current is SyncedBatchNorm or current is _synced_class(original):
        return original
    bases = tuple(b for b in current.__bases__ if not issubclass(b, SyncedBatchNorm))
    return _mixed(current.__name__.replace(SyncedBatchNorm.__name__, original.__name__), bases + (original,), current)


_MIXED: dict[tuple[type, ...], type] = {}


def _mixed(name: str, bases: tuple[type, ...], model: Optional[type]) -> type:
    """One class per set of bases, with ``model``'s own class attributes (e.g. FSDP2's ``__deepcopy__``)."""
    if bases not in _MIXED:
        own = {} if model is None else {k: v for k, v in vars(model).items() if k not in ("__dict__", "__weakref__")}
        _MIXED[bases] = type(name, bases, own)
    return _MIXED[bases]


def sync_for_strategy(current: Optional[LayerSync], model: nn.Module, world_size: int, uneven: bool,
                      refusal: Optional[str]) -> tuple[Optional[LayerSync], int]:
    """The layer sync a heterogeneous strategy applies, and the fewest samples a rank may train on.

    ``Trainer(sync_batchnorm=True)`` (Lightning's ``TorchSyncBatchNorm``) becomes :class:`SyncedBatchNormPlugin`; a
    user's own ``LayerSync`` is kept. Without one, a model with BatchNorm layers on several ranks is told once
    (:func:`warn_unsynced`) and every rank gets at least 2 samples. ``refusal``: why this job cannot sync its
    BatchNorm layers (raised as a ``ValueError`` when sync was asked for).
    """
    if type(current) is TorchSyncBatchNorm or isinstance(current, SyncedBatchNormPlugin):
        if refusal is not None:
            raise ValueError(f"`Trainer(sync_batchnorm=True)`: {refusal}")
        return (current if isinstance(current, SyncedBatchNormPlugin) else SyncedBatchNormPlugin()), 1
    if current is None and world_size > 1 and warn_unsynced(model, uneven):
        return None, 2
    return current, 1


def warn_unsynced(model: nn.Module, uneven: bool) -> bool:
    """Say once (rank 0) that a model's BatchNorm layers train on per-rank statistics; True when it has any.

    Said whether or not the shares are uneven now: profiling, rebalancing and every epoch's last partial global
    batch make them uneven later (``uneven`` only picks the wording).
    """
    layers = batchnorm_layers(model)
    if not layers:
        return False
    when = "(the shares are uneven)" if uneven else "whenever the shares are uneven (an epoch's last partial batch)"
    rank_zero_warn(
        f"lightning_hetero: the model has {len(layers)} BatchNorm layer(s) that normalise over each rank's own "
        f"share of the global batch, so their statistics, running averages and the weights differ from one "
        f"device's {when}. `Trainer(sync_batchnorm=True)` makes them exact (statistics over the global batch, "
        "weighted by each rank's count, on CPU and GPU). Until then every rank trains on at least 2 samples of each "
        "global batch (BatchNorm cannot train on one)."
    )
    return True


def synced_statistics(layer_sync: Optional[LayerSync], padding: bool) -> AbstractContextManager:
    """Around a training step: the synced BatchNorm layers' statistics over all ranks (nothing without our plugin)."""
    if not isinstance(layer_sync, SyncedBatchNormPlugin):
        return nullcontext()
    return layer_sync.sync.step(padding)
