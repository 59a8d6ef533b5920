"""What a training step does that costs GPU time beyond its kernels, counted on CPU: collectives and host reads.

On a GPU the host runs ahead of the device until something makes it wait. Two kinds of call cost more on a GPU
than their CPU time shows:

- a **host read** of a device value (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``torch.tensor(...,
  device=cuda)`` from a Python list): the host waits for the CUDA stream to drain, and the GPU then idles while the
  host prepares its next kernels;
- a **collective** issued from Python (``c10d::allreduce_``, ``broadcast_``, ``barrier`` ...): a kernel and a
  latency on the link per call.

:class:`StepCensus` counts both over a window of training steps in the training thread: collectives from the
dispatcher (``torch.profiler``: every c10d op, whoever issues it: Lightning, the strategy, a callback), host reads
from a ``TorchFunctionMode`` (Python-level calls; DDP's C++ reducer makes none). It also times the **host gap**:
the wall time from Lightning's per-step synchronisation (the SIGTERM flag's broadcast and ``.item()`` at the start
of every step with several ranks) to the start of the model's ``training_step``: on a GPU that work is exposed, the
device idles through it. Compare a configuration with Lightning's ``DDPStrategy`` on the same model::

    census = StepCensus()
    trainer = Trainer(..., callbacks=[census.callback(warmup=5, steps=20, path="census.json")])
    trainer.fit(model)
    census.per_step()   # in rank 0's process (else json.load(open("census.json"))):
    # {"collectives": {"c10d::broadcast_": 1.0}, "host reads": {"item": 1.0}, "host gap us": 210.0}
"""

import collections
import json
import statistics
import time
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

# Python-level calls that read a device value on the host (each waits for the CUDA stream).
_HOST_READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}
# torch.tensor(<Python data>, device=...): a copy from pageable host memory (on CUDA: a stream synchronisation).
_FACTORIES = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}


class _HostReads(TorchFunctionMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _HOST_READS.get(func)
        if name is not None:
            self.counts[name] += 1
        elif func in _FACTORIES and kwargs.get("device") is not None:
            self.counts[f"{_FACTORIES[func]}(device=...)"] += 1
        return func(*args, **kwargs)


class StepCensus:
    """Collectives, host reads and the host gap per training step over a window of steps (see the module docstring)."""

    def __init__(self) -> None:
        self.collectives: collections.Counter = collections.Counter()
        self.reads: collections.Counter = collections.Counter()
        self.gaps: list[float] = []
        self.steps = 0
        self._synced_at: Optional[float] = None

    def per_step(self) -> dict[str, Any]:
        n = max(1, self.steps)
        return {"collectives": {k: v / n for k, v in sorted(self.collectives.items())},
                "host reads": {k: v / n for k, v in sorted(self.reads.items())},
                "host gap us": 1e6 * statistics.median(self.gaps) if self.gaps else None}

    def callback(self, warmup: int, steps: int, path: Optional[str] = None) -> Any:
        """A Lightning callback that counts steps ``warmup`` .. ``warmup + steps - 1``; ``path``: rank 0 also writes
        :meth:`per_step` there as JSON (a launcher that forks rank 0 keeps this object's counts in the child)."""
        from lightning.pytorch import Callback
        from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

        census = self

        class Census(Callback):
            def __init__(self) -> None:
                self.profiler: Any = None
                self.mode: Optional[_HostReads] = None
                self.sync: Any = None

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                loop = trainer.fit_loop.epoch_loop
                assert isinstance(loop, _TrainingEpochLoop)
                original = loop._broadcast_sigterm_tensor

                def stamped() -> None:
                    original()
                    census._synced_at = time.perf_counter()

                loop._broadcast_sigterm_tensor = stamped  # instance attribute: this fit only
                step = pl_module.training_step

                def stamped_step(*args: Any, **kwargs: Any) -> Any:
                    if census._synced_at is not None and self.mode is not None:
                        census.gaps.append(time.perf_counter() - census._synced_at)
                    census._synced_at = None
                    return step(*args, **kwargs)

                pl_module.training_step = stamped_step

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == warmup:
                    self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self.profiler.__enter__()
                    self.mode = _HostReads(census.reads)
                    self.mode.__enter__()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                if batch_idx != warmup + steps - 1 or self.mode is None:
                    return
                self.mode.__exit__(None, None, None)
                self.mode = None
                self.profiler.__exit__(None, None, None)
                census.collectives.update(e.name for e in self.profiler.events() if e.name.startswith("c10d::"))
                census.steps = steps
                pl_module.__dict__.pop("training_step", None)
                if path is not None and trainer.global_rank == 0:
                    with open(path, "w") as f:
                        json.dump(census.per_step(), f)

        return Census()
