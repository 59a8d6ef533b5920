"""The strategy's host work per training step: Python time in its hooks, per step and per gradient bucket (CPU).

    python benchmarks/host_overhead.py                      # the five configurations below, 3 alternating rounds
    python benchmarks/host_overhead.py --profile hetero-2   # plus cProfile of rank 0: the package's costliest functions
    python benchmarks/host_overhead.py --rounds 1 --census ddp-2,hetero-2   # plus collectives / host reads per step

Configurations (tiny GPT of ``bench_lab``, ``--batch`` samples per rank, the fork launcher for 2 gloo ranks):

- ``plain-1``: ``Trainer(devices=1)``, the reference for one device;
- ``hetero-1``: ``HeteroDDPStrategy()`` on one device (its defaults: ``capacities="auto"``);
- ``ddp-2``: Lightning's ``DDPStrategy``, 2 ranks, the reference for several;
- ``hetero-2``: ``HeteroDDPStrategy(capacities="equal")``, 2 ranks: exact weighting by scaling the loss (no hook);
- ``hetero-2-fp16``: the same with ``compression="fp16"``: the weighting and compression comm hook.

What is measured, on every rank, over ``--steps`` steps after ``--warmup`` (CPU time of the training thread,
``time.thread_time``: waiting for the other rank or for a core of a shared machine does not count):

- ``step``: the thread's whole CPU time per step (the model's compute included): the difference to the reference
  is what the strategy adds, wherever it is spent;
- per hook: the strategy's own time in ``on_train_batch_start``, ``training_step``, ``backward``,
  ``optimizer_step`` and ``reduce``: the override's time minus the time of Lightning's ``DDPStrategy`` method it calls
  (two timing layers put around the strategy's overrides, in its method order: HeteroDDPStrategy's overrides, then
  ours, then DDPStrategy's). The reference rows put the same two layers next to each other around Lightning's
  strategy: their "ours" is the timing's own cost, the bias of the other rows;
- ``sampler``: drawing this rank's share of each global batch (the per-rank batch sampler's ``next``);
- ``comm hook``: the gradient hook's Python time per call, and its calls per step (one per DDP bucket).

The model logs its loss every step (``--log``: with ``sync_dist``, a weighted mean over ranks in the strategy's
``reduce``). Rounds run every configuration once, in reverse order every other round; the table holds medians over
rounds of rank 0's numbers (every rank's are in the JSON).

``--census``: an extra fit per configuration counting, per step, the collectives and the host reads of device values
(``.item()``, ``.tolist()``, ``torch.tensor(..., device=)`` ...) and the host gap after Lightning's per-step
synchronisation (:mod:`step_census`): what costs GPU time beyond the kernels, though little CPU time.
"""

import argparse
import cProfile
import functools
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: the same for every configuration

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lab import Indices, format_table  # noqa: E402
from one_device import logging_workload_class  # noqa: E402
from step_census import StepCensus  # noqa: E402

CONFIGS = ("plain-1", "hetero-1", "ddp-2", "hetero-2", "hetero-2-fp16")
REFERENCE = {"plain-1": "plain-1", "hetero-1": "plain-1", "ddp-2": "ddp-2", "hetero-2": "ddp-2",
             "hetero-2-fp16": "ddp-2"}
HOOKS = ("on_train_batch_start", "training_step", "backward", "optimizer_step", "reduce")
PACKAGE = "lightning_hetero"


# -- timing layers ----------------------------------------------------------------------------------------------------
def _timing_layer(name: str, parent: type, clock: dict[str, float]) -> type:
    """A subclass of ``parent`` whose every hook of HOOKS adds its inclusive thread CPU time to ``clock[hook]``."""

    def timed(hook: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return getattr(super(layer, self), hook)(*args, **kwargs)
            finally:
                clock[hook] += time.thread_time() - began

        return method

    layer = type(name, (parent,), {hook: timed(hook) for hook in HOOKS})
    return layer


def timed_class(lightning_strategy: type, outer: dict[str, float], inner: dict[str, float], hetero: bool) -> type:
    """``HeteroDDPStrategy`` (``hetero``) between two timing layers, the inner one just above Lightning's strategy:
    outer - inner is the time of the package's overrides. Without ``hetero`` the layers are adjacent: outer - inner is
    then the timing's own cost (the bias of the numbers above)."""
    from lightning_hetero import HeteroDDPStrategy

    inner_layer = _timing_layer("Inner", lightning_strategy, inner)
    if not hetero:
        return _timing_layer("Outer", inner_layer, outer)
    cls = type("TimedHeteroDDPStrategy", (_timing_layer("Outer", HeteroDDPStrategy, outer), inner_layer), {})
    mro = cls.__mro__
    assert mro.index(HeteroDDPStrategy) < mro.index(inner_layer) < mro.index(lightning_strategy), mro
    return cls


# The per-rank batch sampler's and the comm hook's time, and the hook's calls (patched once, forked ranks inherit it).
EXTRA_CLOCK: dict[str, float] = defaultdict(float)
EXTRA_CALLS: dict[str, int] = defaultdict(int)


def time_sampler_and_hook(clock: dict[str, float], counts: dict[str, int]) -> None:
    """Count the per-rank batch sampler's ``next`` and the gradient comm hook into ``clock`` and ``counts``."""
    import lightning_hetero.strategies.ddp as ddp_module
    from lightning_hetero.data.sampler import HeteroBatchSampler

    draw = HeteroBatchSampler.__iter__

    def timed_iter(self: HeteroBatchSampler) -> Any:
        batches = draw(self)
        while True:
            began = time.thread_time()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                clock["sampler"] += time.thread_time() - began
            yield batch

    HeteroBatchSampler.__iter__ = timed_iter  # type: ignore[method-assign]
    hook = ddp_module.weighted_allreduce_hook

    @functools.wraps(hook)  # torch reads the hook's annotations through __wrapped__
    def timed_hook(state: Any, bucket: Any) -> Any:
        began = time.thread_time()
        try:
            return hook(state, bucket)
        finally:
            clock["comm hook"] += time.thread_time() - began
            counts["comm hook"] += 1

    ddp_module.weighted_allreduce_hook = timed_hook


# -- one fit ----------------------------------------------------------------------------------------------------------
def _window_class() -> type:
    from lightning.pytorch import Callback

    class Window(Callback):
        """Resets the clocks as the first timed step starts, reads them (and the step CPU time) after the last;
        optionally cProfiles the timed steps. Each rank writes its numbers to ``out/rank<r>.json`` (the fork
        launcher returns rank 0's results only)."""

        def __init__(self, warmup: int, steps: int, clocks: list[dict[str, float]], counts: dict[str, int],
                     out: str, profile: bool) -> None:
            self.warmup, self.steps, self.clocks, self.counts, self.out = warmup, steps, clocks, counts, out
            self.profiler = cProfile.Profile() if profile else None
            self.began = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == self.warmup:
                for clock in self.clocks:
                    clock.clear()
                self.counts.clear()
                if self.profiler is not None:
                    self.profiler.enable()
                self.began = time.thread_time()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx != self.warmup + self.steps - 1:
                return
            step = time.thread_time() - self.began
            if self.profiler is not None:
                self.profiler.disable()
            outer, inner, extra = self.clocks
            result = {"rank": trainer.global_rank, "step_us": 1e6 * step / self.steps,
                      "hooks_us": {h: 1e6 * (outer[h] - inner[h]) / self.steps for h in HOOKS if h in outer},
                      "lightning_us": {h: 1e6 * inner[h] / self.steps for h in HOOKS if h in inner},
                      "extra_us": {k: 1e6 * v / self.steps for k, v in extra.items()},
                      "calls_per_step": {k: v / self.steps for k, v in self.counts.items()},
                      "wrapped": type(trainer.strategy.model).__name__}
            if self.profiler is not None:
                result["profile"] = top_functions(self.profiler, self.steps)
            with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(result, f)

    return Window


def top_functions(profiler: cProfile.Profile, steps: int, count: int = 15) -> list[dict[str, Any]]:
    """The package's functions by own time (cProfile's tottime) per step, with their inclusive time."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = [{"function": f"{file.split(PACKAGE + os.sep, 1)[-1]}:{line} {name}", "calls_per_step": calls / steps,
             "own_us": 1e6 * own / steps, "inclusive_us": 1e6 * inclusive / steps}
            for (file, line, name), (_, calls, own, inclusive, _) in stats.items()
            if f"{os.sep}{PACKAGE}{os.sep}" in file]
    return sorted(rows, key=lambda r: -r["own_us"])[:count]


def run_config(config: str, args: argparse.Namespace, profile: bool, census: bool = False) -> list[dict[str, Any]]:
    """One fit of ``config``; every rank's numbers (``census``: rank 0's :class:`StepCensus` as well)."""
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from lightning_hetero import Observation

    out = tempfile.mkdtemp(prefix=f"host-{config}-")
    outer: dict[str, float] = defaultdict(float)
    inner: dict[str, float] = defaultdict(float)
    devices = 1 if config.endswith("-1") else 2
    quiet = Observation(print_table=False)
    strategy: Any
    if config == "plain-1":
        strategy = timed_class(SingleDeviceStrategy, outer, inner, hetero=False)(device=torch.device("cpu"))
    elif config == "ddp-2":
        strategy = timed_class(DDPStrategy, outer, inner, hetero=False)(start_method="fork")
    else:
        cls = timed_class(DDPStrategy, outer, inner, hetero=True)
        if devices == 1:
            strategy = cls(observation=quiet)
        else:
            strategy = cls(capacities="equal", start_method="fork", observation=quiet,
                           compression="fp16" if config.endswith("fp16") else "none")
    seed_everything(0, workers=False, verbose=False)
    module = logging_workload_class()("gpt", True, 0)
    module.log_mode = args.log
    window = _window_class()(args.warmup, args.steps, [outer, inner, EXTRA_CLOCK], EXTRA_CALLS, out, profile)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.warmup + args.steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=[window])
    if census:
        trainer.callbacks.append(StepCensus().callback(args.warmup, args.steps, os.path.join(out, "census.json")))
    loader = DataLoader(Indices(args.batch * devices * (args.warmup + args.steps + 1)), batch_size=args.batch)
    trainer.fit(module, train_dataloaders=loader)
    del trainer, strategy
    if dist.is_available() and dist.is_initialized():  # one device in this process: the next fork starts clean
        dist.destroy_process_group()
    gc.collect()  # the rendezvous store of an in-process fit lets go of its port
    os.environ.pop("MASTER_PORT", None)  # and the next fit picks a free one
    results = []
    for rank in range(devices):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    if census:
        with open(os.path.join(out, "census.json")) as f:
            results[0]["census"] = json.load(f)
    return results


# -- report -----------------------------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, per configuration and rank."""
    summary: dict[str, Any] = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        ranks = []
        for rank in range(len(mine[0]["ranks"])):
            results = [r["ranks"][rank] for r in mine]
            median = {"step_us": statistics.median(x["step_us"] for x in results)}
            for part in ("hooks_us", "lightning_us", "extra_us", "calls_per_step"):
                keys = dict.fromkeys(k for x in results for k in x[part])
                median[part] = {k: statistics.median(x[part].get(k, 0.0) for x in results) for k in keys}
            median["wrapped"] = results[0]["wrapped"]
            ranks.append(median)
        summary[config] = {"ranks": ranks, "rounds": len(mine)}
    return summary


def table(summary: dict[str, Any]) -> str:
    headers = ["config", "model wrap", "step CPU us", "vs reference", "ours in hooks us", *HOOKS,
               "Lightning's reduce us", "sampler us", "comm hook us/call (calls/step)"]
    lines = []
    for config, part in summary.items():
        r0 = part["ranks"][0]
        reference = summary.get(REFERENCE[config])
        delta = (r0["step_us"] - reference["ranks"][0]["step_us"]) if reference and reference is not part else None
        hooks = r0["hooks_us"]
        calls = r0["calls_per_step"].get("comm hook", 0)
        hook_cell = (f"{r0['extra_us']['comm hook'] / calls:.1f} ({calls:g})" if calls else "-")
        lines.append([config, r0["wrapped"], f"{r0['step_us']:.0f}",
                      f"{delta:+.0f}" if delta is not None else "-",
                      f"{sum(hooks.values()):.1f}" if hooks else "-",
                      *[f"{hooks[h]:.1f}" if h in hooks else "-" for h in HOOKS],
                      f"{r0['lightning_us'].get('reduce', 0.0):.1f}",
                      f"{r0['extra_us']['sampler']:.1f}" if "sampler" in r0["extra_us"] else "-", hook_cell])
    return format_table(headers, lines)


def census_table(censuses: dict[str, dict[str, Any]]) -> str:
    def cell(counts: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in counts.items()) or "-"

    lines = [[config, cell(c["collectives"]), cell(c["host reads"]),
              f"{c['host gap us']:.0f}" if c["host gap us"] is not None else "-"] for config, c in censuses.items()]
    return format_table(["config", "collectives/step", "host reads/step", "host gap us"], lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per fit")
    p.add_argument("--steps", type=int, default=200, help="timed steps per fit")
    p.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    p.add_argument("--log", choices=("none", "local", "sync"), default="sync",
                   help="the model logs its loss every step: not at all, on its rank, or with sync_dist")
    p.add_argument("--profile", default="", help="comma-separated configurations to cProfile (an extra fit each)")
    p.add_argument("--census", default="", help="comma-separated configurations whose collectives, host reads and "
                   "host gap per step are counted (an extra fit each)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.profile = [c for c in args.profile.split(",") if c]
    args.census = [c for c in args.census.split(",") if c]
    for name, values in (("--configs", args.configs), ("--profile", args.profile), ("--census", args.census)):
        bad = [v for v in values if v not in CONFIGS]
        if bad:
            p.error(f"{name}: {bad} not in {list(CONFIGS)}")
    if not args.configs or args.rounds < 1 or args.warmup < 1 or args.steps < 1 or args.batch < 1:
        p.error("--configs must not be empty; --rounds, --warmup, --steps and --batch must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    time_sampler_and_hook(EXTRA_CLOCK, EXTRA_CALLS)
    started = time.perf_counter()
    runs = []
    for round_index in range(args.rounds):
        for config in (args.configs if round_index % 2 == 0 else list(reversed(args.configs))):
            ranks = run_config(config, args, profile=False)
            runs.append({"config": config, "round": round_index, "ranks": ranks})
            print(f"[host_overhead] {time.perf_counter() - started:5.0f} s  round {round_index + 1}/{args.rounds} "
                  f"{config}: step {ranks[0]['step_us']:.0f} us CPU, in hooks "
                  f"{sum(ranks[0]['hooks_us'].values()):.1f} us", flush=True)
    profiles = {config: [r.get("profile") for r in run_config(config, args, profile=True)] for config in args.profile}
    censuses = {config: run_config(config, args, profile=False, census=True)[0]["census"] for config in args.census}
    summary = summarize(runs)
    result = {"device": f"CPU ({os.cpu_count()} cores), gloo, {os.environ['OMP_NUM_THREADS']} thread(s) per rank",
              "torch": torch.__version__, "model": "bench_lab tiny GPT", "batch_per_rank": args.batch,
              "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "log": args.log,
              "wall_s": time.perf_counter() - started, "summary": summary, "runs": runs, "profiles": profiles,
              "census": censuses}
    path = os.path.join(args.out, "host_overhead.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[host_overhead] wrote {path}; {result['wall_s']:.0f} s; {result['device']}; tiny GPT, "
          f"{args.batch} samples per rank, {args.steps} timed steps, medians of {args.rounds} rounds, rank 0")
    for config, ranks in profiles.items():
        print(f"\ncProfile of {config}, rank 0: the package's functions by own time per step (us)")
        print(format_table(["function", "calls/step", "own us", "incl. us"],
                           [[r["function"], f"{r['calls_per_step']:g}", f"{r['own_us']:.1f}",
                             f"{r['inclusive_us']:.1f}"] for r in ranks[0] or []]))
    if censuses:
        print("\nrank 0, per step: collectives issued from Python, host reads of tensor values (on a GPU each waits "
              "for the stream), and the host gap from Lightning's per-step sync to training_step (wall us, median)")
        print(census_table(censuses))
    print("\nrank 0's CPU time per step (us): the whole step, the package's own time in each hook (reference rows: "
          "the timing's own cost), Lightning's reduce, the batch sampler, the comm hook")
    print(table(summary))
    return result

if __name__ == "__main__":
    main()
