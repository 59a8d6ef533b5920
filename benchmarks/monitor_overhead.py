"""Step time with HeteroMonitor on vs off, on the digits demo (CPU) or on GPUs.

    python benchmarks/monitor_overhead.py                        # the CPU demo: 2 gloo ranks, rank 1 3x slower
    python benchmarks/monitor_overhead.py --accelerator gpu --devices 2 --hidden 4096 --batch 512 --no-emulate --data random

Each repeat trains the same model twice, monitor off and on (alternating which goes first), and times rank 0's
optimizer steps after a warm-up (wall clock between two steps' ends; on GPUs the timing callback synchronizes only at
the first and the last timed step). Prints the median step time of each and the overhead in %.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from train_digits import DigitsClassifier, DigitsDataModule  # noqa: E402

from lightning_hetero import HeteroDDPStrategy  # noqa: E402


class _StepClock(Callback):
    """Rank 0's wall time from the end of step ``warmup`` to the end of the last step."""

    def __init__(self, path: str, warmup: int) -> None:
        self.path, self.warmup, self.t0 = path, warmup, None

    def _now(self, trainer: Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup:
            self.t0 = self._now(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0 and self.t0 is not None:
            steps = trainer.global_step - self.warmup
            with open(self.path, "w") as f:
                json.dump({"step_s": (self._now(trainer) - self.t0) / steps}, f)


def run(args: argparse.Namespace, monitor: bool, out: str) -> float:
    seed_everything(0)
    path = os.path.join(out, f"step_{int(monitor)}.json")
    emulate = None if args.no_emulate else [None, {"slowdown": 3}] + [None] * (args.devices - 2)
    strategy = HeteroDDPStrategy(capacities="profile", emulate=emulate, monitor=monitor, print_table=False,
                                 start_method=args.start_method, timeout=300)
    trainer = Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                      max_steps=args.warmup + args.steps, max_epochs=-1, log_every_n_steps=args.log_every,
                      callbacks=[_StepClock(path, args.warmup)], logger=args.logger, default_root_dir=out,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    if args.data == "digits":
        trainer.fit(DigitsClassifier(hidden=args.hidden), datamodule=DigitsDataModule(batch_size=args.batch))
    else:  # the digits' shapes without scikit-learn: 64 features, 10 classes
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.rand(16384, 64, generator=g), torch.randint(0, 10, (16384,), generator=g))
        trainer.fit(DigitsClassifier(hidden=args.hidden), train_dataloaders=DataLoader(data, batch_size=args.batch,
                                                                                       shuffle=True))
    if trainer.global_rank != 0:
        return float("nan")  # popen children run the same sequence of fits; only rank 0 reports
    with open(path) as f:
        return json.load(f)["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch of the loader (global = x devices)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--logger", action="store_true", help="with Lightning's default logger (CSV/TensorBoard)")
    parser.add_argument("--data", choices=("digits", "random"), default="digits",
                        help="random: the digits' shapes without scikit-learn")
    parser.add_argument("--no-emulate", action="store_true", help="real devices only (no 3x slower rank 1)")
    parser.add_argument("--start-method", default=None, help="default: fork on CPU, popen on GPUs")
    args = parser.parse_args()
    args.start_method = args.start_method or ("fork" if args.accelerator == "cpu" else "popen")
    out = os.environ.setdefault("MONITOR_BENCH_DIR", tempfile.mkdtemp(prefix="monitor-bench-"))
    times: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for monitor in ((False, True) if repeat % 2 == 0 else (True, False)):
            times[monitor].append(run(args, monitor, out))
    if int(os.environ.get("LOCAL_RANK", 0)) != 0 or any(t != t for t in times[False]):
        return
    off, on = statistics.median(times[False]), statistics.median(times[True])
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else f"CPU ({os.cpu_count()} cores)"
    print(f"{device}, {args.devices} ranks, hidden {args.hidden}, batch {args.batch}/rank, {args.steps} timed steps "
          f"x {args.repeats}: monitor off {1000 * off:.3f} ms/step, on {1000 * on:.3f} ms/step, "
          f"overhead {100 * (on / off - 1):+.2f}%")
    print(json.dumps({"off_s": times[False], "on_s": times[True], "overhead": on / off - 1, **vars(args)}))


if __name__ == "__main__":
    main()
