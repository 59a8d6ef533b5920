"""The user's loaders, rebuilt around the strategy's batch sampler the way Lightning injects its own sampler.

Every loader Lightning hands the strategy is re-instantiated from the user's own class and constructor arguments
(recorded by Lightning while the ``*_dataloader`` hooks run; read from the instance's attributes otherwise), with
``batch_sampler`` replaced: a ``DataLoader`` subclass and every argument it was given survive. The global order the
batch sampler cuts into shares comes from the user's sampler (:func:`global_order`).
"""

import inspect
import os
from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

import lightning_hetero._compat as _compat
from lightning_hetero.data.sampler import GlobalOrder

# What a loader built around a batch sampler must not also be given (DataLoader refuses the combination).
_BATCHING_ARGS = {"batch_size": 1, "shuffle": False, "sampler": None, "drop_last": False}


def global_seed() -> int:
    """The job's seed (``seed_everything`` sets it for every rank)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def global_order(sampler: object, num_samples: int, loader_name: str) -> GlobalOrder:
    """The global order the user's sampler (or Lightning's injected one) asked for, drawn alike on every rank."""
    seed = global_seed()
    if isinstance(sampler, DistributedSampler):
        base = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's sampler wrapper dataset
        if base is None:
            return GlobalOrder(num_samples, shuffle=sampler.shuffle, seed=sampler.seed)
        if type(base) in (SequentialSampler, RandomSampler):
            if not (isinstance(base, RandomSampler) and (base.replacement or base.num_samples != num_samples)):
                return GlobalOrder(num_samples, shuffle=sampler.shuffle or isinstance(base, RandomSampler),
                                   seed=sampler.seed)
        sampler, seed = base, sampler.seed
    if type(sampler) is SequentialSampler:
        return GlobalOrder(num_samples, shuffle=False, seed=seed)
    if (type(sampler) is RandomSampler and not sampler.replacement
            and sampler.num_samples == num_samples):  # type: ignore
        return GlobalOrder(num_samples, shuffle=True, seed=seed)
    if not isinstance(sampler, Iterable):
        raise ValueError(f"{loader_name}: the sampler {type(sampler).__name__} is not iterable.")
    # Any other sampler (WeightedRandomSampler, RandomSampler with replacement, a user's own): drawn on every rank,
    # seeded like DistributedSampler, and checked to agree across ranks at each epoch's start.
    return GlobalOrder(num_samples, shuffle=False, seed=seed, source=sampler)


def loader_arguments(dataloader: DataLoader) -> dict[str, Any]:
    """The keyword arguments that rebuild ``dataloader``'s class as the user built it."""
    recorded = _compat.recorded_loader_arguments(dataloader)
    parameters = inspect.signature(type(dataloader).__init__).parameters
    if recorded is not None:
        args, kwargs, names = recorded
        return {**dict(zip(names, args)), **kwargs}
    # Built outside a hook (passed to `fit`): the attributes that differ from the constructor's defaults.
    attributes = {k: v for k, v in vars(dataloader).items() if not k.startswith("_")}
    attributes["multiprocessing_context"] = dataloader.multiprocessing_context
    defaults = {**inspect.signature(DataLoader.__init__).parameters, **parameters}
    return {k: v for k, v in attributes.items() if k in defaults and defaults[k].default is not v or k == "dataset"}


def rebuild_loader(dataloader: DataLoader, batch_sampler: Any) -> DataLoader:
    """``dataloader``'s own class and arguments around ``batch_sampler``."""
    kwargs = loader_arguments(dataloader)
    parameters = inspect.signature(type(dataloader).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if not takes_any and "batch_sampler" not in parameters:
        raise ValueError(
            f"{type(dataloader).__name__} takes no `batch_sampler` argument, so the strategy cannot give it the "
            "per-rank batch sampler. Add `batch_sampler` (or `**kwargs` passed to DataLoader) to its `__init__`."
        )
    for name, value in _BATCHING_ARGS.items():
        if name in kwargs or name in parameters:
            kwargs[name] = value
    kwargs["batch_sampler"] = batch_sampler
    return _compat.reinstantiate(dataloader, **kwargs)
