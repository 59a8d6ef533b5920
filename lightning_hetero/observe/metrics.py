"""Logged metrics under unequal shares: what Lightning reduces across ranks equals one process's number.

Lightning reduces every ``self.log(..., sync_dist=True)`` value through the strategy's ``reduce``:

- inside a step, a batch value; with the default ``reduce_fx="mean"`` it is a mean over this rank's batch, and the
  ranks' batches differ in size, so the mean over ranks is weighted by each rank's batch size;
- at epoch end, each rank's accumulated sum (``Σ value x batch size``, or the sum, max, min of values) and, for a
  mean, its sample count, an integer tensor; Lightning divides the mean of the sums by the mean of the counts. The
  counts differ by design here, and a mean of integers truncates ((28 + 9) / 2 = 18), so the count is averaged in
  floating point (exact: the ratio of the two means is the ratio of the two sums).

A *padding* step (a rank with no sample of its own in a global batch, weight 0) re-reads a real sample to keep
collectives in step; it must count nowhere: inside it, this rank contributes the reduction's identity (weight 0 to
a mean, 0 to a sum, -inf to a max, +inf to a min), and :func:`discard_padding_step` restores the epoch
accumulations (Lightning's and the module's ``torchmetrics.Metric`` states) to what they were before it.

``sync_dist=False`` reduces nothing: an epoch value is each rank's own mean (rank 0's is what loggers and
``ModelCheckpoint(monitor=...)`` read), over its share of the samples only.
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_hetero._compat as _compat

# Reduction names as Lightning passes them (`reduce_fx.__name__`) or as torch's ReduceOp ends (`RedOpType.AVG`).
_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
# What a padding step contributes to each reduction: nothing.
_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}


def reduction_name(reduce_op: Optional[Union[dist.ReduceOp, str]]) -> Optional[str]:
    """``"mean"``, ``"sum"``, ``"max"``, ``"min"`` (``None``: mean, as Lightning's default), or ``None`` if other."""
    if reduce_op is None:
        return "mean"
    key = str(reduce_op).lower()
    return _OPS.get(key.rsplit(".", 1)[-1])


def reduce_logged(tensor: Tensor, reduce_op: Optional[Union[dist.ReduceOp, str]], step_weight: Optional[float],
                  weighted_mean: Callable[[Tensor], Tensor],
                  reduce: Callable[[Tensor, Union[dist.ReduceOp, str, None]], Tensor]) -> Tensor:
    """``tensor`` reduced over ranks as one process would have computed it (see the module docstring).

    ``step_weight``: this rank's samples in the running step (``None`` outside a step, 0 in a padding step).
    ``weighted_mean`` reduces a mean weighted by ``step_weight``; ``reduce`` is the parallelism's own reduction.

    Example::

        def reduce(self, tensor, group=None, reduce_op="mean"):
            return reduce_logged(tensor, reduce_op, self.step_weight, self.weighted_mean,
                                 lambda t, op: super().reduce(t, group=group, reduce_op=op))
    """
    name = reduction_name(reduce_op)
    if name == "mean":
        if step_weight is not None:
            return weighted_mean(tensor)
        # An epoch's sample count is an integer tensor: averaged in float64, not truncated (the mean is sum / count).
        return reduce(tensor if tensor.is_floating_point() else tensor.to(torch.float64), reduce_op)
    if step_weight == 0 and name in _IDENTITY and tensor.is_floating_point():
        tensor = torch.full_like(tensor, _IDENTITY[name])
    return reduce(tensor, reduce_op)


def _epoch_states(trainer: Any) -> dict[str, tuple[Tensor, Optional[Tensor]]]:
    results = _compat.logged_results(trainer)
    states = {}
    for key, metric in (results or {}).items():
        if metric.is_tensor and metric.meta.on_epoch:
            count = getattr(metric, "cumulated_batch_size", None)
            states[key] = (metric.value.clone(), None if count is None else count.clone())
    return states


def _metric_states(module: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    from torchmetrics import Metric

    def copy(value: Any) -> Any:
        return value.clone() if isinstance(value, Tensor) else list(value) if isinstance(value, list) else value

    return [(m, {name: copy(value) for name, value in m.metric_state.items()})
            for m in module.modules() if isinstance(m, Metric)]


@contextmanager
def discard_padding_step(trainer: Optional[Any], module: Optional[torch.nn.Module], padding: bool) -> Iterator[None]:
    """Around a step: if it is a padding step, the epoch accumulations it made are undone afterwards.

    Lightning's ``self.log`` accumulations get back their values before the step (a key first logged in it starts
    empty: 0, -inf or +inf, count 0), and every ``torchmetrics.Metric`` of ``module`` its states. Step-level values
    are reduced with this rank's weight 0 (:func:`reduce_logged`).
    """
    if not padding or trainer is None or module is None:
        yield
        return
    before, metrics = _epoch_states(trainer), _metric_states(module)
    yield
    for key, metric in (_compat.logged_results(trainer) or {}).items():
        if not (metric.is_tensor and metric.meta.on_epoch):
            continue
        value, count = before.get(key, (None, None))
        if value is None:
            empty = float("-inf") if metric.meta.is_max_reduction else float("inf") if (
                metric.meta.is_min_reduction) else 0.0
            metric.value = torch.full_like(metric.value, empty)
            if getattr(metric, "cumulated_batch_size", None) is not None:
                metric.cumulated_batch_size = torch.zeros_like(metric.cumulated_batch_size)
            continue
        metric.value = value
        if count is not None:
            metric.cumulated_batch_size = count
    for metric, states in metrics:
        for name, value in states.items():
            setattr(metric, name, value)


def evaluation_padding(loaders: Any, batch_idx: Optional[int], dataloader_idx: int) -> bool:
    """Whether this rank's evaluation batch ``batch_idx`` of loader ``dataloader_idx`` is a padding step."""
    if batch_idx is None:
        return False
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, Sequence):
        loaders = [loaders]
    if dataloader_idx >= len(loaders):
        return False
    loader = loaders[dataloader_idx]
    # A stream loader's splitter knows its padding steps; its torch batch sampler only counts samples.
    sampler = getattr(loader, "splitter", None) or _compat.unwrap_index_batch_sampler(
        getattr(loader, "batch_sampler", None))
    is_padding = getattr(sampler, "is_padding", None)
    return bool(is_padding(batch_idx)) if is_padding is not None else False


def step_indices(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Optional[int], int]:
    """(batch_idx, dataloader_idx) of an evaluation step's arguments ``(batch, batch_idx[, dataloader_idx])``."""
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
    dataloader_idx = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
    return batch_idx, int(dataloader_idx or 0)
