"""A card that drops to half speed mid-run: how fast live rebalancing recovers the throughput (goal P5).

Two ranks on an emulated lab (``mix2`` by default: GPU 1 at a quarter of the SMs, PCIe-class link; or ``same2``).
At step ``--change-at`` one rank (``--throttle-rank``, default the fast one, rank 0: the larger share moves) slows
``--factor`` times (:meth:`lightning_hetero.lab.emulator.Emulator.throttle`: its SM count divided and rounded to
the green-context granularity, on CPU its slowdown multiplied). One command runs, per round and model::

    python benchmarks/bench_rebalance.py                                # mix2, GPT-124M, 3 rounds, 2 GPUs
    python benchmarks/bench_rebalance.py --models resnet50,gpt --scenario same2
    python benchmarks/bench_rebalance.py --tiny --accelerator cpu       # smoke run on CPU (gloo, sleep-based)

- ``solo``: each rank alone in a plain loop under its emulation, before and after the throttle (bench_lab's
  solo loop). Ideal = Σ solo; the NEW ideal = Σ solo after the throttle, measured in the same round.
- ``ddp``: Lightning's ``DDPStrategy`` (equal batches) under the same emulation, throttled at the same step.
- ``static``: ``HeteroDDPStrategy`` with the solo rates before the throttle as capacities, ``rebalance`` off.
- ``rebalance``: the same with ``rebalance`` on (``--every`` / ``--threshold`` / ``--smoothing``).
- ``oracle``: ``HeteroDDPStrategy`` with the solo rates AFTER the throttle as capacities, throttled from the
  first step: the best static split for the new speeds, the throughput data parallelism can reach on this lab.

Per step the wall time on rank 0 is recorded (CUDA events on the current stream at every batch start; no extra
synchronization), and a window of ``--window`` steps gives the throughput. Reported per configuration: steps after
the change until the window first reaches ≥ 0.95 of the new ideal (``reach``) and from which it stays there
(``hold``), the same against the oracle, and the settled ratio (the last ``--settle`` steps). Every rank's
emulation is checked before and after the throttle (GPUs: each step on the rank's capped green-context stream of
that phase; CPU: the rank slept its slowdown). Writes ``bench_rebalance.json`` and ``bench_rebalance.png`` to
``--out`` (default ``$OUT`` or ./out) and prints a table last.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lab import (  # noqa: E402 (also sets the NCCL environment the device machine needs)
    _TIMEOUT_S,
    SCENARIOS,
    Indices,
    _commit,
    _free_port,
    _lightning_module_class,
    capped,
    emulated_steps,
    format_table,
    keep_row,
    collect_ranks,
    solo_rate,
    stop_on_sigterm,
    past_deadline,
    rank_device,
)
from plotting import pyplot  # noqa: E402

CONFIGS = ("ddp", "static", "rebalance", "oracle")
TARGET = 0.95  # of the new ideal (goal P5), and of the oracle
# CPU ranks are all slowed from the start: the strategy registers the gradient-bucket observer that leaves DDP's
# all-reduce wait out of a CPU rank's pause only for ranks slowed at setup (see Emulator.throttle).
CPU_FLOOR_SLOWDOWN = 1.5


def emulate_specs(scenario: str, accelerator: str) -> list[dict[str, Any]]:
    """A profile for every rank (the one that throttles needs an emulator, a whole card too): GPU ranks get the
    scenario's SM share, memory and link; CPU ranks a slowdown of ``CPU_FLOOR_SLOWDOWN / share``."""
    cfg = SCENARIOS[scenario]
    specs: list[dict[str, Any]] = []
    for share, memory in zip(cfg["shares"], cfg["memory_gib"]):
        if accelerator == "cpu":
            specs.append({"slowdown": CPU_FLOOR_SLOWDOWN / share, "name": f"CPU at {share / CPU_FLOOR_SLOWDOWN:.0%}"})
            continue
        spec: dict[str, Any] = {"link": cfg["link"]}
        if share < 1.0:
            spec["sm_share"] = share
        if memory is not None:
            spec["memory_gib"] = memory
        specs.append(spec)
    return specs


# -- callbacks --------------------------------------------------------------------------------------------------------
def _callback_classes() -> tuple[type, type]:
    from lightning.pytorch import Callback

    class StepClock(Callback):
        """A mark at every batch start and at the end of training: the wall time of each step, without waiting
        for the device (CUDA events on the current stream, which waits for each step's capped stream)."""

        def __init__(self) -> None:
            self.marks: list[Any] = []

        def _mark(self, device: torch.device) -> None:
            if device.type == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._mark(pl_module.device)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._mark(pl_module.device)

        def seconds(self) -> list[float]:
            if self.marks and not isinstance(self.marks[0], float):
                self.marks[-1].synchronize()
                return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
            return [b - a for a, b in zip(self.marks, self.marks[1:])]

    class ThrottleAt(Callback):
        """At batch ``at`` the rank ``rank`` slows ``factor`` times; every rank checks that its steps ran under its
        emulation before (``checks[0]``; ``None`` with nothing to check) and after (``checks[1]``) that batch."""

        def __init__(self, at: int, factor: float, rank: int, emulator: Callable[[], Any]) -> None:
            self.at, self.factor, self.rank, self.emulator = at, factor, rank, emulator
            self.checks: list[Optional[bool]] = [None, None]
            self._slept = 0.0
            self.sms: list[Optional[int]] = []  # this rank's SM count before and after (None: all)
            self.split: Optional[list[int]] = None  # the strategy's split when the change comes (ours only)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx != self.at:
                return
            emulator = self.emulator()
            if self.at > 0:
                self.checks[0] = capped(pl_module, emulator, self._slept)
            pl_module.streams.clear()
            self._slept = emulator.slept_seconds
            self.sms.append(emulator.device.num_sms)
            plan = getattr(trainer.strategy, "plan", None)
            self.split = list(plan.split) if plan is not None else None
            if trainer.global_rank == self.rank:
                emulator.throttle(self.factor)
            self.sms.append(emulator.device.num_sms)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.checks[1] = capped(pl_module, self.emulator(), self._slept)

    return StepClock, ThrottleAt


# -- one process per device -------------------------------------------------------------------------------------------
def fresh(template: Any) -> Any:
    """A new emulator like ``template`` (its device, unthrottled), activated: every solo loop and Lightning
    baseline starts at the pre-change speed (the strategy builds its own from ``emulate``)."""
    from lightning_hetero.lab.emulator import Emulator

    emulator = Emulator(template.device, template.root_device, template.link)
    emulator.activate()
    return emulator


def solo_pair(Workload: type, kind: str, args: argparse.Namespace, device: torch.device, template: Any,
              rank: int) -> dict[str, Any]:
    """This rank's solo rate before and after the throttle, with the emulation check of each."""
    emulator = fresh(template)
    out: dict[str, Any] = {}
    for phase in ("before", "after"):
        if phase == "after" and rank == args.throttle_rank:
            emulator.throttle(args.factor)
        module = Workload(kind, args.tiny, args.seq)
        slept = emulator.slept_seconds
        out[phase] = solo_rate(module, args.batch[kind], args.solo_steps, args.warmup, device, emulator,
                               args.precision)
        out[f"capped_{phase}"] = capped(module, emulator, slept)
        out[f"emulation_{phase}"] = emulator.summary()
        del module
    return out


def run_fit(config: str, module: Any, args: argparse.Namespace, specs: list[dict[str, Any]], template: Any,
            solos_before: list[float], solos_after: list[float]) -> dict[str, Any]:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hetero import HeteroDDPStrategy, Rebalancing

    world = len(specs)
    if config == "ddp":
        strategy: Any = emulated_steps(DDPStrategy)(timeout=timedelta(seconds=_TIMEOUT_S))
        strategy.emulator = fresh(template)
        emulator: Callable[[], Any] = lambda: strategy.emulator  # noqa: E731
    else:
        rebalance: Any = (Rebalancing(every=args.every, threshold=args.threshold, smoothing=args.smoothing)
                          if config == "rebalance" else False)
        strategy = HeteroDDPStrategy(capacities=solos_after if config == "oracle" else solos_before,
                                     emulate=specs, rebalance=rebalance, observation={"print_table": False},
                                     resilience={"timeout": _TIMEOUT_S})
        emulator = lambda: strategy.emulation  # noqa: E731
    at = 0 if config == "oracle" else args.change_at
    steps = args.warmup + args.oracle_steps if config == "oracle" else args.change_at + args.after
    StepClock, ThrottleAt = _callback_classes()
    clock, throttle = StepClock(), ThrottleAt(at, args.factor, args.throttle_rank, emulator)
    batch = args.batch[module.kind]
    trainer = Trainer(accelerator=args.accelerator, devices=world, strategy=strategy, precision=args.precision,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=[clock, throttle])
    module.prepare(args.accelerator == "gpu")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(Indices(batch * world * (steps + 1)),
                                                                       batch_size=batch, shuffle=False))
    row: dict[str, Any] = {"seconds": clock.seconds(), "change_at": at, "global_batch": batch * world,
                           "capped_local": throttle.checks, "sms_local": throttle.sms}
    if config == "ddp":
        row["split_before"] = row["split_after"] = [batch] * world
    else:
        plan = strategy.plan
        row["split_after"], row["split_before"] = list(plan.split), throttle.split
        row["decisions"] = [{"step": d.first_batch - at, "split": list(d.new_split), "gain": d.gain}
                            for d in strategy.share_controller.decisions]
    return row


def worker(local_rank: int, args: argparse.Namespace, port: int, out_file: str) -> None:
    from lightning.pytorch import seed_everything

    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    world = 2
    device = rank_device(local_rank, world, port, args.accelerator)
    cuda = device.type == "cuda"
    specs = emulate_specs(args.scenario, args.accelerator)
    # The template of this process's own emulators (solo loops, the DDP baseline); its NCCL link settings must
    # precede the process group.
    template = start_emulation(parse_emulate(specs), local_rank, world, describe_device(device, local_rank), device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=local_rank, world_size=world,
                            timeout=timedelta(seconds=_TIMEOUT_S), device_id=device if cuda else None)
    Workload = _lightning_module_class()
    rows: list[dict[str, Any]] = []
    round_s = 0.0
    for round_index in range(args.rounds):
        began = time.time()
        if past_deadline(round_index, began, round_s, args.deadline_at, device):
            if local_rank == 0:
                print(f"[bench_rebalance] another round would end past --deadline-s: {round_index} round(s)",
                      flush=True)
            break
        for kind in args.models:
            seed_everything(0, workers=False, verbose=False)
            solo = solo_pair(Workload, kind, args, device, template, local_rank)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, solo)
            solos = {"config": "solo", "before": [g["before"] for g in gathered],
                     "after": [g["after"] for g in gathered],
                     "capped": [[g["capped_before"], g["capped_after"]] for g in gathered],
                     "emulation": [[g["emulation_before"], g["emulation_after"]] for g in gathered]}
            rows.append({**solos, "model": kind, "round": round_index})
            order = list(args.configs[::-1] if round_index % 2 else args.configs)  # drift cancels over rounds
            for config in order:
                seed_everything(0, workers=False, verbose=False)
                module = Workload(kind, args.tiny, args.seq)
                t = time.perf_counter()
                try:
                    row = run_fit(config, module, args, specs, template, solos["before"], solos["after"])
                except Exception as err:  # an error on every rank (e.g. out of memory): report it, go on
                    row = {"error": f"{type(err).__name__}: {err}"[:300]}
                    print(f"[bench_rebalance] rank {local_rank} {kind}/{config}: {row['error']}", flush=True)
                checks: list[Any] = [None] * world
                dist.all_gather_object(checks, [row.pop("capped_local", None), row.pop("sms_local", None)])
                row["capped"], row["sms"] = [c[0] for c in checks], [c[1] for c in checks]
                row.update(config=config, model=kind, round=round_index, config_s=time.perf_counter() - t)
                del module
                keep_row(rows, row, out_file, local_rank == 0, cuda,
                         f"[bench_rebalance] round {round_index + 1} {kind}/{config}: "
                         f"{row.get('error', 'done')} ({row['config_s']:.0f} s)")
        round_s = time.time() - began
    dist.destroy_process_group()


# -- analysis ---------------------------------------------------------------------------------------------------------
def windowed(seconds: list[float], global_batch: int, window: int) -> list[Optional[float]]:
    """Samples/s of the ``window`` steps ending at each step (``None`` before ``window`` steps)."""
    out: list[Optional[float]] = []
    for i in range(len(seconds)):
        span = seconds[max(0, i - window + 1):i + 1]
        out.append(global_batch * window / sum(span) if len(span) == window else None)
    return out


def steps_to(series: list[Optional[float]], change: int, window: int, target: float
             ) -> tuple[Optional[int], Optional[int]]:
    """(reach, hold): steps from the change (its step counted) until the first window at or above ``target``, and
    until the window from which every later one is (``None``: never). Only windows wholly after the change count."""
    after = [(i - change + 1, v) for i, v in enumerate(series) if i >= change + window - 1 and v is not None]
    reach = next((n for n, v in after if v >= target), None)
    hold = None
    for n, v in reversed(after):
        if v < target:
            break
        hold = n
    return reach, hold


def rate(seconds: list[float], global_batch: int) -> Optional[float]:
    return global_batch * len(seconds) / sum(seconds) if seconds and sum(seconds) > 0 else None


def analyse(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Per fit: throughput before the change against the old ideal, steps to the target after it and the settled
    ratio against the new ideal (Σ solo after) and the oracle of the same round."""
    for row in rows:
        if row["config"] == "solo" or "error" in row:
            continue
        same = [r for r in rows if (r["model"], r["round"]) == (row["model"], row["round"]) and "error" not in r]
        solo = next(r for r in same if r["config"] == "solo")
        old_ideal, new_ideal = sum(solo["before"]), sum(solo["after"])
        seconds, batch, at = row["seconds"], row["global_batch"], row["change_at"]
        if row["config"] == "oracle":
            row["oracle_rate"] = rate(seconds[args.warmup:], batch)
            continue
        oracle = next((r for r in same if r["config"] == "oracle"), None)
        oracle_rate = rate(oracle["seconds"][args.warmup:], oracle["global_batch"]) if oracle else None
        series = windowed(seconds, batch, args.window)
        settled = rate(seconds[-args.settle:], batch)
        row.update(
            windowed=series,
            before_ratio=(rate(seconds[args.warmup:at], batch) or 0.0) / old_ideal,
            reach_hold_ideal=steps_to(series, at, args.window, TARGET * new_ideal),
            settled_ratio=(settled or 0.0) / new_ideal,
            new_ideal=new_ideal,
        )
        if oracle_rate:
            row["reach_hold_oracle"] = steps_to(series, at, args.window, TARGET * oracle_rate)
            row["settled_to_oracle"] = (settled or 0.0) / oracle_rate


def _median(values: list[Any]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per model and configuration: medians over rounds (a step count that was never reached counts as
    ``None`` and is shown as the number of rounds that reached it)."""
    lines = []
    for key in dict.fromkeys((r["model"], r["config"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["config"]) == key]
        ok = [r for r in mine if "error" not in r]
        line: dict[str, Any] = {"model": key[0], "config": key[1], "rounds": len(ok),
                                "error": next((r["error"] for r in mine if "error" in r), None)}
        line["unemulated"] = sorted({f"rank {rank} {('before', 'after')[phase]}" for r in ok
                                     for rank, c in enumerate(r.get("capped") or [])
                                     for phase, v in enumerate(c or []) if v is False})
        if key[1] == "solo":
            line["before"] = [statistics.median(r["before"][i] for r in ok) for i in range(len(ok[0]["before"]))]
            line["after"] = [statistics.median(r["after"][i] for r in ok) for i in range(len(ok[0]["after"]))]
            line["emulation"] = ok[0]["emulation"] if ok else None
        else:
            for name in ("before_ratio", "settled_ratio", "settled_to_oracle", "oracle_rate"):
                line[name] = _median([r.get(name) for r in ok])
            for name in ("reach_hold_ideal", "reach_hold_oracle"):
                pairs = [r[name] for r in ok if r.get(name)]
                line[name] = [_median([p[i] for p in pairs]) if pairs else None for i in (0, 1)]
                line[name + "_rounds"] = [sum(p[i] is not None for p in pairs) for i in (0, 1)]
            line["split"] = [ok[-1]["split_before"], ok[-1]["split_after"]] if ok else None
            line["decisions"] = ok[-1].get("decisions") if ok else None
        lines.append(line)
    return lines


def _steps(line: dict[str, Any], name: str) -> str:
    values, reached = line.get(name) or [None, None], line.get(name + "_rounds") or [0, 0]
    cells = [("-" if v is None else f"{v:.0f}") + (f" ({k}/{line['rounds']})" if k < line["rounds"] else "")
             for v, k in zip(values, reached)]
    return " / ".join(cells)


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(lines: list[dict[str, Any]]) -> str:
    headers = ["model", "config", "n", "before /old ideal", f"steps to {TARGET} ideal (reach / hold)",
               "settled /ideal", f"steps to {TARGET} oracle", "settled /oracle", "split before -> end", "emulated"]
    out = []
    for line in lines:
        emulated = "NOT " + ", ".join(line["unemulated"]) if line["unemulated"] else "ok"
        if line["config"] == "solo":
            speed = ", ".join(f"{b:.0f}->{a:.0f} ({a / b:.2f}x)" for b, a in zip(line["before"], line["after"]))
            out.append([line["model"], "solo", str(line["rounds"]), f"Σ {sum(line['before']):.0f}", "-",
                        f"new Σ {sum(line['after']):.0f}", "-", "-", f"[{speed}] samples/s", emulated])
        elif line["error"] and not line["rounds"]:
            out.append([line["model"], line["config"], "0", line["error"][:60], "", "", "", "", "", ""])
        else:
            split = f"{line['split'][0]} -> {line['split'][1]}" if line["split"] else "-"
            before = _ratio(line["before_ratio"]) if line["config"] != "oracle" else "-"
            settled = (_ratio(line["settled_ratio"]) if line["config"] != "oracle"
                       else f"{line['oracle_rate'] or 0:.0f}/s")
            out.append([line["model"], line["config"], str(line["rounds"]), before,
                        _steps(line, "reach_hold_ideal") if line["config"] != "oracle" else "-", settled,
                        _steps(line, "reach_hold_oracle") if line["config"] != "oracle" else "-",
                        _ratio(line.get("settled_to_oracle")), split, emulated])
    return format_table(headers, out)


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: str) -> Optional[str]:
    """Windowed throughput around the change, last round of each model, with the ideals and the oracle."""
    plt = pyplot()
    if plt is None:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        last = max(r["round"] for r in rows if r["model"] == model)
        same = [r for r in rows if (r["model"], r["round"]) == (model, last) and "error" not in r]
        solo = next(r for r in same if r["config"] == "solo")
        for row in same:
            if row.get("windowed"):
                xs = [i - row["change_at"] for i, v in enumerate(row["windowed"]) if v is not None]
                ax.plot(xs, [v for v in row["windowed"] if v is not None], label=row["config"])
        ax.axhline(sum(solo["before"]), color="#999999", linestyle=":", label="ideal before (Σ solo)")
        ax.axhline(sum(solo["after"]), color="black", linestyle="--", label="new ideal (Σ solo after)")
        ax.axhline(TARGET * sum(solo["after"]), color="black", linestyle=":", label=f"{TARGET} × new ideal")
        oracle = next((r for r in same if r.get("oracle_rate")), None)
        if oracle:
            ax.axhline(oracle["oracle_rate"], color="#9467bd", linestyle="-.", label="oracle (best static split)")
        ax.axvline(0, color="red", linewidth=0.8)
        ax.set_title(f"{args.scenario} / {model}: rank {args.throttle_rank} slows {args.factor:g}x at step 0")
        ax.set_xlabel("steps after the change")
        ax.set_ylabel(f"samples/s (window of {args.window} steps)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="mix2", choices=[s for s, c in SCENARIOS.items() if len(c["shares"]) == 2])
    # GPT by default: cuDNN's kernels autotuned for the whole card failed on ResNet-50's first backward after the
    # throttle (CUDNN_STATUS_EXECUTION_FAILED, H100, 2026-11-27); cuBLAS matmuls slow by the SM ratio.
    p.add_argument("--models", default="gpt", help="comma-separated, of resnet50, gpt")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)} (solo always)")
    p.add_argument("--accelerator", default="gpu", choices=["gpu", "cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny models, CPU-sized defaults (smoke run)")
    p.add_argument("--throttle-rank", type=int, default=0, help="the rank that slows down (0: the fast one on mix2)")
    p.add_argument("--factor", type=float, default=2.0, help="how many times slower it becomes")
    p.add_argument("--change-at", type=int, default=None, help="the batch index of the change (default 30, tiny 10)")
    p.add_argument("--after", type=int, default=None, help="steps after the change (default 70, tiny 24)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out before timing (default 5, tiny 2)")
    p.add_argument("--solo-steps", type=int, default=None, help="timed steps of each solo loop (default 15, tiny 4)")
    p.add_argument("--oracle-steps", type=int, default=None, help="timed steps of the oracle (default 20, tiny 8)")
    p.add_argument("--window", type=int, default=None, help="steps per throughput window (default 5, tiny 3)")
    p.add_argument("--settle", type=int, default=None, help="last steps of the settled ratio (default 20, tiny 8)")
    # Rebalancing that can react within 50 steps: an exchange every 10 steps (one all_gather of 3 numbers), so the
    # first window wholly after the change closes within 20 steps of it; no smoothing (that window carries the new
    # rates; a 0.5 average would still be a quarter off after two windows); a 3 % gate (the split settles within 3 %
    # of the best step, while timing noise below the gate moves no sample back and forth).
    p.add_argument("--every", type=int, default=None, help="rebalance.every (default 10, tiny 4)")
    p.add_argument("--threshold", type=float, default=0.03, help="rebalance.threshold")
    p.add_argument("--smoothing", type=float, default=1.0, help="rebalance.smoothing")
    p.add_argument("--batch", type=int, default=None,
                   help="per-device batch (DDP meaning): default ResNet-50 128, GPT 8, tiny 16")
    p.add_argument("--seq", type=int, default=1024, help="GPT sequence length")
    p.add_argument("--rounds", type=int, default=3, help="rounds (configurations reversed every other round)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="a new round starts only if it would end (as long as the last) within this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c and c != "solo"]
    for name, values, known in (("--models", args.models, ("resnet50", "gpt")), ("--configs", args.configs, CONFIGS)):
        bad = [v for v in values if v not in known]
        if bad or not values:
            p.error(f"{name}: {bad or 'empty'} not in {list(known)}")
    if args.throttle_rank not in (0, 1):
        p.error("--throttle-rank must be 0 or 1 (two ranks)")
    args.accelerator = "cpu" if args.accelerator == "cpu" else "gpu"
    tiny = args.tiny
    for name, default, small in (("change_at", 30, 10), ("after", 70, 24), ("warmup", 5, 2), ("solo_steps", 15, 4),
                                 ("oracle_steps", 20, 8), ("window", 5, 3), ("settle", 20, 8), ("every", 10, 4)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else default)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.change_at <= args.warmup:
        p.error("--change-at must be after --warmup (the throughput before the change is measured in between)")
    if args.settle > args.after or args.window > args.after:
        p.error("--settle and --window must fit in --after")
    if args.factor < 1.0:
        p.error("--factor must be >= 1")
    args.batch = {"resnet50": args.batch or (16 if tiny else 128), "gpt": args.batch or (16 if tiny else 8)}
    args.precision = "bf16-mixed" if args.accelerator == "gpu" else "32-true"
    args.started_at = time.time()
    args.deadline_at = args.started_at + args.deadline_s if args.deadline_s else float("inf")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.accelerator == "gpu" and torch.cuda.device_count() < 2:
        raise SystemExit(f"two CUDA devices needed; found {torch.cuda.device_count()}.")
    started = time.perf_counter()
    stop_on_sigterm()
    part = os.path.join(args.out, ".bench_rebalance.json")
    rows, _ = collect_ranks(worker, (args, _free_port(), part), 2, part, "bench_rebalance")
    analyse(rows, args)
    lines = summarize(rows)
    result = {
        "scenario": args.scenario, "emulate": emulate_specs(args.scenario, args.accelerator),
        "throttle_rank": args.throttle_rank, "factor": args.factor, "change_at": args.change_at, "after": args.after,
        "window": args.window, "settle": args.settle, "target": TARGET,
        "rebalance": {"every": args.every, "threshold": args.threshold, "smoothing": args.smoothing},
        "batch_per_device": args.batch, "precision": args.precision, "tiny": args.tiny, "rounds": args.rounds,
        "wall_s": time.perf_counter() - started, "commit": _commit(),
        "device": torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu",
        "torch": torch.__version__, "summary": lines, "rows": rows,
    }
    with open(os.path.join(args.out, "bench_rebalance.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = plot(rows, args, os.path.join(args.out, "bench_rebalance.png")) if rows else None
    print(f"[bench_rebalance] wrote {os.path.join(args.out, 'bench_rebalance.json')}"
          + (f" and {png}" if png else " (no plot)") + f"; total {result['wall_s']:.0f} s on {result['device']}")
    solo = next((line for line in lines if line["config"] == "solo" and line.get("emulation")), None)
    if solo:
        print("[bench_rebalance] emulation per rank (before -> after): "
              + "; ".join(f"rank {r}: {b} -> {a}" for r, (b, a) in enumerate(solo["emulation"])))
    print(f"[bench_rebalance] {result['device']}, commit {result['commit']}, {args.scenario}: rank "
          f"{args.throttle_rank} slows {args.factor:g}x at step {args.change_at}, {args.after} steps after; "
          f"rebalance every {args.every}, threshold {args.threshold:g}, smoothing {args.smoothing:g}; medians over "
          f"rounds; steps counted from the change, windows of {args.window}; ideal = Σ solo after the change, "
          "oracle = static split at the post-change solo rates; emulated: each rank ran under its emulation before "
          "and after")
    print(table(lines))
    return rows


if __name__ == "__main__":
    main()
