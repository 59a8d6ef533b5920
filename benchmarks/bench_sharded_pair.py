"""The sharded mixed pair (issue goal P8): ``HeteroFSDPStrategy`` against the sum of the cards' solo rates and against
Lightning's ``FSDPStrategy``, every rank emulated as its card in its own process, all in one command.

Every run goes through :mod:`benchmarks.rehearse_real` (rank r alone on GPU r, NCCL, its own emulator, each rank's
emulation timed on a fixed workload before its first step), in this order:

1. **solo**, what Σ solo means: each card alone (a world of one; both cards at once, each on its own GPU) trains
   the same model, AdamW and precision with ``HeteroFSDPStrategy(memory="auto")`` at its batch in the pair. An
   emulated 24 GiB card ran out of memory holding a 1.1B replica under Lightning's DDP at one sample (RESULTS.md,
   the 1.1B rehearsal); one FSDP rank with every state on it and no DDP buckets fits, checkpointing or offloading
   what does not; the JSON records the plan it picked. Alone a card has no communication and no wait for the
   other: that is what Σ solo stands for.
   It also steps AdamW over all the parameters, where in the pair it steps its half; this is the one cost of the
   solo definition a pair rank does not pay (on the emulated 3090, whose 8 SMs stream the optimizer slowly, a
   noticeable share of a solo step at one sample), so a ratio near 1 says the pair loses nothing beyond it. The first
   round runs at the split of the published rates; once the levers have run, each card not yet timed at a lever's
   batch is timed at it, so every lever's Σ solo is at its own batches.
2. **levers** (ours): one run per configuration of ``--levers``, each ``key=value`` joined by ``+``:
   ``caps=measured`` (the solo rates of step 1), ``caps=peak``, ``caps=equal`` or ``caps=5/1``; ``gb=16`` (global
   batch; default the config's ``batch_size`` × 2); ``memory=auto`` (any ``memory`` rule);
   ``keep_gathered=true|false|auto`` (``MemoryPolicy(keep_gathered=...)``; default ``auto``, the plan's choice:
   FSDP's ``reshard_after_forward=False``, one all-gather per block and step instead of two, where memory allows).
   E.g. ``--levers "caps=measured,caps=measured+keep_gathered=false"``: the plan's choice against blocks resharded
   after forward. Each run records the choice (``keep_gathered``, also in the table's plans).
3. **baseline**: Lightning's ``FSDPStrategy`` (``fsdp``; ``fsdp:offload`` with its CPU offload) at every global
   batch a lever ran, equal batches, every step under the rank's emulation; ``ddp`` on CPU, where Lightning's FSDP
   does not run, to exercise the path.

Each lever's samples/s is its global batch over its slowest rank's median step (2 warm-up steps untimed); printed:
ours ÷ Σ solo, ours ÷ Lightning at the same global batch, Lightning ÷ Σ solo (at the first lever's batches), and
each run's per-rank emulation (the workload time against rank 0's, expected from the emulated SM counts; a rank
without an emulator is named). Every run fills ``benchmarks.lm.GPTModule``'s weights (``init="fill"``: seconds for
1.1B parameters instead of a serial random draw per weight; ``--random-init`` for torch's own).

``--big``: the largest-model check: a GPT of ``--big-params`` billion parameters (``--big-width``, weights filled
without per-element random draws: ``benchmarks.lm.GPTModule(init="fill")``) on a pair capped at ``--big-caps``
GiB (memory only; full compute unless ``--big-lab`` gives presets), ``memory="auto"`` (per-block offload and
checkpointing) against Lightning's ``FSDPStrategy`` with ``cpu_offload=True``; the host memory and time are estimated
first and printed. ``--size 8b`` / ``13b`` picks the GPT; ``--big-runs ours,ours:plain`` runs ours with the fused,
overlapped host step (``memory.host_step``, :mod:`lightning_hetero.grad.host_optimizer`) and with the optimizer's own;
each of our runs profiles one step per rank (:mod:`benchmarks.step_split`) and prints it split into device compute,
copies, collectives and the host optimizer (its ns per parameter). ``--host-ns``: ns per parameter of a host AdamW
step, loop / foreach / fused.

    python benchmarks/bench_sharded_pair.py --out $OUT/p8            # 2 GPUs, the 1.1B pair (jsonargparse needed)
    python benchmarks/bench_sharded_pair.py --big --out $OUT/p8big   # 2 GPUs, ~8B on 52 + 22 GiB
    python benchmarks/bench_sharded_pair.py --big --size 8b --big-runs ours,ours:plain --out $OUT/p8big
    python benchmarks/bench_sharded_pair.py --accelerator cpu --model configs/rehearse_cpu.yaml --steps 4 \\
        --levers "caps=measured,caps=equal+gb=12" --out /tmp/p8        # CPU smoke of every path (gloo)
"""

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rehearse_check import solo_card  # noqa: E402
from benchmarks.rehearse_real import EMULATION_AGREEMENT, Run, emulation_rows, run_jobs  # noqa: E402
from lightning_hetero.lab.presets import PRESETS, preset_tflops  # noqa: E402
from lightning_hetero.plan.split import split_batch  # noqa: E402
from lightning_hetero.registry import entry  # noqa: E402
from lightning_hetero.rehearse.cards import card_label, parse_lab  # noqa: E402
from lightning_hetero.rehearse.job import RankJob, RankResult  # noqa: E402
from lightning_hetero.rehearse.launch import free_port, launch_ranks  # noqa: E402

OURS = "hetero_fsdp"
BASELINES = {"fsdp": ("real_fsdp", None), "fsdp:offload": ("real_fsdp", "offload"), "ddp": ("real_ddp", None)}
# The config's batch (8: 7 + 1 at the measured rates) with the plan's choice of keeping blocks gathered, then with them
# resharded after forward (a third more traffic on the PCIe-class link), then twice the batch (each card's compute
# against the same traffic and fixed costs), then both.
DEFAULT_LEVERS = ("caps=measured,caps=measured+keep_gathered=false,caps=measured+gb=16,"
                  "caps=measured+gb=16+keep_gathered=false")
# The big check's model: width, heads and sequence of the 1.1B config's family, vocabulary padded as nanoGPT does.
BIG_SEQ, BIG_VOCAB = 512, 50304
# CPU AdamW cost assumed by the big check's time estimate (ns per offloaded parameter and step, 16 host cores): an
# assumption for the unfused per-parameter loop; each run of ours measures its host step (benchmarks.step_split).
CPU_ADAM_NS = 4.0
# `--size`: (billions of parameters, width) of the big check's GPT.
SIZES = {"8b": (8.0, 4096), "13b": (13.0, 5120)}
# The optimizer step profiled on every rank of a big run (0-based: after the 2 untimed warm-up steps).
SPLIT_STEP = 3


@dataclass(frozen=True)
class Lever:
    """One configuration of ours: where the shares come from, the global batch, the memory rule."""

    text: str
    capacities: str = "measured"
    global_batch: Optional[int] = None
    memory: str = "auto"
    keep_gathered: Union[bool, str] = "auto"  # MemoryPolicy's: True, False or "auto" (the plan's choice)

    @classmethod
    def parse(cls, text: str) -> "Lever":
        fields: dict[str, Any] = {}
        for item in filter(None, text.split("+")):
            key, sep, value = item.partition("=")
            if not sep or not value:
                raise ValueError(f"`--levers` item {item!r} of {text!r}: give key=value (caps, gb, memory, "
                                 "keep_gathered)")
            if key == "caps":
                ok = value in ("measured", "peak", "equal") or all(_positive(v) for v in value.split("/"))
                if not ok:
                    raise ValueError(f"`--levers` caps={value!r}: measured, peak, equal or numbers like 5/1")
                fields["capacities"] = value
            elif key == "gb":
                if not value.isdigit() or int(value) < 2:
                    raise ValueError(f"`--levers` gb={value!r}: a global batch of at least 2")
                fields["global_batch"] = int(value)
            elif key == "memory":
                fields["memory"] = value
            elif key == "keep_gathered":
                choices = {"true": True, "false": False, "auto": "auto"}
                if value not in choices:
                    raise ValueError(f"`--levers` keep_gathered={value!r}: true, false or auto")
                fields["keep_gathered"] = choices[value]
            else:
                raise ValueError(f"`--levers` key {key!r} of {text!r}: one of caps, gb, memory, keep_gathered")
        return cls(text, **fields)

    def capacities_for(self, measured: Optional[list[float]]) -> Any:
        if self.capacities == "measured":
            if not measured:
                raise ValueError(f"lever {self.text!r}: the solo rates were not measured (a solo run failed)")
            return [round(r, 4) for r in measured]
        if "/" in self.capacities:
            return [float(v) for v in self.capacities.split("/")]
        return self.capacities

    def strategy_args(self, measured: Optional[list[float]], policy: Optional[dict[str, Any]] = None
                      ) -> dict[str, Any]:
        """Our strategy's arguments under this lever (as a config's ``init_args``); ``policy``: more
        :class:`~lightning_hetero.MemoryPolicy` fields."""
        memory: Any = self.memory
        if self.keep_gathered != "auto" or policy:
            memory = {"rules": {"*": self.memory}, "keep_gathered": self.keep_gathered, **(policy or {})}
        args: dict[str, Any] = {"capacities": self.capacities_for(measured), "memory": memory}
        if self.global_batch:
            args["global_batch_size"] = self.global_batch
        return args


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def config_with(base: dict[str, Any], strategy_args: Optional[dict[str, Any]],
                model_args: Optional[dict[str, Any]] = None, batch_size: Optional[int] = None) -> dict[str, Any]:
    """``base`` (a parsed LightningCLI config) with our sharded strategy and ``strategy_args`` (``None``: the
    strategy left as it is, for Lightning's runs, which set their own), the model's and the data's arguments
    updated."""
    config = copy.deepcopy(base)
    if strategy_args is not None:
        config.setdefault("trainer", {})["strategy"] = {"class_path": entry(OURS).class_path,
                                                         "init_args": dict(strategy_args)}
    if model_args:
        config["model"].setdefault("init_args", {}).update(model_args)
    if batch_size is not None:
        config["data"].setdefault("init_args", {})["batch_size"] = batch_size
    return config


def write_config(config: dict[str, Any], path: str) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def per_rank_batch(base: dict[str, Any]) -> int:
    return int(((base.get("data") or {}).get("init_args") or {}).get("batch_size", 4))


def peak_rates(lab: list[Any]) -> list[float]:
    """The cards' published rates (the first guess at the split, before the solo rates are measured)."""
    names = [entry if isinstance(entry, str) else entry.get("preset") for entry in lab]
    return [preset_tflops(PRESETS[n]) if n in PRESETS else 1.0 for n in names]


def samples_per_s(results: list[RankResult], global_batch: Optional[int] = None) -> tuple[Optional[float], Any]:
    """Global batch over the slowest rank's median step, and the largest per-rank spread (IQR / median)."""
    steps = [r.step_time for r in results]
    if not results or not all(r.ok for r in results) or not all(steps):
        return None, None
    batch = global_batch or results[0].global_batch or sum(r.batch or 0 for r in results)
    spreads = [r.step_spread for r in results if r.step_spread is not None]
    return batch / max(steps), (max(spreads) if spreads else None)


def emulation_check(results: list[RankResult]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each rank's emulation at work (:func:`benchmarks.rehearse_real.emulation_rows`), and each miss in words."""
    rows = emulation_rows(results)
    misses = []
    for row, result in zip(rows, results):
        if row["speed"] is None and row["probe_seconds"] is not None:
            misses.append(f"rank {row['rank']} ({result.card}): NOT EMULATED")
        elif row["ratio"] and row["expected_ratio"] and \
                abs(row["ratio"] / row["expected_ratio"] - 1) > EMULATION_AGREEMENT:
            misses.append(f"rank {row['rank']} ({result.card}): workload {row['ratio']:.2f}x rank 0's, expected "
                          f"{row['expected_ratio']:.2f}x")
    return rows, misses


def run_record(name: str, results: list[RankResult], global_batch: Optional[int] = None) -> dict[str, Any]:
    rate, spread = samples_per_s(results, global_batch)
    emulation, misses = emulation_check(results)
    return {"run": name, "samples_per_s": rate, "spread": spread, "split": results[0].split if results else None,
            "plans": [r.plan for r in results], "keep_gathered": results[0].keep_gathered if results else None,
            "batches": [r.batch for r in results],
            "step_seconds": [r.step_time for r in results], "peak_bytes": [r.peak_allocated_bytes for r in results],
            "estimate_bytes": [r.estimated_bytes for r in results],
            "host_rss_bytes": [r.host_rss_bytes for r in results],
            "errors": [r.error for r in results if r.error], "emulation": emulation, "emulation_misses": misses}


class Pair:
    """The runs of one command, sharing the lab, the scratch folder, the log and the launch settings."""

    def __init__(self, args: argparse.Namespace, lab: list[Any], scratch: str, log: Any) -> None:
        self.args, self.lab, self.scratch, self.log = args, lab, scratch, log
        self.solo: dict[tuple[int, int], RankResult] = {}  # (card, batch) -> its solo run

    def solo_runs(self, base: dict[str, Any], wanted: list[tuple[int, int]]) -> None:
        """Each (card, batch) not yet timed, alone; the cards' runs at once, each on its own GPU. The plan is the
        strategy's own (``memory="auto"``, the step measured before the first step); a card whose plan turned out
        not to fit is run again with the model's activations counted (:func:`counted_policy`), so that ``auto``
        checkpoints or offloads what it must when the model is sharded."""
        todo = [w for w in dict.fromkeys(wanted) if w not in self.solo and w[1] > 0]
        measured = write_config(config_with(base, {"capacities": "equal", "memory": "auto"}),
                                os.path.join(self.scratch, "solo.yaml"))
        policy = counted_policy(base)
        retried: set[tuple[int, int]] = set()
        gpu = self.args.accelerator == "gpu"
        while todo:
            batch_round = list({card: (card, b) for card, b in reversed(todo)}.values())  # one per card
            jobs = []
            for card, b in batch_round:
                config = measured
                if (card, b) in retried:
                    config = write_config(config_with(base, {"capacities": "equal", "global_batch_size": b,
                                                             "memory": {"rules": {"*": "auto"}, **(policy or {})}}),
                                          os.path.join(self.scratch, f"solo-counted-b{b}.yaml"))
                jobs.append(RankJob(config, "solo", 0, [solo_card(self.lab, card, self.args.accelerator)],
                                    self.args.steps, os.path.join(self.scratch, f"solo-card{card}-b{b}.json"),
                                    entry(OURS).class_path, self.args.accelerator, port=free_port(), batch_size=b,
                                    gpu=card if gpu else None))
            self.log.write(f"\n===== solo {batch_round} =====\n")
            for (card, b), result in zip(batch_round, launch_ranks(jobs, self.args.timeout, self.log)):
                short = not result.ok and (result.oom or "MemoryFitError" in (result.error or ""))
                if short and policy and (card, b) not in retried:
                    retried.add((card, b))
                    print(f"  solo card {card} batch {b}: {result.error}; again with the activations counted",
                          flush=True)
                    continue
                self.solo[(card, b)] = result
                print(f"  solo card {card} ({card_label(self.lab[card])}) batch {b}: "
                      f"{_rate(b, result)} samples/s, plan {result.plan} {result.error or ''}", flush=True)
            todo = [w for w in todo if w not in self.solo]

    def solo_rate(self, card: int, batch: int) -> Optional[float]:
        result = self.solo.get((card, batch))
        return batch / result.step_time if result and result.ok and result.step_time else None

    def sum_solo(self, split: Optional[list[int]]) -> Optional[float]:
        if not split:
            return None
        rates = [self.solo_rate(card, b) for card, b in enumerate(split) if b > 0]
        return sum(rates) if rates and all(r is not None for r in rates) else None  # type: ignore[misc]

    def ours(self, base: dict[str, Any], lever: Lever, measured: Optional[list[float]], tag: str,
             policy: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        args = lever.strategy_args(measured, policy)
        config = write_config(config_with(base, args), os.path.join(self.scratch, f"{tag}.yaml"))
        results = run_jobs(config, self.lab, Run(tag, OURS), "real", self.args.steps, self.scratch,
                           self.args.accelerator, self.args.timeout, self.log)
        record = run_record(lever.text, results)
        record["capacities"] = args["capacities"]
        return record

    def baseline(self, config: str, name: str, tag: str = "") -> dict[str, Any]:
        mode, memory = BASELINES[name]
        results = run_jobs(config, self.lab, Run(f"{name}{tag}", None, memory), mode, self.args.steps, self.scratch,
                           self.args.accelerator, self.args.timeout, self.log)
        return run_record(f"Lightning {name}", results)


def _rate(batch: int, result: RankResult) -> str:
    return f"{batch / result.step_time:.2f}" if result.ok and result.step_time else "-"


def pair_check(args: argparse.Namespace) -> dict[str, Any]:
    """The 1.1B pair: solo, every lever (``--rounds`` times, interleaved with the baseline), the baseline."""
    lab = parse_lab(args.lab)
    if len(lab) != 2:
        raise ValueError(f"`--lab` {args.lab!r}: this benchmark is for a pair of cards")
    levers = [Lever.parse(t) for t in args.levers.split(",") if t.strip()]
    with open(args.model) as f:
        base = yaml.safe_load(f)
    if not args.random_init and str(base["model"].get("class_path", "")).endswith("lm.GPTModule"):
        # Every run (solo, ours, Lightning's) with the weights filled: seconds instead of a serial draw per weight.
        base["model"].setdefault("init_args", {})["init"] = "fill"
    default_batch = per_rank_batch(base) * len(lab)
    result: dict[str, Any] = {"config": args.model, "lab": lab, "steps": args.steps, "levers": [], "baseline": [],
                              "solo": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sharded-pair-") as scratch, \
            open(os.path.join(args.out, "pair.log"), "w") as log:
        pair = Pair(args, lab, scratch, log)
        first_batch = (levers[0].global_batch if levers else None) or default_batch
        guess = split_batch(first_batch, peak_rates(lab))
        pair.solo_runs(base, list(enumerate(guess)))
        rates = [pair.solo_rate(card, b) for card, b in enumerate(guess)]
        measured = [float(r) for r in rates] if all(rates) else None
        result["measured_capacities"] = measured
        print(f"  solo rates at {guess}: {measured} samples/s (the 'measured' capacities)", flush=True)
        records: dict[str, list[dict[str, Any]]] = {lever.text: [] for lever in levers}
        batches = sorted({lever.global_batch or default_batch for lever in levers} or {default_batch})
        result["default_global_batch"] = default_batch
        launches: list[float] = []

        def room() -> bool:
            """Whether one more launch (as long as the longest so far) ends before ``--deadline-s``."""
            if not args.deadline_s:
                return True
            left = args.deadline_s - (time.perf_counter() - started)
            if left < max(launches, default=0.0):
                print(f"  skipped: {left:.0f} s left of --deadline-s {args.deadline_s:g}", flush=True)
                return False
            return True

        def timed(run: Any) -> Any:
            began = time.perf_counter()
            value = run()
            launches.append(time.perf_counter() - began)
            return value

        # One global batch at a time, each group whole (levers, Lightning, the solo runs at its splits) before the
        # next: a command stopped by its deadline keeps complete ratios for the groups it ran.
        for round_ in range(args.rounds):
            for global_batch in batches:
                group = [(i, lv) for i, lv in enumerate(levers) if (lv.global_batch or default_batch) == global_batch]
                for i, lever in group:
                    if not room():
                        break
                    record = timed(lambda: pair.ours(base, lever, measured, f"lever{i}-round{round_}"))
                    records[lever.text].append(record)
                    print(f"  round {round_} {lever.text}: {_fmt(record['samples_per_s'])} samples/s split "
                          f"{record['split']} plans {record['plans']} {record['errors'] or ''}", flush=True)
                    _save(args, result, levers, records, pair, started)
                # Lightning at the same global batch, equal batches: each lever against the same samples a step.
                if args.baseline != "none" and room():
                    config = write_config(config_with(base, None, batch_size=global_batch // len(lab)),
                                          os.path.join(scratch, f"lightning-gb{global_batch}.yaml"))
                    # Lightning's FSDPStrategy needs an accelerator: on CPU its DDP exercises the path.
                    name = "ddp" if args.accelerator == "cpu" and args.baseline.startswith("fsdp") else args.baseline
                    record = timed(lambda: pair.baseline(config, name, f"-gb{global_batch}-round{round_}"))
                    record["global_batch"] = global_batch
                    result["baseline"].append(record)
                    print(f"  round {round_} {record['run']} at {global_batch}: {_fmt(record['samples_per_s'])} "
                          f"samples/s {record['errors'] or ''}", flush=True)
                # Σ solo at each lever's own batches: the cards whose batch there was not timed yet.
                wanted = [(card, b) for _, lv in group for r in records[lv.text] for card, b in
                          enumerate(r["split"] or [])]
                if wanted and room():
                    timed(lambda: pair.solo_runs(base, wanted))
                _save(args, result, levers, records, pair, started)
    return result


def _save(args: argparse.Namespace, result: dict[str, Any], levers: list[Lever],
          records: dict[str, list[dict[str, Any]]], pair: Pair, started: float) -> None:
    """The summary so far (after every run: a command cut short keeps what it measured)."""
    default = result.get("default_global_batch")

    def lightning_at(global_batch: Optional[int]) -> Optional[float]:
        rates = [r["samples_per_s"] for r in result["baseline"]
                 if r["samples_per_s"] and r.get("global_batch") == (global_batch or default)]
        return statistics.median(rates) if rates else None

    result["levers"] = []
    for lever in levers:
        lightning_rate = lightning_at(lever.global_batch)
        runs = records.get(lever.text, [])
        rates = [r["samples_per_s"] for r in runs if r["samples_per_s"]]
        solo = pair.sum_solo(runs[0]["split"]) if runs else None
        median = statistics.median(rates) if rates else None
        result["levers"].append({
            "lever": lever.text, "runs": runs, "samples_per_s": median,
            "min": min(rates) if rates else None, "max": max(rates) if rates else None, "sum_solo": solo,
            "over_sum_solo": median / solo if median and solo else None,
            "lightning_samples_per_s": lightning_rate,
            "over_lightning": median / lightning_rate if median and lightning_rate else None})
    main = result["levers"][0] if result["levers"] else {}
    lightning_rate = main.get("lightning_samples_per_s")
    result["lightning_samples_per_s"] = lightning_rate
    result["lightning_over_sum_solo"] = (lightning_rate / main["sum_solo"] if lightning_rate and main.get("sum_solo")
                                         else None)
    result["solo"] = {f"card{card}-b{b}": {"card": card_label(pair.lab[card]), "batch": b,
                                           "samples_per_s": pair.solo_rate(card, b), "plan": r.plan,
                                           "step_seconds": r.step_time, "peak_bytes": r.peak_allocated_bytes,
                                           "emulated_speed": r.emulated_speed,
                                           "probe_seconds": r.emulation_probe_seconds, "error": r.error}
                      for (card, b), r in pair.solo.items()}
    result["wall_s"] = time.perf_counter() - started
    with open(os.path.join(args.out, "sharded_pair.json"), "w") as f:
        json.dump(result, f, indent=1)


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_pair(result: dict[str, Any]) -> str:
    lines = [f"Sharded pair {result['lab']} ({result['config']}), {result['steps']} steps a run (2 untimed), "
             f"{result.get('wall_s', 0):.0f} s"]
    for key, solo in sorted(result["solo"].items()):
        lines.append(f"solo {solo['card']:<10} batch {solo['batch']:>3}: {_fmt(solo['samples_per_s'])} samples/s, "
                     f"plan {solo['plan']}, emulated speed {solo['emulated_speed']}, workload "
                     f"{_fmt(solo['probe_seconds'], 3)} s {solo['error'] or ''}")
    lines.append(f"{'run':<36} {'split':>9} {'plans':<28} {'samples/s (min-max)':>22} {'÷Σsolo':>7} "
                 f"{'÷Lightning':>10}")
    for lever in result["levers"]:
        run = lever["runs"][0] if lever["runs"] else {}
        span = f"{_fmt(lever['samples_per_s'])} ({_fmt(lever['min'])}-{_fmt(lever['max'])})"
        lines.append(f"{lever['lever']:<36} {str(run.get('split')):>9} {_plans(run):<28} {span:>22} "
                     f"{_fmt(lever['over_sum_solo'])    :>7} {_fmt(lever['over_lightning']):>10}")
    shown = set()
    for base in result["baseline"]:
        if base.get("global_batch") in shown:
            continue
        shown.add(base.get("global_batch"))
        rates = [b["samples_per_s"] for b in result["baseline"]
                 if b.get("global_batch") == base.get("global_batch") and b["samples_per_s"]]
        span = f"{_fmt(statistics.median(rates) if rates else None)} ({_fmt(min(rates, default=None))}-" \
               f"{_fmt(max(rates, default=None))})"
        lines.append(f"{base['run']:<36} {str(base['batches']):>9} {str(base['plans']):<28} {span:>22}")
    lines.append(f"Lightning ÷ Σ solo (at the first lever's batches, same global batch): "
                 f"{_fmt(result['lightning_over_sum_solo'])}")
    lines.append("emulation per rank (workload time x rank 0's / expected from the emulated speeds):")
    for name, runs in [(lv["lever"], lv["runs"]) for lv in result["levers"]] + [("Lightning", result["baseline"])]:
        for run in runs[:1]:
            cells = [f"rank {e['rank']} speed {e['speed']} {_fmt(e['ratio'])}x ({_fmt(e['expected_ratio'])}x)"
                     for e in run["emulation"]]
            lines.append(f"  {name:<36} " + "; ".join(cells) + "".join(f"  MISS {m}" for m in run["emulation_misses"]))
    return "\n".join(lines)


def _plans(run: dict[str, Any]) -> str:
    """A run's memory plans, and ``+gathered`` where its blocks stayed gathered from forward to backward."""
    return str(run.get("plans")) + (" +gathered" if run.get("keep_gathered") else "")


def plot(result: dict[str, Any], path: str) -> None:
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    names, rates, colors = [], [], []
    main = result["levers"][0] if result["levers"] else None
    if main and main["sum_solo"]:
        names.append("Σ solo"), rates.append(main["sum_solo"]), colors.append("tab:gray")
    for lever in result["levers"]:
        names.append(lever["lever"]), rates.append(lever["samples_per_s"] or 0), colors.append("tab:blue")
    if result.get("lightning_samples_per_s"):
        names.append("Lightning"), rates.append(result["lightning_samples_per_s"]), colors.append("tab:orange")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    ax.bar(names, rates, color=colors)
    for lever in result["levers"]:
        if lever["over_sum_solo"]:
            ax.annotate(f"{lever['over_sum_solo']:.2f} of Σ solo", (lever["lever"], lever["samples_per_s"]),
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples/s")
    ax.tick_params(axis="x", rotation=30)
    ax.set_title(f"sharded pair {result['lab']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_big(result: dict[str, Any], path: str) -> None:
    """The big check: each run's samples/s, and each profiled rank's step by kind (device compute, copies,
    collectives; the host optimizer's seconds, overlapped or waited for)."""
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    fig, (rates, split) = plt.subplots(1, 2, figsize=(12, 4))
    rates.bar([r["run"] for r in runs], [r["samples_per_s"] or 0 for r in runs],
              color=["tab:orange" if r["run"].startswith("Lightning") else "tab:blue" for r in runs])
    rates.set_ylabel("samples/s (0: the run did not finish)")
    rates.tick_params(axis="x", rotation=20)
    bars = [(f"{r['run']}\nrank {s['rank']}", s) for r in runs for s in r.get("split") or []]
    kinds = {"step (wall)": lambda s: s["wall_s"], "device compute": lambda s: s["device_s"]["compute"],
             "device copies": lambda s: s["device_s"]["copies"],
             "device collectives": lambda s: s["device_s"]["collectives"],
             "host optimizer": lambda s: (s["host_optimizer"] or [{}])[0].get("seconds") or 0.0}
    width = 0.8 / len(kinds)
    for k, (kind, seconds) in enumerate(kinds.items()):
        split.bar([i + (k - len(kinds) / 2 + 0.5) * width for i in range(len(bars))],
                  [seconds(s) for _, s in bars], width=width, label=kind)
    split.set_xticks(range(len(bars)), [n for n, _ in bars])
    split.set_ylabel("seconds in the profiled step (kinds run at once)")
    split.legend(fontsize=7)
    model = result["model"]
    fig.suptitle(f"GPT {model['layers']}x{model['width']} ({result['estimate']['parameters'] / 1e9:.2f}B) on "
                 f"{result['caps_gib']} GiB, global batch {result['estimate']['batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- the largest model --------------------------------------------------------------------------------------------
def big_model(params_b: float, width: int, seq: int = BIG_SEQ) -> dict[str, Any]:
    """GPT arguments of about ``params_b`` billion parameters at ``width`` (heads of 128) and ``seq`` tokens."""
    from models import GPTConfig, gpt_parameters

    per_block = 12 * width * width + 13 * width
    outside = gpt_parameters(GPTConfig(vocab=BIG_VOCAB, seq=seq, width=width, layers=0, heads=width // 128))
    layers = max(1, math.ceil((params_b * 1e9 - outside) / per_block))
    return {"vocab": BIG_VOCAB, "seq": seq, "width": width, "layers": layers, "heads": width // 128,
            "init": "fill"}


def big_policy(model: dict[str, Any]) -> dict[str, Any]:
    """:class:`~lightning_hetero.MemoryPolicy` fields counting a ``benchmarks.lm.GPTModule``'s activations
    (:func:`benchmarks.models.gpt_activation_bytes`) from its arguments."""
    from models import GPTConfig, gpt_activation_bytes

    per_sample, fraction = gpt_activation_bytes(GPTConfig(vocab=model["vocab"], seq=model["seq"],
                                                          width=model["width"], layers=model["layers"],
                                                          heads=model["heads"]))
    return {"activation_bytes_per_sample": per_sample, "checkpointed_fraction": fraction}


def counted_policy(base: dict[str, Any]) -> Optional[dict[str, Any]]:
    """:func:`big_policy` for the config's model when it is ``benchmarks.lm.GPTModule``; ``None`` otherwise."""
    model = base.get("model") or {}
    if not str(model.get("class_path", "")).endswith("lm.GPTModule"):
        return None
    from benchmarks.lm import GPTModule
    import inspect

    defaults = {k: v.default for k, v in inspect.signature(GPTModule).parameters.items()}
    return big_policy({**defaults, **(model.get("init_args") or {})})


def big_estimate(model: dict[str, Any], caps_gib: list[float], batch: int) -> dict[str, Any]:
    """Host memory and step time to expect, from the planner (``bench_fsdp_shared.plan``: ``memory="auto"`` under
    the caps at 3 + 1 samples) and :data:`CPU_ADAM_NS`."""
    from bench_fsdp_shared import plan
    from models import GPTConfig, gpt_parameters

    cfg = GPTConfig(vocab=model["vocab"], seq=model["seq"], width=model["width"], layers=model["layers"],
                    heads=model["heads"])
    total = gpt_parameters(cfg)
    per_block = (12 * cfg.width ** 2 + 13 * cfg.width) / len(caps_gib)  # one rank's shard of a block
    plans = plan("per-block", cfg, caps_gib)
    offloaded = [p.offload_blocks * per_block for p in plans] if plans else None
    init = 4 * total * len(caps_gib)  # each rank builds the whole model in fp32 before sharding it
    ours_host = init + 16 * sum(offloaded) if offloaded else None
    lightning_host = init + 16 * total  # every parameter's fp32 shard, gradient and AdamW state in host memory
    return {"parameters": total, "plans": [p.mode for p in plans] if plans else None,
            "offloaded_parameters": offloaded, "host_bytes_ours": ours_host, "host_bytes_lightning": lightning_host,
            "cpu_adam_seconds_ours": max(offloaded) * CPU_ADAM_NS * 1e-9 if offloaded else None,
            "cpu_adam_seconds_lightning": total / len(caps_gib) * CPU_ADAM_NS * 1e-9, "batch": batch}


def host_step_ns(parameters: int, threads: int, repeats: int = 3) -> dict[str, float]:
    """ns per parameter of one AdamW step on CPU tensors (blocks of 64M elements, as an offloaded block's shards),
    torch's per-parameter loop, ``foreach`` and ``fused``, at ``threads`` intra-op threads; the best of
    ``repeats`` steps after one untimed."""
    import torch

    torch.set_num_threads(threads)
    sizes = [min(64 << 20, parameters - i) for i in range(0, parameters, 64 << 20)]
    params = [torch.nn.Parameter(torch.full((n,), 0.01)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    result = {}
    for name, how in (("loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **how)
        optimizer.step()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - started)
        result[name] = min(times) / parameters * 1e9
        del optimizer
    return result


def host_step_check(args: argparse.Namespace) -> dict[str, Any]:
    """``--host-ns``: :func:`host_step_ns` at each of ``--host-threads``; JSON and a table."""
    import torch

    rows = {t: host_step_ns(int(args.host_params * 1e6), t) for t in (int(t) for t in args.host_threads.split(","))}
    result = {"parameters": int(args.host_params * 1e6), "cpus": os.cpu_count(), "torch": torch.__version__,
              "ns_per_parameter": {str(t): r for t, r in rows.items()}}
    with open(os.path.join(args.out, "host_step_ns.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"AdamW step on the host, {result['parameters'] / 1e6:.0f}M parameters, {os.cpu_count()} CPUs "
          f"(ns per parameter):\n{'threads':>8} {'loop':>8} {'foreach':>8} {'fused':>8}")
    for t, r in rows.items():
        print(f"{t:>8} {r['loop']:>8.2f} {r['foreach']:>8.2f} {r['fused']:>8.2f}")
    return result


def read_splits(folder: str) -> list[Optional[dict[str, Any]]]:
    """Every rank's profiled step (:mod:`benchmarks.step_split`) written into ``folder``; ``None`` for a rank
    without one."""
    found = []
    for rank in range(8):
        path = os.path.join(folder, f"split-rank{rank}.json")
        if not os.path.exists(path):
            break
        with open(path) as f:
            found.append(json.load(f))
    return found


def format_split(record: dict[str, Any]) -> list[str]:
    """One line per rank: the profiled step's wall time, device time by kind, the host optimizer's timings."""
    lines = []
    for split in record.get("split") or []:
        device = split["device_s"]
        host = (split["host_optimizer"] or [{}])[0]
        host_text = (f"host optimizer {host['seconds']:.2f} s ({host['overlapped']:.2f} s during the backward, "
                     f"{host['waited']:.2f} s waited after it), {_fmt(host.get('ns_per_parameter'))} ns/param, "
                     f"{host['threads']} threads" if host else "no host step")
        lines.append(f"    rank {split['rank']}: step {split['wall_s']:.2f} s; device: compute "
                     f"{device['compute']:.2f} s, "
                     f"copies {device['copies']:.2f} s, collectives {device['collectives']:.2f} s; {host_text}")
    return lines


def big_check(args: argparse.Namespace) -> dict[str, Any]:
    caps = [float(c) for c in args.big_caps.split(",")]
    lab = parse_lab(args.big_lab) if args.big_lab else [{"memory_gib": c} for c in caps]
    params_b, width = SIZES[args.size] if args.size else (args.big_params, args.big_width)
    model = big_model(params_b, width, args.big_seq)
    estimate = big_estimate(model, caps, args.big_batch)
    gib = 2 ** 30
    print(f"big: GPT {model['layers']}x{model['width']} ({estimate['parameters'] / 1e9:.2f}B), lab {lab}; planned "
          f"{estimate['plans']}; host memory ours ~{(estimate['host_bytes_ours'] or 0) / gib:.0f} GiB, Lightning "
          f"offload ~{estimate['host_bytes_lightning'] / gib:.0f} GiB (the whole model in fp32 per rank at init, "
          f"then 16 B per offloaded parameter); CPU AdamW ~{_fmt(estimate['cpu_adam_seconds_ours'], 1)} s / "
          f"{estimate['cpu_adam_seconds_lightning']:.1f} s a step at {CPU_ADAM_NS} ns a parameter", flush=True)
    with open(args.model) as f:
        base = yaml.safe_load(f)
    base["model"]["init_args"] = {**base["model"].get("init_args", {}), **model}
    base["data"]["init_args"] = {**base["data"].get("init_args", {}), "seq": model["seq"], "vocab": BIG_VOCAB,
                                 "batch_size": args.big_batch // len(lab), "samples": 64}
    result: dict[str, Any] = {"model": model, "lab": lab, "caps_gib": caps, "estimate": estimate,
                              "steps": args.steps, "runs": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sharded-big-") as scratch, \
            open(os.path.join(args.out, "big.log"), "w") as log:
        pair = Pair(args, lab, scratch, log)
        # The global batch given: the plan made when the model is sharded then counts each rank's activations.
        lever = Lever.parse(args.big_lever)
        lever = replace(lever, global_batch=lever.global_batch or args.big_batch)
        for which in args.big_runs.split(","):
            if which.startswith("ours"):
                # Activations counted from the model's shape (as bench_fsdp_shared plans): `auto` chooses its blocks
                # when the model is sharded, before a trial step could measure them. "ours:plain": the optimizer's
                # own step on the host (as before the fused host step), "ours" / "ours:overlap" / "ours:fused".
                host_step = which.partition(":")[2] or "overlap"
                tag = f"big-ours-{host_step}"
                splits = os.path.join(args.out, tag)
                profiled = copy.deepcopy(base)
                profiled.setdefault("trainer", {}).setdefault("callbacks", []).append(
                    {"class_path": "benchmarks.step_split.StepSplit",
                     "init_args": {"out_dir": splits, "step": SPLIT_STEP}})
                # The host's cores shared by its ranks, one left to each rank's training thread.
                threads = max(1, (os.cpu_count() or 2) // len(lab) - 1)
                policy = {**big_policy(model), "host_step": host_step, "host_threads": threads}
                record = pair.ours(profiled, lever, None, tag, policy=policy)
                record["run"], record["host_step"], record["split"] = tag, host_step, read_splits(splits)
            else:
                config = write_config(base, os.path.join(scratch, "big-lightning.yaml"))
                record = pair.baseline(config, "fsdp:offload" if args.accelerator == "gpu" else "ddp")
            result["runs"].append(record)
            result["wall_s"] = time.perf_counter() - started
            with open(os.path.join(args.out, "sharded_big.json"), "w") as f:
                json.dump(result, f, indent=1)
            print(f"  {record['run']}: {_fmt(record['samples_per_s'])} samples/s plans {record['plans']} peaks "
                  f"{[_fmt(p / gib if p else None) for p in record['peak_bytes']]} GiB host "
                  f"{[_fmt(h / gib if h else None, 0) for h in record['host_rss_bytes']]} GiB "
                  f"{record['errors'] or ''}", flush=True)
            print("\n".join(format_split(record) or ["    (no step profiled)"]), flush=True)
    rates = {r["run"]: r["samples_per_s"] for r in result["runs"]}
    ours = next((v for k, v in rates.items() if not k.startswith("Lightning")), None)
    theirs = next((v for k, v in rates.items() if k.startswith("Lightning")), None)
    result["ours_over_lightning"] = ours / theirs if ours and theirs else None
    with open(os.path.join(args.out, "sharded_big.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_big(result, os.path.join(args.out, "sharded_big.png"))
    print(f"big {estimate['parameters'] / 1e9:.2f}B on {caps} GiB, global batch {args.big_batch}:")
    for record in result["runs"]:
        print(f"  {record['run']:<22} {_fmt(record['samples_per_s'], 3):>7} samples/s  step "
              f"{[_fmt(t) for t in record['step_seconds']]} s  plans {record['plans']}")
        print("\n".join(format_split(record) or ["    (no step profiled)"]))
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/rehearse_gpt.yaml", help="a LightningCLI config (model, data)")
    parser.add_argument("--lab", default="A100-80GB,RTX3090")
    parser.add_argument("--levers", default=DEFAULT_LEVERS,
                        help="comma-separated configurations of ours, the first the main one (see above)")
    parser.add_argument("--baseline", default="fsdp", choices=sorted(BASELINES) + ["none"])
    parser.add_argument("--rounds", type=int, default=1, help="every lever and the baseline this many times")
    parser.add_argument("--steps", type=int, default=8, help="steps a run (the first 2 untimed)")
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--random-init", action="store_true",
                        help="torch's own weight initialisation (default: benchmarks.lm's fill, for every run)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds one launch may take")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="start no launch that would end past this many seconds (0: no deadline)")
    parser.add_argument("--big", action="store_true", help="the largest-model check instead (see above)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="the big check's GPT (over --big-params and --big-width)")
    parser.add_argument("--big-params", type=float, default=8.0, help="billions of parameters")
    parser.add_argument("--big-width", type=int, default=4096)
    parser.add_argument("--big-seq", type=int, default=BIG_SEQ, help="tokens a sample (fewer for a CPU dry run)")
    parser.add_argument("--big-caps", default="52,22", help="GiB per rank")
    parser.add_argument("--big-lab", default=None, help="cards as --lab (default: memory caps only, full compute)")
    parser.add_argument("--big-batch", type=int, default=4, help="global batch of the big check")
    parser.add_argument("--big-lever", default="caps=3/1", help="our configuration in the big check")
    parser.add_argument("--big-runs", default="ours,lightning",
                        help="in order: ours (ours:overlap), ours:fused, ours:plain (the optimizer's own host step), "
                             "lightning")
    parser.add_argument("--host-ns", action="store_true",
                        help="instead: ns per parameter of a host AdamW step (loop, foreach, fused)")
    parser.add_argument("--host-params", type=float, default=256.0, help="millions of parameters for --host-ns")
    parser.add_argument("--host-threads", default="1,2", help="intra-op thread counts for --host-ns")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.host_ns:
        host_step_check(args)
        return
    if args.big:
        big_check(args)
        return
    result = pair_check(args)
    plot(result, os.path.join(args.out, "sharded_pair.png"))
    print(format_pair(result))


if __name__ == "__main__":
    main()
