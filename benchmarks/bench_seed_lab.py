"""The seed's headline table on one 4-GPU machine: two A100-80GB and two RTX 3090 emulated (``--lab``, emulator
presets passed to every strategy untouched, so the emulator's calibration applies), every layout of each workload
measured in the same command.

Workloads (``--workloads``): ``bert`` (BERT-base, 128 tokens, global batch 160), ``gpt124m`` (GPT-2 small shape,
1024 tokens, untied head, global batch 32), ``gpt1.6b`` (the 1.63B GPT of ``bench_hybrid.py``, 512 tokens, global 32).
The global batch is the same in every layout. Layouts, each its own process group (a hang costs only its own cap):

- ``pair``: ``HeteroDDPStrategy`` on the two A100s alone (world 2, equal halves);
- ``solo``: a plain training loop on one A100 alone (at the pair's per-rank batch) and, at the same time on other
  GPUs, one 3090 alone at each of ``--slow-batches`` (default a quarter and an eighth of the global batch);
- ``ddp4``: ``HeteroDDPStrategy(capacities="profile")`` on four;
- ``fsdp4``: ``HeteroFSDPStrategy(capacities="auto")`` on four: the published rates, memory caps profiled (a sharded
  step waits for every rank at each block, so the strategy refuses to time its ranks alone);
- ``hybrid4``: ``HeteroHybridStrategy(pipelines=[[2, 3]], capacities="profile")``, stage exchange overlapped;
- ``lightning_ddp4`` / ``lightning_fsdp4``: Lightning's own, equal batches, every step under the rank's emulation.

**Ideal** = pair's measured samples/s + 2 × the solo 3090's samples/s, the latter at the solo batch nearest to a
3090's batch in ``ddp4`` (its profiled split; else in ``fsdp4``; else a quarter of the global batch). Each layout
reports samples/s over ``--steps`` timed steps (``--warmup`` untimed), the step time, each rank's peak memory and each
rank's emulation check (a fixed matmul loop timed plain and emulated: measured against expected slowdown). A layout
that fails or does not fit is a row with its error line. A replica that cannot fit a card's memory (parameters,
gradients and AdamW's moments alone) is reported as not fitting without launching, unless ``--run-unfit``.

    python benchmarks/bench_seed_lab.py --workloads bert --deadline-s 300 --out $OUT/seed      # 4 GPUs
    python benchmarks/bench_seed_lab.py --workloads gpt124m,gpt1.6b --deadline-s 520 --out $OUT/seed
    python benchmarks/bench_seed_lab.py --accelerator cpu --tiny --out /tmp/seed                # every path, gloo

Writes ``seed_lab_<workloads>.json`` (one file per invocation) and ``.png`` to ``--out``, each layout's log to
``--out/logs``. Every workload's ``doctor`` entry and each layout's ``predicted_samples_per_s`` are left ``null``
for the doctor's predictions to be set beside the measurements.
"""

import argparse
import datetime
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_hybrid import XL, emulated_lightning, verify_emulation, workload  # noqa: E402
from bench_lab import Stopped, _commit, _timer_class, format_table, stop_on_sigterm  # noqa: E402
from models import BertConfig, Block, EncoderLayer, GPTConfig  # noqa: E402
from plotting import pyplot, save  # noqa: E402

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

CALIBRATION_ENV = "LIGHTNING_HETERO_CALIBRATION"
DEFAULT_LAB = "A100-80GB,A100-80GB,RTX3090,RTX3090"
# The order they run in: the baselines first (a cut by the deadline keeps them), Lightning's last.
LAYOUTS = ("pair", "solo", "ddp4", "hybrid4", "fsdp4", "lightning_ddp4", "lightning_fsdp4")
OURS_VS_LIGHTNING = {"ddp4": "lightning_ddp4", "fsdp4": "lightning_fsdp4"}
PREDICTED = ("pair", "ddp4", "fsdp4", "hybrid4")  # the layouts the doctor predicts


@dataclass(frozen=True)
class Workload:
    name: str
    cfg: Any  # BertConfig or GPTConfig
    global_batch: int
    weight: float  # its share of --deadline-s, relative to the other workloads'
    layout_s: float  # seconds at most per layout unless --layout-s


WORKLOADS = {
    "bert": Workload("bert", BertConfig(), 160, 1.0, 80.0),
    "gpt124m": Workload("gpt124m", GPTConfig.gpt2_small(seq=1024), 32, 1.0, 80.0),
    # Its data-parallel layouts do not fit a 3090 and are not launched: fewer, longer fits (a 1.63B replica's set-up).
    "gpt1.6b": Workload("gpt1.6b", XL, 32, 1.2, 150.0),
}
TINY = {
    "bert": Workload("bert", BertConfig.tiny(), 16, 1.0, 200.0),
    "gpt124m": Workload("gpt124m", GPTConfig.tiny(), 16, 1.0, 200.0),
    "gpt1.6b": Workload("gpt1.6b", GPTConfig(vocab=256, seq=32, width=96, layers=3, heads=4), 16, 1.0, 200.0),
}


def workloads(args: argparse.Namespace) -> list[Workload]:
    table = TINY if args.tiny else WORKLOADS
    return [table[name] for name in args.workloads]


def lab_list(args: argparse.Namespace) -> list[str]:
    return args.lab.split(",")


def emulate_lab(cards: list[str], work: Workload) -> list[Any]:
    """The emulator's profiles for ``cards``: each preset with the workload family it is calibrated on ("bert" or
    "gpt"), so that every card trains at its published speed on this model (the default, family-less calibration
    is off by up to 23 % on one family: docs/emulation.md)."""
    from lightning_hetero.lab.presets import PRESETS

    family = "bert" if isinstance(work.cfg, BertConfig) else "gpt"
    return [{"preset": card, "workload": family} if card in PRESETS else card for card in cards]


def calibration_identity() -> dict[str, Any]:
    """Which calibration file the emulator reads: ``$LIGHTNING_HETERO_CALIBRATION`` when set, else the files shipped in
    the package (the emulator picks one by host GPU); each with its sha256 and its ``host`` field."""
    import lightning_hetero

    override = os.environ.get(CALIBRATION_ENV)
    shipped = os.path.join(os.path.dirname(lightning_hetero.__file__), "lab", "calibrations")
    names = os.listdir(shipped) if os.path.isdir(shipped) else []
    paths = [override] if override else sorted(os.path.join(shipped, f) for f in names if f.endswith(".json"))
    files = []
    for path in paths:
        entry: dict[str, Any] = {"path": os.path.abspath(path)}
        try:
            data = open(path, "rb").read()
            entry["sha256"] = hashlib.sha256(data).hexdigest()[:16]
            entry["host"] = json.loads(data).get("host") if data.strip().startswith(b"{") else None
        except (OSError, ValueError) as err:
            entry["error"] = f"{type(err).__name__}: {err}"
        files.append(entry)
    return {"source": f"${CALIBRATION_ENV}" if override else "package", "files": files}


def replica_gib(cfg: Any) -> float:
    """A replica's parameters, gradients and AdamW's two moments (fp32), GiB: what data parallelism holds per card."""
    from models import Bert, GPT

    with torch.device("meta"):
        net = Bert(cfg) if isinstance(cfg, BertConfig) else GPT(cfg)
    head = 0 if isinstance(cfg, BertConfig) else cfg.width * cfg.vocab  # bench_hybrid's GPT has an untied head
    return 16 * (sum(p.numel() for p in net.parameters()) + head) / 2**30


def unfit_reason(layout: str, work: Workload, lab: list[str]) -> Optional[str]:
    """Why a data-parallel layout cannot hold its replica on some card of ``lab`` (None: it may fit)."""
    from lightning_hetero.lab.presets import PRESETS

    if layout not in ("ddp4", "lightning_ddp4"):
        return None
    need = replica_gib(work.cfg)
    small = [c for c in lab if PRESETS[c].memory_gib < need]
    if not small:
        return None
    return (f"does not fit (estimated, not launched): a replica's parameters, gradients and AdamW state take "
            f"{need:.1f} GiB, more than {small[0]}'s {PRESETS[small[0]].memory_gib:g} GiB")


# -- one layout's fit, in its own process group ------------------------------------------------------------------------
def strategy_for(layout: str, work: Workload, lab: list[str], args: argparse.Namespace) -> Any:
    """The strategy of ``layout`` (every rank calls it); ``lab``'s presets reach the emulator with the workload's
    family (:func:`emulate_lab`)."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    lab = emulate_lab(lab, work)

    from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy, HeteroHybridStrategy

    precision = "32-true" if args.accelerator == "cpu" else "bf16-mixed"
    common: dict[str, Any] = {"observation": {"print_table": False}, "resilience": {"timeout": 150},
                              "precision_policy": precision}
    profiling = {"steps": args.profile_steps}
    if layout == "pair":
        return HeteroDDPStrategy(capacities="equal", emulate=lab[:2], **common)
    if layout == "ddp4":
        return HeteroDDPStrategy(capacities="profile", profiling=profiling, emulate=lab, **common)
    if layout == "fsdp4":
        # A sharded step waits for every rank at each block, so its ranks cannot time themselves alone: "auto" is
        # the published rates with the memory caps profiled.
        return HeteroFSDPStrategy(capacities="auto", profiling=profiling, emulate=lab, **common)
    if layout == "hybrid4":
        return HeteroHybridStrategy(pipelines=[[2, 3]], capacities="profile", overlap_stage_exchange=True,
                                    profiling=profiling, emulate=lab, **common)
    if layout == "lightning_ddp4":
        return emulated_lightning(DDPStrategy, lab)
    if layout == "lightning_fsdp4":
        block = EncoderLayer if isinstance(work.cfg, BertConfig) else Block
        return emulated_lightning(FSDPStrategy, lab, {"auto_wrap_policy": {block}, "state_dict_type": "sharded"})
    raise ValueError(f"layout {layout!r}: one of {[x for x in LAYOUTS if x != 'solo']}")


def rank_emulator(strategy: Any) -> Any:
    """This rank's emulator: ours keep it as ``emulation``, Lightning's emulated strategies as ``emulator``."""
    return getattr(strategy, "emulation", None) or getattr(strategy, "emulator", None)


def emulation_check(emulator: Any, device: torch.device) -> dict[str, Any]:
    """:func:`bench_hybrid.verify_emulation` with what the rank emulates (card, SMs, memory, link)."""
    check = verify_emulation(emulator, device)
    check["emulated"] = emulator.device.summary() if emulator is not None else "whole device"
    return check


def run_layout(args: argparse.Namespace) -> None:
    """One layout's fit (every rank runs this; rank 0 writes the row)."""
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    layout, work, lab = args.run, next(iter(workloads(args))), lab_list(args)
    world = 2 if layout == "pair" else 4
    batch = work.global_batch // world
    seed_everything(0, verbose=False)
    module, dataset = workload(work.cfg, batch * world * (args.warmup + args.steps))
    timer = _timer_class()(args.warmup, args.steps)
    checks: dict[str, Any] = {}

    class Check(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            mine = emulation_check(rank_emulator(trainer.strategy), pl_module.device)
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, mine)
            checks["emulation"] = gathered

    lightning = layout.startswith("lightning")
    trainer = Trainer(accelerator=args.accelerator, devices=world, strategy=strategy_for(layout, work, lab, args),
                      max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[timer, Check()],
                      precision="bf16-mixed" if lightning and args.accelerator != "cpu" else None)
    trainer.fit(module, DataLoader(dataset, batch_size=batch))
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.accelerator != "cpu" else None
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, None if peak is None else round(peak, 2))
    if trainer.global_rank != 0:
        return
    elapsed = timer.t1 - timer.t0
    row: dict[str, Any] = {"samples_per_s": round(work.global_batch * args.steps / elapsed, 2),
                           "step_s": round(elapsed / args.steps, 4), "peak_gib": peaks, **checks}
    plan = getattr(trainer.strategy, "plan", None)
    row["split"] = list(plan.split) if plan is not None else [batch] * world
    if plan is not None:
        row["capacities"] = [round(c, 2) for c in plan.capacities]
    with open(args.row_file, "w") as f:
        json.dump(row, f)


def run_solo(args: argparse.Namespace) -> None:
    """Card ``--card`` of the lab alone (a world of one, no communication): a plain loop of forward, backward and
    AdamW step under its emulation, timed at each of ``--solo-batches``."""
    from contextlib import nullcontext

    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulated_device import alone
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    work = next(iter(workloads(args)))
    lab = parse_emulate(emulate_lab(lab_list(args), work))
    cuda = args.accelerator != "cpu"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:  # the cores shared as Lightning shares them among 4 ranks (oversubscribed threads spin for ages)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 4))
    spec = alone(lab[args.card], lab, device.type)
    emulator = start_emulation([spec], 0, 1, describe_device(device, 0), device)
    if emulator is not None:
        emulator.activate()
    batches = [int(b) for b in args.solo_batches.split(",")]
    torch.manual_seed(0)
    module, dataset = workload(work.cfg, max(batches))
    module.to(device)
    optimizer = module.configure_optimizers()
    batch_all = [t.to(device) for t in dataset.tensors]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    row: dict[str, Any] = {"card": lab_list(args)[args.card], "emulation": [emulation_check(emulator, device)],
                           "rates": {}}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for batch in batches:
        start = 0.0
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                sync()
                start = time.perf_counter()
            with emulator.work() if emulator is not None else nullcontext():
                with autocast:
                    loss = module.training_step([t[:batch] for t in batch_all], step)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        sync()
        row["rates"][str(batch)] = round(batch * args.steps / (time.perf_counter() - start), 2)
    row["peak_gib"] = [round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None]
    with open(args.row_file, "w") as f:
        json.dump(row, f)


# -- the driver --------------------------------------------------------------------------------------------------------
class Launch:
    """One child command in its own session (process group): ended with its whole group at its limit or on SIGTERM."""

    def __init__(self, command: list[str], log_path: str, devices: Optional[str]) -> None:
        env = dict(os.environ)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def wait(self, seconds: float) -> Any:
        try:
            return self.process.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            self.end()
            return "timeout"

    def end(self) -> None:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def visible(indices: list[int]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for ``indices`` of this process's visible GPUs."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = parent.split(",") if parent else [str(i) for i in range(max(indices) + 1)]
    return ",".join(ids[i] for i in indices)


def error_line(text: str, code: Any) -> str:
    """The line that says why a child failed: out of memory, else the last exception line, else its exit code."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any("out of memory" in line.lower() for line in lines):
        oom = next(line for line in lines if "out of memory" in line.lower())
        return f"does not fit (out of memory): {oom[:240]}"
    if code == "timeout":
        return "cut at its time limit (" + (lines[-1][:200] if lines else "no output") + ")"
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return f"failed ({code}): " + ((errors or lines or ["no output"])[-1][:240])


def child_command(args: argparse.Namespace, work: Workload, run: str, row_file: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--run", run, "--workloads", work.name, "--lab", args.lab,
            "--accelerator", args.accelerator, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--profile-steps", str(args.profile_steps), "--row-file", row_file, "--out", args.out] + (
        ["--tiny"] if args.tiny else [])


def finish_child(launch: Launch, code: Any, row_file: str, log_path: str, began: float) -> dict[str, Any]:
    if code != "timeout":
        launch.log.close()
    row: dict[str, Any] = {}
    if code == 0 and os.path.exists(row_file):
        row = json.load(open(row_file))
        os.remove(row_file)
    else:
        row = {"error": error_line(open(log_path, errors="replace").read(), code)}
    row["wall_s"] = round(time.perf_counter() - began, 1)
    row["log"] = os.path.relpath(log_path, os.path.dirname(os.path.dirname(log_path)))
    return row


def launches_of(args: argparse.Namespace, work: Workload, layouts: list[str]) -> list[tuple[str, list[str], list[int]]]:
    """(row name, extra arguments, GPU indices) of each child of ``layouts`` run at once: a layout on its ranks' GPUs;
    ``solo`` as one A100 alone and one 3090 alone, on the GPUs the pair leaves free when they run beside it."""
    lab = lab_list(args)
    children, free = [], 0
    for layout in layouts:
        if layout != "solo":
            world = 2 if layout == "pair" else 4
            children.append((layout, [], list(range(world))))
            free = world
            continue
        slow = args.slow_batches or ",".join(str(max(1, work.global_batch // d)) for d in (4, 8))
        for card, batches in ((0, str(work.global_batch // 2)), (2, slow)):
            children.append((f"solo_{lab[card]}", ["--card", str(card), "--solo-batches", batches], [free]))
            free += 1
    return children


def measure(args: argparse.Namespace, work: Workload, layouts: list[str], limit: float) -> dict[str, Any]:
    """The rows of ``layouts`` run at once (each child its own process group, ended at ``limit`` s or on SIGTERM)."""
    logs = os.path.join(args.out, "logs")
    began = time.perf_counter()
    started = []
    try:
        for name, extra, gpus in launches_of(args, work, layouts):
            row_file = os.path.join(logs, f".{work.name}_{name}.json")
            log_path = os.path.join(logs, f"{work.name}_{name}.log")
            command = child_command(args, work, "solo" if name.startswith("solo") else name, row_file) + extra
            cuda = visible(gpus) if args.accelerator != "cpu" else None
            started.append((name, Launch(command, log_path, cuda), row_file, log_path))
        rows = {}
        for name, launch, row_file, log_path in started:
            code = launch.wait(limit - (time.perf_counter() - began))
            rows[name] = finish_child(launch, code, row_file, log_path, began)
    except Stopped:
        for _, launch, _, _ in started:
            launch.end()
        raise
    if "solo" in layouts:
        cards = {name[len("solo_"):]: rows.pop(name) for name in list(rows) if name.startswith("solo_")}
        rows["solo"] = {"cards": cards, "wall_s": max(r["wall_s"] for r in cards.values()),
                        "beside": [x for x in layouts if x != "solo"]}
    return rows


def slow_solo_rate(rows: dict[str, Any], slow_card: str, fallback_batch: int) -> tuple[Optional[float], str]:
    """The solo 3090's samples/s at the solo batch nearest to its batch in ``ddp4`` (else ``fsdp4``), and how chosen."""
    solo = rows.get("solo", {}).get("cards", {}).get(slow_card, {})
    rates = {int(b): r for b, r in solo.get("rates", {}).items()}
    if not rates:
        return None, f"no solo rate of {slow_card}: " + solo.get("error", "solo not run")
    source, target = f"a quarter of the global batch ({fallback_batch})", fallback_batch
    for layout in ("ddp4", "fsdp4"):
        split = rows.get(layout, {}).get("split")
        if split and len(split) == 4:
            source, target = f"{slow_card}'s batch in {layout} ({split[2]})", split[2]
            break
    batch = min(rates, key=lambda b: (abs(b - target), -b))
    return rates[batch], f"{slow_card} alone at batch {batch}, nearest to {source}"


def ratios(work: Workload, rows: dict[str, Any], lab: list[str]) -> dict[str, Any]:
    """Each layout ÷ pair, ÷ ideal, ours ÷ Lightning (ddp4 ÷ Lightning's DDP, fsdp4 ÷ its FSDP, hybrid4 ÷ the
    faster of the two), and the measured fastest layout (the pair included)."""
    rate = {k: r.get("samples_per_s") for k, r in rows.items() if r.get("samples_per_s")}
    slow, how = slow_solo_rate(rows, lab[2], work.global_batch // 4)
    slow_count = sum(1 for card in lab if card == lab[2])
    ideal = rate["pair"] + slow_count * slow if "pair" in rate and slow else None
    out: dict[str, Any] = {
        "ideal": round(ideal, 2) if ideal else None,
        "ideal_means": f"pair's measured samples/s + {slow_count} x the solo rate of {how}",
        "per_layout": {}}
    for layout, value in rate.items():
        entry = {"vs_pair": round(value / rate["pair"], 3) if "pair" in rate else None,
                 "vs_ideal": round(value / ideal, 3) if ideal else None}
        base = rate.get(OURS_VS_LIGHTNING.get(layout, ""))
        if layout == "hybrid4" and ("lightning_ddp4" in rate or "lightning_fsdp4" in rate):
            base = max(rate.get("lightning_ddp4", 0.0), rate.get("lightning_fsdp4", 0.0))
        entry["ours_vs_lightning"] = round(value / base, 3) if base else None
        out["per_layout"][layout] = entry
    out["fastest"] = max(rate, key=rate.get) if rate else None
    return out


def steps_of(layouts: list[str]) -> list[list[str]]:
    """The layouts in the order they run, ``solo`` beside ``pair`` when both run (they use different GPUs)."""
    steps = [[x] for x in layouts if x != "solo" and not ("solo" in layouts and x == "pair")]
    if "solo" in layouts:
        steps.insert(0, ["pair", "solo"] if "pair" in layouts else ["solo"])
    return steps


def run_workload(args: argparse.Namespace, work: Workload, deadline: float, entry: dict[str, Any]) -> None:
    """Every layout of ``work`` into ``entry["layouts"]`` (kept as measured: a SIGTERM leaves the rows so far)."""
    lab, rows = lab_list(args), entry["layouts"]
    for step in steps_of(args.layouts):
        left = deadline - time.time()
        reason = None if args.run_unfit else unfit_reason(step[0], work, lab)
        if reason:
            measured = {step[0]: {"error": reason}}
        elif step == ["lightning_fsdp4"] and args.accelerator == "cpu":
            measured = {step[0]: {"error": "not run on CPU: Lightning's FSDPStrategy needs CUDA (its strategy is "
                                           "built in the CPU test)"}}
        elif left < args.min_layout_s:
            measured = {x: {"error": f"not run: {left:.0f} s left of --deadline-s for {work.name}"} for x in step}
        else:
            limit = min(args.layout_s or work.layout_s, left)
            measured = {x: {**row, "limit_s": round(limit)} for x, row in measure(args, work, step, limit).items()}
        for layout, row in measured.items():
            rows[layout] = {"layout": layout, **row, "predicted_samples_per_s": None}
            print(f"[seed_lab] {work.name}/{layout}: " + json.dumps(
                {k: v for k, v in row.items() if k in ("samples_per_s", "step_s", "peak_gib", "error", "wall_s",
                                                       "split", "cards")}), flush=True)


def new_entry(work: Workload) -> dict[str, Any]:
    return {"workload": work.name, "config": repr(work.cfg), "global_batch": work.global_batch, "layouts": {},
            # Set beside the measurements by `doctor --compare-layouts`: its pick and samples/s per layout.
            "doctor": {"pick": None, "predicted_samples_per_s": {k: None for k in PREDICTED}}}


# -- reporting ---------------------------------------------------------------------------------------------------------
def _emulation_cell(row: dict[str, Any]) -> str:
    checks = row.get("emulation") or []
    return " ".join(f"{c['measured_slowdown']}/{c['expected_slowdown']}" for c in checks) or "-"


def tables(result: dict[str, Any]) -> str:
    lines, ratio_lines, notes = [], [], []
    for work in result["workloads"]:
        for layout, row in work["layouts"].items():
            if layout == "solo":
                for card, solo in row.get("cards", {}).items():
                    rates = solo.get("rates")
                    lines.append([work["workload"], f"solo {card}", str(rates) if rates else "-", "-",
                                  str(solo.get("peak_gib", "-")), _emulation_cell(solo), solo.get("error", "")])
                if "cards" not in row:
                    lines.append([work["workload"], "solo", "-", "-", "-", "-", row.get("error", "")])
                continue
            rate = row.get("samples_per_s")
            lines.append([work["workload"], layout, f"{rate:.1f}" if rate else "-",
                          f"{1000 * row['step_s']:.1f}" if row.get("step_s") else "-", str(row.get("peak_gib", "-")),
                          _emulation_cell(row), row.get("error", "")[:110]])
        r = work["ratios"]
        for layout, entry in r["per_layout"].items():
            ratio_lines.append([work["workload"], layout] + [
                "-" if entry[k] is None else f"{entry[k]:.2f}" for k in ("vs_pair", "vs_ideal", "ours_vs_lightning")]
                + ["<- fastest" if layout == r["fastest"] else ""])
        ideal = f"{r['ideal']:.1f} samples/s" if r["ideal"] else "unknown"
        notes.append(f"{work['workload']}: ideal {ideal} = {r['ideal_means']}; measured fastest: {r['fastest']}")
    return (format_table(["workload", "layout", "samples/s", "step ms", "peak GiB per rank",
                          "emulation per rank (measured/expected slowdown)", "error"], lines) + "\n\n"
            + format_table(["workload", "layout", "/pair", "/ideal", "ours/Lightning", ""], ratio_lines) + "\n"
            + "\n".join(notes))


def plot(result: dict[str, Any], path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    works = result["workloads"]
    fig, axes = plt.subplots(1, len(works), figsize=(5 * len(works), 3.8), squeeze=False)
    for ax, work in zip(axes[0], works):
        names = [k for k in work["layouts"] if k != "solo"]
        values = [work["layouts"][k].get("samples_per_s") or 0.0 for k in names]
        ax.bar(names, values, color=["#2ca02c" if not k.startswith("lightning") else "#1f77b4" for k in names])
        if work["ratios"]["ideal"]:
            ax.axhline(work["ratios"]["ideal"], color="k", linestyle="--", label="ideal")
            ax.legend()
        ax.set_title(f"{work['workload']} (global batch {work['global_batch']})")
        ax.set_ylabel("samples/s (0: did not run or fit)")
        ax.tick_params(axis="x", rotation=35)
    return save(fig, path)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="bert", help=f"comma-separated, of {list(WORKLOADS)}")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    p.add_argument("--lab", default=DEFAULT_LAB, help="four emulator presets, passed to the strategies as given")
    p.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes and batches (CPU dry run)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per layout")
    p.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    p.add_argument("--profile-steps", type=int, default=2, help='timed steps per size of capacities="profile"')
    p.add_argument("--slow-batches", default="", help="the solo 3090's batches (default global/4,global/8)")
    p.add_argument("--layout-s", type=float, default=None,
                   help="seconds at most per layout (its process group); default 80, 150 for gpt1.6b, 200 with --tiny")
    p.add_argument("--deadline-s", type=float, default=300.0,
                   help="seconds for the whole command, shared by the workloads by weight; layouts not started in "
                        "time are reported as not run")
    p.add_argument("--min-layout-s", type=float, default=20.0, help="a layout starts only with this much time left")
    p.add_argument("--run-unfit", action="store_true", help="launch layouts whose replica is estimated not to fit")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one layout, in its own process group
    p.add_argument("--card", type=int, default=0, help=argparse.SUPPRESS)  # solo: the lab's index of the card
    p.add_argument("--solo-batches", default="", help=argparse.SUPPRESS)
    p.add_argument("--row-file", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.layouts = [x for x in args.layouts.split(",") if x]
    for flag, values, known in (("--workloads", args.workloads, WORKLOADS), ("--layouts", args.layouts, LAYOUTS)):
        bad = [v for v in values if v not in known]
        if bad or not values:
            p.error(f"{flag}: {bad or 'none given'}, each one of {list(known)}")
    from lightning_hetero.lab.presets import PRESETS

    lab = lab_list(args)
    if len(lab) != 4 or any(card not in PRESETS for card in lab):
        p.error(f"--lab {args.lab!r}: four presets, each one of {list(PRESETS)}")
    if args.warmup < 1 or args.steps < 1 or args.profile_steps < 1:
        p.error("--warmup, --steps and --profile-steps must be >= 1")
    if args.deadline_s <= 0 or (args.layout_s is not None and args.layout_s <= 0):
        p.error("--deadline-s and --layout-s must be > 0")
    if args.slow_batches and not all(b.isdigit() and int(b) > 0 for b in args.slow_batches.split(",")):
        p.error(f"--slow-batches {args.slow_batches!r}: comma-separated positive integers")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.run == "solo":
        run_solo(args)
        return {}
    if args.run is not None:
        run_layout(args)
        return {}
    started = time.time()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    if args.accelerator == "gpu" and torch.cuda.device_count() < 4:
        raise SystemExit(f"the seed's lab needs 4 CUDA devices; found {torch.cuda.device_count()}")
    result: dict[str, Any] = {
        "benchmark": "bench_seed_lab", "lab": lab_list(args), "emulated": True, "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu",
        "device_count": torch.cuda.device_count() if args.accelerator == "gpu" else 0, "torch": torch.__version__,
        "calibration": calibration_identity(), "warmup": args.warmup, "steps": args.steps,
        "profile_steps": args.profile_steps, "layout_s": args.layout_s, "deadline_s": args.deadline_s,
        "tiny": args.tiny, "workloads": []}
    print(f"[seed_lab] lab {result['lab']} on {result['device']}, calibration {json.dumps(result['calibration'])}",
          flush=True)
    stop_on_sigterm()
    chosen = workloads(args)
    total = sum(w.weight for w in chosen)
    done = 0.0
    try:
        for work in chosen:
            done += work.weight
            result["workloads"].append(new_entry(work))
            run_workload(args, work, started + args.deadline_s * done / total, result["workloads"][-1])
    except Stopped:
        print("[seed_lab] stopped by SIGTERM: reporting what was measured", flush=True)
    for work, entry in zip(chosen, result["workloads"]):
        entry["ratios"] = ratios(work, entry["layouts"], lab_list(args))
    result["wall_s"] = round(time.time() - started, 1)
    stem = os.path.join(args.out, "seed_lab_" + "_".join(args.workloads).replace(".", ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    png = plot(result, stem + ".png")
    print(f"[seed_lab] wrote {stem}.json" + (f" and {png}" if png else " (no matplotlib: no plot)")
          + f" in {result['wall_s']:.0f} s; commit {result['commit']}; emulated lab {','.join(result['lab'])}")
    print(tables(result), flush=True)
    return result


if __name__ == "__main__":
    main()
