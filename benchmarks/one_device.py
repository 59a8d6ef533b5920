"""One device: a plain ``Trainer(devices=1)``, Lightning's ``DDPStrategy`` and ``HeteroDDPStrategy``, side by side.

With one device there is nothing to split or all-reduce, so the strategy should cost nothing over the plain Trainer.
One process runs every configuration in alternating rounds, per model, and prints a table of ratios last; JSON and a
PNG go to ``--out`` (default ``$OUT`` or ./out)::

    python benchmarks/one_device.py --out $OUT            # one GPU: ResNet-50 (batch 64) and GPT 124M (16 x 512)
    python benchmarks/one_device.py --tiny                # CPU smoke run: tiny models, few steps
    python benchmarks/one_device.py --configs plain,hetero --rounds 5

Configurations:

- ``plain``: ``Trainer(devices=1)`` (Lightning's single-device strategy).
- ``ddp``: Lightning's ``DDPStrategy`` on one device.
- ``hetero``: ``HeteroDDPStrategy()`` with its defaults (``capacities="auto"``).
- ``hetero-policy`` (not by default): the same with ``precision_policy="auto"`` instead of ``Trainer(precision=)``.

Every fit trains ``--warmup`` steps, then times ``--steps`` steps between ``torch.cuda.synchronize`` calls;
samples/s = batch x steps / seconds; ``CPU ms/step`` is the process's CPU time over the same steps (on a shared
machine the wall time is partly other processes', the CPU time is the step's own); ``setup s`` is fit start to the
first step (where start-up work shows: ``capacities="auto"`` profiles the model there). ``model wrap`` is the class
of ``trainer.strategy.model``. Inputs are synthetic and held on the device (the loader yields indices only): no data
loading is timed. ``--log`` makes the model log its loss every step (``sync``: with ``sync_dist=True``). Every fit
runs with the same intra-op thread count (one on CPU) and a fresh process-group port.
A round runs every configuration once, in reverse order every other round, so that a drift of the machine's speed
over the run falls on all alike; the table holds the median over rounds, and each ratio's smallest and largest value
over rounds (ratios of the same round).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lab import Indices, _lightning_module_class, _timer_class, format_table  # noqa: E402
from plotting import pyplot  # noqa: E402

CONFIGS = ("plain", "ddp", "hetero")
EXTRA_CONFIGS = ("hetero-policy",)
MODELS = ("resnet50", "gpt")
# (numerator, denominator) of the ratios printed last
RATIOS = (("hetero", "plain"), ("ddp", "plain"), ("hetero", "ddp"), ("hetero-policy", "plain"))


def round_order(configs: list[str], round_index: int) -> list[str]:
    """The configurations of one round: as given in even rounds, reversed in odd ones."""
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def make_strategy(config: str, accelerator: str) -> Any:
    """The strategy argument of ``Trainer`` for a configuration (``"auto"``: Lightning's single-device choice)."""
    if config == "plain":
        return "auto"
    if config == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    from lightning_hetero import HeteroDDPStrategy, Observation

    quiet = Observation(print_table=False)
    if config == "hetero":
        return HeteroDDPStrategy(observation=quiet)
    return HeteroDDPStrategy(observation=quiet, precision_policy="auto")


def logging_workload_class() -> type:
    """``bench_lab``'s workload, logging its loss every step (``log_mode``: "none", "local" or "sync" for
    ``sync_dist=True``) as most training does."""
    workload = _lightning_module_class()

    class LoggingWorkload(workload):  # type: ignore[misc, valid-type]
        log_mode = "none"

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            if self.log_mode != "none":
                self.log("loss", loss, sync_dist=self.log_mode == "sync")
            return loss

    return LoggingWorkload


def _cpu_timer_class() -> type:
    """``bench_lab``'s step timer, also counting this process's CPU time over the timed steps: on a shared machine
    the wall time is other processes' as much as ours, the CPU time is the step's own work."""
    step_timer = _timer_class()

    class CpuStepTimer(step_timer):  # type: ignore[misc, valid-type]
        cpu0 = cpu1 = 0.0
        wrapped = ""  # the class training runs (Lightning's DDP unwraps the model at teardown)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if batch_idx == self.warmup:
                self.wrapped = type(trainer.strategy.model).__name__
                self.cpu0 = time.process_time()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if batch_idx == self.warmup + self.steps - 1:
                self.cpu1 = time.process_time()

    return CpuStepTimer


def _reset_process_state(cuda: bool) -> None:
    """Between fits: no process group left from a DDP fit, no cached memory, the same math settings for every fit
    (``precision_policy`` sets TF32 process-wide)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the rendezvous store of the last fit lets go of its port
    os.environ.pop("MASTER_PORT", None)  # and the next fit picks a free one
    if cuda:
        torch.cuda.empty_cache()
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def run_fit(config: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fit of one configuration: samples/s over the timed steps, and the set-up time."""
    from lightning.pytorch import Trainer, seed_everything

    cuda = args.accelerator == "gpu"
    _reset_process_state(cuda)
    seed_everything(0, workers=False, verbose=False)
    module = logging_workload_class()(kind, args.tiny, args.seq)
    module.log_mode = args.log
    module.prepare(cuda)
    timer = _cpu_timer_class()(args.warmup, args.steps)
    batch = args.batch[kind]
    # A precision policy owns the precision: the Trainer keeps its default then.
    precision = "32-true" if config == "hetero-policy" else args.precision
    trainer = Trainer(accelerator=args.accelerator, devices=1, strategy=make_strategy(config, args.accelerator),
                      precision=precision, max_steps=args.warmup + args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    loader = DataLoader(Indices(batch * (args.warmup + args.steps + 1)), batch_size=batch, shuffle=False)
    began = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    seconds = timer.t1 - timer.t0
    row = {"samples_per_s": batch * args.steps / seconds, "step_ms": 1000 * seconds / args.steps,
           "cpu_ms_per_step": 1000 * (timer.cpu1 - timer.cpu0) / args.steps,
           "setup_s": timer.first_step - timer.fit_start, "fit_s": time.perf_counter() - began,
           "strategy": type(trainer.strategy).__name__,
           "wrapped": timer.wrapped}
    del trainer, module
    _reset_process_state(cuda)
    return row


def summarize(rows: list[dict[str, Any]], configs: list[str], models: list[str]) -> dict[str, Any]:
    """Per model: the medians over rounds of each configuration's samples/s, step and CPU time, set-up time, and the
    ratios of RATIOS (ratio of the medians; smallest and largest ratio of the same round)."""
    summary: dict[str, Any] = {}
    for kind in models:
        per_config: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if row["model"] == kind and "samples_per_s" in row:
                per_config.setdefault(row["config"], []).append(row)
        medians = {c: {**{key: statistics.median(r[key] for r in per_config[c])
                          for key in ("samples_per_s", "step_ms", "cpu_ms_per_step", "setup_s")},
                       "wrapped": per_config[c][0]["wrapped"]}
                   for c in configs if c in per_config}
        ratios = {}
        for top, bottom in RATIOS:
            if top in medians and bottom in medians:
                rate = {c: {r["round"]: r["samples_per_s"] for r in per_config[c]} for c in (top, bottom)}
                paired = [rate[top][i] / rate[bottom][i] for i in rate[top] if i in rate[bottom]]
                ratios[f"{top}/{bottom}"] = {
                    "ratio": medians[top]["samples_per_s"] / medians[bottom]["samples_per_s"],
                    "min": min(paired), "max": max(paired),
                    "cpu_ratio": medians[top]["cpu_ms_per_step"] / medians[bottom]["cpu_ms_per_step"]}
        summary[kind] = {"configs": medians, "ratios": ratios}
    return summary


def tables(summary: dict[str, Any], configs: list[str], unit: dict[str, str]) -> str:
    """Medians per model and configuration, then the ratios (the last lines printed)."""
    lines = [[kind, c, f"{m['samples_per_s']:.1f} {unit[kind]}/s", f"{m['step_ms']:.2f}", f"{m['cpu_ms_per_step']:.2f}",
              f"{m['setup_s']:.2f}", m["wrapped"]]
             for kind, part in summary.items() for c, m in part["configs"].items()]
    names = [f"{a}/{b}" for a, b in RATIOS if a in configs and b in configs]
    ratio_lines = []
    for kind, part in summary.items():
        found = [part["ratios"].get(name) for name in names]
        ratio_lines.append([kind, "throughput"] + [f"{r['ratio']:.3f} [{r['min']:.3f}, {r['max']:.3f}]" if r else "-"
                                                   for r in found])
        ratio_lines.append([kind, "CPU time per step"] + [f"{r['cpu_ratio']:.3f}" if r else "-" for r in found])
    return (format_table(["model", "config", "throughput", "step ms", "CPU ms/step", "setup s", "model wrap"], lines)
            + "\n\nratios of the medians (throughput: [smallest, largest ratio within a round])\n"
            + format_table(["model", "measure"] + names, ratio_lines))


def plot(rows: list[dict[str, Any]], summary: dict[str, Any], configs: list[str], device: str,
         path: str) -> Optional[str]:
    """Per model: each configuration's samples/s in every round (points) and its median (bar)."""
    plt = pyplot()
    if plt is None or not summary:
        return None
    fig, axes = plt.subplots(1, len(summary), figsize=(4.6 * len(summary), 3.6), squeeze=False)
    colors = {"plain": "#999999", "ddp": "#1f77b4", "hetero": "#2ca02c", "hetero-policy": "#98df8a"}
    for ax, (kind, part) in zip(axes[0], summary.items()):
        shown = [c for c in configs if c in part["configs"]]
        ax.bar(shown, [part["configs"][c]["samples_per_s"] for c in shown],
               color=[colors.get(c, "#777777") for c in shown])
        for i, c in enumerate(shown):
            points = [r["samples_per_s"] for r in rows if r["model"] == kind and r["config"] == c
                      and "samples_per_s" in r]
            ax.plot([i] * len(points), points, "k.", markersize=4)
        ratio = part["ratios"].get("hetero/plain")
        ax.set_title(f"{kind}" + (f": hetero / plain {ratio['ratio']:.3f}" if ratio else "") + f"\n{device}",
                     fontsize=9)
        ax.set_ylabel("samples/s (median, points: rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS + EXTRA_CONFIGS)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every configuration (medians over rounds)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per fit (default 15; tiny 10)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per fit (default 60; tiny 150)")
    p.add_argument("--tiny", action="store_true", help="tiny models and batches on CPU (a smoke run)")
    p.add_argument("--accelerator", default=None, choices=["gpu", "cpu"], help="default: gpu, cpu with --tiny")
    p.add_argument("--resnet-batch", type=int, default=None, help="images per step (default 64; tiny 8)")
    p.add_argument("--gpt-batch", type=int, default=None, help="sequences per step (default 16; tiny 8)")
    p.add_argument("--seq", type=int, default=512, help="GPT sequence length (tiny: the tiny model's 32)")
    p.add_argument("--precision", default=None, help="Trainer precision (default: bf16-mixed on GPU, 32-true on CPU)")
    p.add_argument("--log", choices=("none", "local", "sync"), default="none",
                   help="the model logs its loss every step: not at all (default), or with sync_dist False / True")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c]
    for name, values, known in (("--models", args.models, MODELS), ("--configs", args.configs,
                                                                    CONFIGS + EXTRA_CONFIGS)):
        bad = [v for v in values if v not in known]
        if bad or not values or len(set(values)) != len(values):
            p.error(f"{name}: {bad or values or 'empty'} must be distinct values of {list(known)}")
    args.accelerator = args.accelerator or ("cpu" if args.tiny else "gpu")
    args.warmup = args.warmup if args.warmup is not None else (10 if args.tiny else 15)
    args.steps = args.steps if args.steps is not None else (150 if args.tiny else 60)
    if args.rounds < 1 or args.warmup < 1 or args.steps < 1:
        p.error("--rounds, --warmup and --steps must be >= 1")
    args.batch = {"resnet50": args.resnet_batch or (8 if args.tiny else 64), "gpt": args.gpt_batch or (8 if args.tiny
                                                                                                        else 16)}
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "gpu" else "32-true")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        p.error("--accelerator gpu: no CUDA device (use --tiny or --accelerator cpu)")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.accelerator == "cpu":
        torch.set_num_threads(1)  # intra-op threads on a shared machine would measure the neighbours
    # Lightning's DDP sets the thread count unless OMP_NUM_THREADS is set, and the fits after it would keep that one:
    # every configuration runs with the same.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else f"CPU ({os.cpu_count()} cores)"
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for kind in args.models:
        for round_index in range(args.rounds):
            for config in round_order(args.configs, round_index):
                try:
                    row: dict[str, Any] = run_fit(config, kind, args)
                except Exception as err:  # report it and go on: the other configurations still count
                    row = {"error": f"{type(err).__name__}: {err}"[:300]}
                    _reset_process_state(args.accelerator == "gpu")
                row.update(model=kind, config=config, round=round_index)
                rows.append(row)
                done = (f"{row['samples_per_s']:.1f} samples/s, {row['step_ms']:.2f} ms/step, setup "
                        f"{row['setup_s']:.2f} s, fit {row['fit_s']:.1f} s" if "error" not in row else row["error"])
                print(f"[one_device] {time.perf_counter() - started:6.0f} s  {kind} round {round_index + 1}/"
                      f"{args.rounds} {config}: {done}", flush=True)
    summary = summarize(rows, args.configs, args.models)
    unit = {"resnet50": "img", "gpt": "seq"}
    result = {"device": device, "torch": torch.__version__, "precision": args.precision, "tiny": args.tiny,
              "batch": args.batch, "seq": args.seq, "log": args.log, "warmup": args.warmup, "steps": args.steps,
              "rounds": args.rounds, "configs": args.configs, "wall_s": time.perf_counter() - started,
              "summary": summary, "rows": rows}
    json_path = os.path.join(args.out, "one_device.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    png = plot(rows, summary, args.configs, device, os.path.join(args.out, "one_device.png"))
    errors = [f"{r['model']}/{r['config']} round {r['round'] + 1}: {r['error']}" for r in rows if "error" in r]
    print(f"[one_device] wrote {json_path}" + (f" and {png}" if png else " (no matplotlib: no plot)")
          + f"; {result['wall_s']:.0f} s on {device}, {args.precision}, batch {args.batch}, "
            f"{args.warmup} + {args.steps} steps, {args.rounds} rounds, loss logged: {args.log}")
    if errors:
        print("[one_device] errors:\n  " + "\n  ".join(errors))
    print(tables(summary, args.configs, unit))
    return result


if __name__ == "__main__":
    main()
