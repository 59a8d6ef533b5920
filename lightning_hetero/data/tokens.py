"""Per-sample costs (tokens) for splitting variable-length batches by work rather than by sample count.

With ``balance="tokens"`` the strategy cuts every global batch so each rank's summed cost matches its capacity
(:func:`lightning_hetero.plan.split.split_by_cost`); with ``loss_denominator="tokens"`` a step's gradient weight is the
rank's share of the batch's cost, t_r / T, which is exact for a loss averaged over tokens:

    mean over the batch's T tokens = Σ_r (t_r / T) · (mean over rank r's t_r tokens)

(``loss_denominator="samples"``, the default, keeps b_r / G for a loss averaged over samples.)

``balance="padded_tokens"`` balances what a collate that pads to the longest sample computes: a rank's sample count
times its longest sample's cost.

The cost of a sample is, in this order of precedence:

1. ``sample_cost="package.module.function"``: a function imported by dotted path, called on each dataset item. Any
   importable callable runs: a config file that sets it is code, as a LightningCLI ``class_path`` is, so run only
   configs you trust. The target must take one argument and return a number >= 0 for every item; a failure names
   the function and the item;
2. a ``lengths`` attribute of the dataset (one number per index; no item is read);
3. a ``sample_cost(sample)`` method of the LightningModule, called on each dataset item;
4. otherwise the length (first dimension) of the first tensor with at least one dimension in the item.

With ``loss_denominator="tokens"`` the cost must be the number of elements the loss averages over for that sample
(e.g. ``len - 1`` for next-token prediction): it is what makes the weights exact.

Costs are computed once per training loader and cached: each rank reads every world-size-th item and one
``all_gather`` shares the table, so no rank reads more than its part of the dataset.

Example::

    costs = dataset_costs(dataset, resolve_cost_fn(None, module, dataset), rank, world, device)
    sampler.use_costs(costs, balance=True, weight=True)
"""

import importlib
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

Balance = Literal["samples", "tokens", "padded_tokens"]
Denominator = Literal["samples", "tokens"]
CostFn = Callable[[Any], float]


def first_sequence_length(sample: Any) -> float:
    """The first dimension of the first tensor with at least one dimension in ``sample`` (depth first)."""
    found = _first_sequence(sample)
    if found is None:
        raise ValueError(
            f"no tensor with a sequence dimension in a sample of type {type(sample).__name__}: give the dataset a "
            "`lengths` attribute, the LightningModule a `sample_cost(sample)` method, or `sample_cost=` a dotted path."
        )
    return float(found.shape[0])


def _first_sequence(item: Any) -> Optional[Tensor]:
    if isinstance(item, Tensor):
        return item if item.dim() >= 1 else None
    if isinstance(item, Mapping):
        item = list(item.values())
    if isinstance(item, (list, tuple)):
        for value in item:
            found = _first_sequence(value)
            if found is not None:
                return found
    return None


def import_cost_fn(path: str) -> CostFn:
    """The function at ``"package.module.function"``; ``ValueError`` naming ``sample_cost`` otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"`sample_cost`={path!r} is not a dotted path 'package.module.function'.")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"`sample_cost`={path!r} cannot be imported: {err}") from err
    if not callable(fn):
        raise ValueError(f"`sample_cost`={path!r} is not callable.")
    try:
        inspect.signature(fn).bind(None)
    except TypeError as err:
        raise ValueError(f"`sample_cost`={path!r} must take one argument (a dataset item): {err}") from err
    except ValueError:  # a builtin without a signature: the first call tells
        pass
    return fn


def _cost_of(cost_fn: CostFn, item: Any, index: int) -> float:
    """``cost_fn(item)`` as a float; a ``ValueError`` naming the function and the item when it fails (the value
    itself is checked with the others by :func:`~lightning_hetero.plan.split.validate_costs`)."""
    try:
        return float(cost_fn(item))
    except Exception as err:  # noqa: BLE001 - whatever the user's function raised, said with its context
        name = f"{getattr(cost_fn, '__module__', None) or ''}.{getattr(cost_fn, '__qualname__', repr(cost_fn))}"
        raise ValueError(
            f"the sample cost {name.lstrip('.')} failed on dataset item {index} ({type(item).__name__}): "
            f"{type(err).__name__}: {err}. Set `sample_cost` to a function item -> number, or give the dataset "
            "`lengths` or the LightningModule a `sample_cost(sample)` method."
        ) from err


def resolve_cost_fn(spec: Optional[str], module: Any, dataset: Any) -> Optional[CostFn]:
    """The per-item cost function by the precedence above; ``None`` when the dataset's ``lengths`` give the costs."""
    if spec is not None:
        return import_cost_fn(spec)
    if getattr(dataset, "lengths", None) is not None:
        return None
    method = getattr(module, "sample_cost", None)
    return method if callable(method) else first_sequence_length


def dataset_costs(dataset: Any, cost_fn: Optional[CostFn], rank: int, world_size: int,
                  device: torch.device) -> list[float]:
    """Every index's cost, identical on every rank (a collective when items must be read and ``world_size > 1``)."""
    n = len(dataset)
    if cost_fn is None:
        lengths = [float(v) for v in dataset.lengths]
        if len(lengths) != n:
            raise ValueError(f"the dataset's `lengths` has {len(lengths)} entries for {n} samples.")
        return lengths
    per_rank = -(-n // world_size)
    mine = torch.full((per_rank,), -1.0, dtype=torch.float64)
    for k, i in enumerate(range(rank, n, world_size)):
        mine[k] = _cost_of(cost_fn, dataset[i], i)
    if world_size == 1:
        return mine[:n].tolist()
    # gloo and NCCL both gather float64; the table goes to the device the process group uses.
    local = mine.to(device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    table = torch.stack(gathered).cpu()  # row r holds indices r, r + W, ...
    return table.t().reshape(-1)[:n].tolist()
