"""Where one training step's time goes, measured: a callback that profiles one step of every rank and writes
``split-rank{r}.json`` (device time by kind, the host optimizer's own timings, the step's wall time).

- ``copies``: the device's memory copies between host and device (``Memcpy HtoD`` / ``DtoH``: the offloaded shards
  brought in for the all-gathers, the gradients sent back), summed over their durations;
- ``collectives``: NCCL kernels (all-gathers, reduce-scatters);
- ``compute``: every other kernel;
- ``host_optimizer``: the fused host step of the offloaded parameters
  (:class:`~lightning_hetero.grad.host_optimizer.HostStepStats`): its seconds, the part that ran before the backward
  ended, the training thread's wait for it after the backward, threads and ns per parameter; ``None`` without one.

Device kinds run on several streams at once, so their sum may exceed the step's wall time: each is how long that
kind kept the device busy. The profiled step is timed too (the profiler slows it a little); the benchmark's rate comes
from the unprofiled steps.

Example (a LightningCLI config)::

    trainer:
      callbacks:
        - class_path: benchmarks.step_split.StepSplit
          init_args: {out_dir: /tmp/split, step: 3}
"""

import json
import os
import time
from dataclasses import asdict
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def device_kinds(events: Any) -> dict[str, float]:
    """Seconds of device time by kind (copies, collectives, compute) in a profiler's events."""
    kinds = {"copies": 0.0, "collectives": 0.0, "compute": 0.0}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = "copies" if "memcpy" in name and ("htod" in name or "dtoh" in name) else \
            "collectives" if "nccl" in name else "compute"
        kinds[kind] += event.time_range.elapsed_us() * 1e-6
    return kinds


class StepSplit(Callback):
    """Profiles optimizer step ``step`` (0-based; after the warm-up) of each rank; see the module's docstring."""

    def __init__(self, out_dir: str, step: int = 3) -> None:
        self.out_dir, self.step = out_dir, step
        self._profiler: Optional[torch.profiler.profile] = None
        self._started = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or self._profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        profiler = self._profiler
        if profiler is None or trainer.global_step != self.step + 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        profiler.__exit__(None, None, None)
        host_steps = getattr(trainer.strategy, "host_steps", None) or []
        record = {"rank": trainer.global_rank, "step": self.step, "wall_s": wall,
                  "device_s": device_kinds(profiler.events()),
                  "host_optimizer": [asdict(h.stats) | {"ns_per_parameter": h.stats.ns_per_parameter,
                                                        "overlap": h.overlap} for h in host_steps] or None}
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"split-rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f, indent=1)
        self._profiler = None
