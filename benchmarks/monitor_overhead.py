"""Step time with HeteroMonitor on vs off: the CPU demo, or an emulated mixed pair of GPUs.

    python benchmarks/monitor_overhead.py                                   # CPU demo: 2 gloo ranks, rank 1 3x slower
    python benchmarks/monitor_overhead.py --accelerator gpu --out $OUT      # 2 GPUs: bench_lab's mix2, GPT + ResNet-50
    python benchmarks/monitor_overhead.py --pipeline                        # CPU: HeteroHybridStrategy, 3 gloo ranks

Both arms train the same split (fixed capacities): an A/B of two profiled runs would compare two different splits,
whose step times differ by more than the monitor costs.

CPU: the steps of a 2-rank gloo job on a small machine scatter by ±25 % between runs, far more than the monitor
costs, so the arms are blocks of one run: one fit of the digits demo (rank 1 emulated 3x slower, capacities 3:1,
a CSVLogger: a user has a logger either way) in which the monitor is added to the callbacks for one block of
2 x ``--log-every`` steps (two of its exchanges) and taken out for the next, ``--repeats`` times each. A repeat is an
off block and the on block after it; rank 0's wall time per step in each. Every rank also counts, per block, its
thread CPU time and the emulator's timed step and slowdown pause: the table ends with what the monitor adds to each
(with capacities matched to the slowdown both ranks are on the step's critical path, and the slowed rank pays its
in-step share again as pause).

GPU: one process per GPU runs ``bench_lab``'s configurations on one process group: the solo rates, then
``hetero-explicit`` (capacities = solo rates) and ``hetero-monitor`` (the same plus ``HeteroMonitor`` logging to a
CSVLogger every 10 steps) alternately, ``--repeats`` times each, per model; each timed between
``torch.cuda.synchronize`` calls at its first and last timed step only (the monitor itself reads its CUDA events on
logging steps, without a synchronize per step).

Prints the median step time of each arm and the overhead: the median of on / off ratios of neighbours in time (CPU:
an on block / the mean of the off blocks either side; GPU: the two runs of a repeat), so the machine's drift over the
run cancels, with the smallest and largest ratio and a 95 % bootstrap interval of the median; JSON and a PNG (every
run or block in order) to ``--out``.

``--pipeline`` (CPU): the same blocks under ``HeteroHybridStrategy`` on 3 ranks, rank 0 data-parallel and ranks 1
and 2 a 2-stage pipeline of the digits MLP (split before its last layer, ``--micro-batches`` each step); the monitor
then also times each stage's micro-batches and transfers.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plotting import pyplot  # noqa: E402


def alternating(repeats: int) -> list[bool]:
    """Monitor off/on in the order off, on, on, off, off, on, ...: each arm goes first equally often."""
    order: list[bool] = []
    for repeat in range(repeats):
        order += [False, True] if repeat % 2 == 0 else [True, False]
    return order


# -- CPU: the digits demo --------------------------------------------------------------------------------------------
def _block_toggle_class() -> type:
    from lightning.pytorch import Callback, Trainer

    class BlockToggle(Callback):
        """Every ``block`` optimizer steps after ``warmup``: time the block that ended, then add the monitor to the
        Trainer's callbacks (just before this one, so its end-of-step hook runs inside the block) or take it out.
        Toggling happens at the same step on every rank, and its own cost falls between two timed blocks."""

        def __init__(self, monitor: Any, block: int, warmup: int) -> None:
            self.monitor, self.block, self.warmup = monitor, block, warmup
            self.on, self.began, self.last_step = False, None, -1
            self.blocks: list[tuple[bool, float]] = []  # (monitor on, seconds per step)
            self.costs: list[dict[str, float]] = []  # per block, per step: this rank's CPU and emulator seconds
            self.counted: dict[str, float] = {}

        @staticmethod
        def _counters(trainer: Trainer) -> dict[str, float]:
            """This rank's thread CPU time, and the emulator's timed step CPU and slowdown pause (0 when not slowed)."""
            emulator = trainer.strategy.emulation
            return {"cpu_s": time.thread_time(),
                    "emulated_step_cpu_s": emulator.compute_seconds if emulator is not None else 0.0,
                    "emulated_pause_s": emulator.slept_seconds if emulator is not None else 0.0}

        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = trainer.global_step
            if step < self.warmup or (step - self.warmup) % self.block or step == self.last_step:
                return  # (inserting the monitor before this callback makes Lightning call this hook again)
            self.last_step = step
            if self.began is not None:
                self.blocks.append((self.on, (time.perf_counter() - self.began) / self.block))
                now = self._counters(trainer)
                self.costs.append({"on": self.on, **{k: (now[k] - self.counted[k]) / self.block for k in now}})
            if self.on:
                trainer.callbacks.remove(self.monitor)
                self.monitor.on_train_end(trainer, pl_module)  # nothing left to exchange: it stops watching
            else:
                self.monitor.setup(trainer, pl_module, "fit")
                self.monitor.on_train_start(trainer, pl_module)
                trainer.callbacks.insert(trainer.callbacks.index(self), self.monitor)
            self.on = not self.on
            self.counted = self._counters(trainer)
            self.began = time.perf_counter()

    return BlockToggle


def cpu_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One rank: one fit of the digits demo in which the monitor is on in every other block of steps."""
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset
    from train_digits import DigitsClassifier, DigitsDataModule

    from lightning_hetero import HeteroDDPStrategy, HeteroHybridStrategy, HeteroMonitor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.devices), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.devices))
    seed_everything(0, verbose=False)
    emulate = None if args.no_emulate else [None, {"slowdown": 3}] + [None] * (args.devices - 2)
    capacities: Any = "profile" if args.capacities == "profile" else [float(c) for c in args.capacities.split(",")]
    # A block holds two of the monitor's exchanges (it exchanges every log_every_n_steps).
    from lightning.pytorch import Callback

    if args.callback == "empty":
        toggled = Callback()
    elif args.callback == "throughput":  # Lightning's own per-step monitor, for scale (rank 0 only, no exchange)
        from lightning.pytorch.callbacks import ThroughputMonitor

        toggled = ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]))
    elif args.callback == "monitor-no-stages":  # the monitor with its stage timer detached: what timing stages costs
        class WithoutStages(HeteroMonitor):
            def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
                super().on_train_start(trainer, pl_module)
                trainer.strategy.hetero.observe_pipeline_stage(None)

        toggled = WithoutStages(summary=False, warn=False, every_n_steps=args.exchange_every)
    else:
        toggled = HeteroMonitor(summary=False, warn=False, every_n_steps=args.exchange_every)
    toggle = _block_toggle_class()(toggled, 2 * args.log_every, args.warmup)
    options: dict[str, Any] = dict(capacities=capacities, emulate=emulate, observation={"print_table": False},
                                   resilience={"timeout": 300})
    strategy = (HeteroHybridStrategy(pipelines=[[1, 2]], split_points=["net.2"], micro_batches=args.micro_batches,
                                     **options) if args.pipeline else HeteroDDPStrategy(**options))
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                      max_steps=args.warmup + 2 * args.repeats * toggle.block + 1, max_epochs=-1,
                      log_every_n_steps=args.log_every, callbacks=[toggle], logger=CSVLogger(out, name="monitor"),
                      default_root_dir=out, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    model = DigitsClassifier(hidden=args.hidden)
    if args.data == "digits":
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=args.batch))
    else:  # the digits' shapes without scikit-learn: 64 features, 10 classes
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.rand(16384, 64, generator=g), torch.randint(0, 10, (16384,), generator=g))
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=args.batch, shuffle=True))
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(toggle.blocks, f)
    with open(os.path.join(out, f"costs{rank}.json"), "w") as f:
        json.dump(toggle.costs, f)


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp
    from bench_lab import _free_port

    out = tempfile.mkdtemp(prefix="monitor-bench-")
    mp.start_processes(cpu_worker, args=(args, _free_port(), out), nprocs=args.devices, start_method="spawn")
    with open(os.path.join(out, "times.json")) as f:
        blocks = json.load(f)
    times: dict[bool, list[float]] = {False: [], True: []}
    for on, step_s in blocks:
        times[on].append(step_s)
    # Each on block against the mean of the off blocks on either side of it: a drift of the machine's speed over the
    # run (linear over three blocks) cancels; blocks at either end of the run have one neighbour and are left out.
    ratios = [step_s / ((blocks[i - 1][1] + blocks[i + 1][1]) / 2)
              for i, (on, step_s) in enumerate(blocks) if on and 0 < i < len(blocks) - 1]
    # Where the time goes, per rank: what an on block adds per step to the thread's CPU time, to the part of it the
    # emulator times as the slowed rank's step, and to the pause that slowdown adds (the same neighbour comparison).
    costs = []
    for rank in range(args.devices):
        with open(os.path.join(out, f"costs{rank}.json")) as f:
            rows = json.load(f)
        added = {key: statistics.median(row[key] - (rows[i - 1][key] + rows[i + 1][key]) / 2
                                        for i, row in enumerate(rows) if row["on"] and 0 < i < len(rows) - 1)
                 for key in ("cpu_s", "emulated_step_cpu_s", "emulated_pause_s")}
        costs.append(added)
    label = f"digits MLP (hidden {args.hidden}, {args.batch}/rank), capacities {args.capacities}" + (
        f", ranks 1-2 a pipeline of {args.micro_batches} micro-batches" if args.pipeline else "") + (
        "" if args.no_emulate else ", rank 1 emulated 3x slower") + (
        "" if args.callback == "monitor" else f", {args.callback.upper()} callback instead") + (
        f", monitor exchanging every {args.exchange_every} steps" if args.exchange_every else "")
    return {"device": f"CPU ({os.cpu_count()} cores), {args.devices} gloo ranks", "heterogeneity": (
        "none" if args.no_emulate else "emulated (CPU slowdown)"), "arms": {label: {**times, "ratios": ratios}},
        "added_per_step": costs}


# -- GPU: bench_lab's mix2 --------------------------------------------------------------------------------------------
def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import bench_lab

    configs = ["solo"] + ["hetero-monitor" if on else "hetero-explicit" for on in alternating(args.repeats)]
    argv = ["--scenarios", args.scenario, "--models", args.models, "--configs", ",".join(configs), "--csv-logger",
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", args.out]
    rows = bench_lab.main(argv)
    arms: dict[str, dict[Any, list[float]]] = {}
    for row in rows:
        if row["config"] in ("hetero-explicit", "hetero-monitor") and "step_s" in row:
            arm = arms.setdefault(f"{row['model']} ({args.scenario}, split {row.get('split')})", {False: [], True: []})
            arm[row["config"] == "hetero-monitor"].append(row["step_s"])
    for arm in arms.values():  # the two runs of a repeat are neighbours in time, each arm first in every other one
        if len(arm[False]) == len(arm[True]) == args.repeats:
            arm["ratios"] = [on / off for off, on in zip(arm[False], arm[True])]
    errors = [f"{r['model']}/{r['config']}: {r['error']}" for r in rows if "error" in r]
    if errors:
        print("[monitor_overhead] errors: " + "; ".join(errors))
    scenario = bench_lab.SCENARIOS[args.scenario]
    whole = all(s == 1.0 for s in scenario["shares"]) and not any(scenario["memory_gib"])
    return {"device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
            "heterogeneity": "none (whole GPUs)" if whole else f"emulated ({args.scenario}: {scenario})", "arms": arms}


def bootstrap_interval(ratios: list[float], draws: int = 4000) -> tuple[float, float]:
    """95 % interval of the median ratio, resampling the ratios (fixed seed: the same data give the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def plot(summary: dict[str, Any], device: str, path: str) -> Optional[str]:
    """Per workload: every run (GPU) or block (CPU) of each arm in the order they ran, ms per step."""
    plt = pyplot()
    if plt is None or not summary:
        return None
    fig, axes = plt.subplots(1, len(summary), figsize=(5.2 * len(summary), 3.4), squeeze=False)
    for ax, (label, arm) in zip(axes[0], summary.items()):
        for key, name, color in (("off_s", "monitor off", "#1f77b4"), ("on_s", "monitor on", "#d62728")):
            ax.plot([1000 * t for t in arm[key]], "o-", color=color, label=name, markersize=3)
        ax.set_title(f"{label[:48]}\noverhead {100 * arm['overhead']:+.2f}% ({device})", fontsize=8)
        ax.set_xlabel("run / block, in order")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--repeats", type=int, default=None,
                        help="CPU: blocks per arm (default 80: about +-1 %% at 95 %%); GPU: runs per arm (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="GPU: timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default: CPU 20, GPU 10)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    cpu = parser.add_argument_group("CPU")
    cpu.add_argument("--devices", type=int, default=None, help="default 2 (--pipeline: 3)")
    cpu.add_argument("--hidden", type=int, default=128)
    cpu.add_argument("--batch", type=int, default=32, help="per-rank batch of the loader (global = x devices)")
    cpu.add_argument("--capacities", default=None,
                     help="comma-separated, or 'profile' (each run its own split); default 3,1 (--pipeline: 2,1,1)")
    cpu.add_argument("--pipeline", action="store_true",
                     help="HeteroHybridStrategy: rank 0 data-parallel, ranks 1 and 2 a 2-stage pipeline")
    cpu.add_argument("--micro-batches", type=int, default=4, help="--pipeline: micro-batches per pipeline step")
    cpu.add_argument("--log-every", type=int, default=50,
                     help="Trainer.log_every_n_steps (the monitor's exchange); a block is twice this")
    cpu.add_argument("--data", choices=("digits", "random"), default="digits",
                     help="random: the digits' shapes without scikit-learn")
    cpu.add_argument("--exchange-every", type=int, default=None,
                     help="the monitor's every_n_steps (default: log_every): a value beyond the run leaves only the "
                          "per-step hooks, to tell their cost from the exchange's")
    cpu.add_argument("--no-emulate", action="store_true", help="no 3x slower rank 1")
    cpu.add_argument("--callback", choices=("monitor", "empty", "throughput", "monitor-no-stages"),
                     default="monitor",
                     help="what is toggled: HeteroMonitor; an empty Callback (Lightning's own cost of one more "
                          "callback); Lightning's ThroughputMonitor (a per-step monitor of Lightning's, for scale); "
                          "--pipeline: the monitor without timing the stages")
    gpu = parser.add_argument_group("GPU")
    gpu.add_argument("--scenario", default="mix2", help="bench_lab scenario ('one': a single whole GPU)")
    gpu.add_argument("--models", default="gpt,resnet50", help="bench_lab models")
    args = parser.parse_args()
    args.devices = args.devices or (3 if args.pipeline else 2)
    args.capacities = args.capacities or ("2,1,1" if args.pipeline else "3,1")
    if args.callback == "monitor-no-stages" and not args.pipeline:
        parser.error("--callback monitor-no-stages needs --pipeline")
    if args.pipeline and args.devices != 3:
        parser.error(f"--pipeline runs 3 ranks (rank 0 and a pipeline of ranks 1 and 2), got --devices {args.devices}")
    on_gpu = args.accelerator == "gpu"
    args.repeats = args.repeats or (3 if on_gpu else 80)
    args.steps = args.steps or 40
    args.warmup = args.warmup or (10 if on_gpu else 20)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--repeats, --steps and --warmup must be >= 1")
    if args.exchange_every is not None and args.exchange_every < 1:
        parser.error(f"--exchange-every must be >= 1, got {args.exchange_every}")
    if not on_gpu and args.capacities != "profile":
        if len(args.capacities.split(",")) != args.devices:
            parser.error(f"--capacities needs {args.devices} values (one per device), got {args.capacities!r}")
    os.makedirs(args.out, exist_ok=True)
    result = run_gpu(args) if on_gpu else run_cpu(args)
    design = (f"{args.repeats} runs per arm of {args.steps} timed steps" if on_gpu else
              f"{args.repeats} blocks per arm of {2 * args.log_every} steps in one run")
    lines = [f"HeteroMonitor overhead on {result['device']}; heterogeneity: {result['heterogeneity']}; "
             f"{design}, medians",
             f"{'workload':<60} {'off ms/step':>12} {'on ms/step':>11} {'overhead':>9} [min, max ratio]"]
    summary = {}
    for label, times in result["arms"].items():
        ratios = sorted(times.get("ratios") or [])
        if not ratios:
            lines.append(f"{label:<60} {'(a run failed)':>34}")
            continue
        off, on = statistics.median(times[False]), statistics.median(times[True])
        overhead = statistics.median(ratios) - 1
        low, high = bootstrap_interval(ratios)
        summary[label] = {"off_s": times[False], "on_s": times[True], "ratios": ratios, "overhead": overhead,
                          "overhead_95": [low - 1, high - 1]}
        lines.append(f"{label:<60} {1000 * off:>12.3f} {1000 * on:>11.3f} {100 * overhead:>+8.2f}% "
                     f"[{100 * (ratios[0] - 1):+.1f}, {100 * (ratios[-1] - 1):+.1f}]  "
                     f"95 % CI of the median {100 * (low - 1):+.2f} .. {100 * (high - 1):+.2f}%")
    for rank, added in enumerate(result.get("added_per_step", [])):
        lines.append(f"rank {rank}: the callback adds {1e6 * added['cpu_s']:+.1f} us of thread CPU a step, "
                     f"{1e6 * added['emulated_step_cpu_s']:+.1f} us of it inside the emulated step, "
                     f"{1e6 * added['emulated_pause_s']:+.1f} us of slowdown pause (medians over blocks)")
    png = plot(summary, result["device"], os.path.join(args.out, "monitor_overhead.png"))
    lines.append(f"JSON: {os.path.join(args.out, 'monitor_overhead.json')}" + (f", plot: {png}" if png else ""))
    with open(os.path.join(args.out, "monitor_overhead.json"), "w") as f:
        json.dump({"device": result["device"], "heterogeneity": result["heterogeneity"], "arms": summary,
                   "added_per_step": result.get("added_per_step"), "args": vars(args)}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
