"""A trial forward and backward of a few training samples before the first step, leaving the job as it was: the
memory plan measures what a step of its rank holds (:mod:`lightning_hetero.plan.activations`) with it.

What it leaves untouched: the parameters (no optimizer step), their gradients (set back to ``None``), the buffers
(BatchNorm's running statistics restored), the modules' plain attributes (numbers, strings, flags: a step counter
kept on the module), their tensor attributes (a torchmetrics metric's state) and the contents of their lists, dicts
and sets (a record the step appends to), every random
generator (forked), what the step logs (``log`` is silenced) and the loaders (samples are read from the map-style
dataset by index, no iterator is started). Other Python state a training step changes (an object it mutates) is not
restored: ``MemoryPolicy(measure=False)`` counts instead of measuring. Every rank runs the
same trials, so the collectives (FSDP's all-gathers and reduce-scatters) match across ranks.
"""

import copy
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset


def sample_batches(loader: Any) -> tuple[Optional[Callable[[int], Any]], str]:
    """A function giving a batch of the first ``k`` samples of the training set, or ``None`` and why not."""
    if not isinstance(loader, DataLoader):
        return None, f"the training loader is a {type(loader).__name__}, not one DataLoader"
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None, "the training set is a stream (its samples cannot be read by index)"
    collate = loader.collate_fn

    def batch(k: int) -> Any:
        return collate([dataset[i] for i in range(min(k, len(dataset)))])  # type: ignore[arg-type]

    return batch, ""


@contextmanager
def _as_it_was(module: nn.Module, device: torch.device) -> Iterator[None]:
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    plain = [(m, {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in vars(m).items()
                  if isinstance(v, (int, float, str, bool, type(None), torch.Tensor))}) for m in module.modules()]
    # Containers keep their identity (something else may hold them): their contents are put back in place. The
    # module's own (underscored: parameters, hooks, FSDP's state) are left to their owners.
    containers = [(v, copy.copy(v)) for m in module.modules() for k, v in vars(m).items()
                  if type(v) in (list, dict, set) and not k.startswith("_")]
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        # A step that logs would log outside Lightning's loop: the trial's values are not the job's.
        for name in ("log", "log_dict"):
            stack.callback(module.__dict__.pop, name, None)
            setattr(module, name, lambda *args, **kwargs: None)
        try:
            yield
        finally:
            module.zero_grad(set_to_none=True)
            for m, attributes in plain:
                m.__dict__.update(attributes)
            for container, contents in containers:
                container.clear()
                (container.update if isinstance(container, (dict, set)) else container.extend)(contents)
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


@contextmanager
def trial_steps(module: nn.Module, device: torch.device, forward: Callable[[Any], Any],
                to_device: Callable[[Any], Any]) -> Iterator[Callable[[Any], None]]:
    """A function running trial steps: ``forward(batch)`` (the strategy's training step: precision, the sharded root)
    and the backward of its loss, its gradients set back to ``None`` after each; ``module`` as it was (see the
    module's docstring) once the block ends. The state is copied once, on entering: a step's memory measured inside
    does not hold the copy (a model's buffers, 4 MiB of them once made a step's estimate 12 % high)."""

    def step(batch: Any) -> None:
        try:
            out = forward(to_device(batch))
            loss = out["loss"] if isinstance(out, dict) else out
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"the training step returned {type(out).__name__}, not a loss tensor")
            loss.backward()
            del out, loss
        finally:
            module.zero_grad(set_to_none=True)

    with _as_it_was(module, device):
        yield step

