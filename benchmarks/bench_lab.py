"""Throughput of an emulated mixed lab: solo devices (ideal = their sum), Lightning DDP, HeteroDDPStrategy.

One command runs every scenario and model, prints a table last, and writes ``bench_lab.json`` and ``bench_lab.png``
to ``--out`` (default ``$OUT`` or ./out)::

    python benchmarks/bench_lab.py                          # mix2 + same2, ResNet-50 and GPT-124M, 2 GPUs
    python benchmarks/bench_lab.py --scenarios mix4         # 4 GPUs
    python benchmarks/bench_lab.py --quick                  # fewer steps
    python benchmarks/bench_lab.py --tiny --accelerator cpu # smoke run on CPU (gloo, sleep-based slowdown)

Per scenario one process per device is spawned once (NCCL's link settings must precede the process group); in it
every configuration runs one after the other on the same process group:

- ``solo``: a plain training loop on each emulated device alone (all devices at once; no communication). Ideal
  throughput of the lab = the sum of the solo rates.
- ``ddp``: Lightning's ``DDPStrategy``: equal batches, the job runs at the pace of the slowest device.
- ``hetero-explicit``: ``HeteroDDPStrategy`` with the measured solo rates as capacities.
- ``hetero-peak``: capacities from the published-rate table (emulated cards report their emulated name / SMs).
- ``hetero-profile``: capacities measured on the model by the strategy before training (its time is ``setup s``).

Every configuration trains ``--warmup`` steps, then times ``--steps`` steps between ``torch.cuda.synchronize``
calls; samples/s = global batch × steps / seconds. Inputs are synthetic and made on the device inside the step
(the loader yields indices only), so the numbers are compute and communication, not data loading.
"""

import argparse
import json
import signal
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Optional

# The device machine needs these before any NCCL communicator exists (NVLink SHARP / multicast are not available).
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import GPT, GPTConfig, resnet50, tiny_resnet  # noqa: E402
from plotting import pyplot, save  # noqa: E402

SCENARIOS: dict[str, dict[str, Any]] = {
    # one GPU at a quarter of the SMs with 24 GiB, on a PCIe-class link
    "mix2": {"shares": [1.0, 0.25], "memory_gib": [None, 24], "link": "pcie"},
    "mix4": {"shares": [1.0, 1.0, 0.5, 0.25], "memory_gib": [None, None, 48, 24], "link": "pcie"},
    # two identical GPUs on NVLink: the strategy's overhead over DDP
    "same2": {"shares": [1.0, 1.0], "memory_gib": [None, None], "link": "nvlink"},
    # the same over a PCIe-class link (NCCL_P2P_DISABLE=1 on every rank)
    "same2-pcie": {"shares": [1.0, 1.0], "memory_gib": [None, None], "link": "pcie"},
    # one whole GPU (world size 1): the host-side cost of a configuration with nobody to wait for
    "one": {"shares": [1.0], "memory_gib": [None], "link": "nvlink"},
}
CONFIGS = ("solo", "ddp", "hetero-explicit", "hetero-peak", "hetero-profile")
# Not run by default: capacities="equal" (the strategy's overhead at DDP's split), profiled shares with bf16
# gradient compression (for communication-bound scenarios), and hetero-explicit with HeteroMonitor on, logging through
# a CSVLogger (the monitor's overhead: benchmarks/monitor_overhead.py alternates it with hetero-explicit).
# Levers on the slow link, each an A/B against hetero-explicit (the same split): bf16 gradients on the wire
# (`compression="bf16"`), what `compression="auto"` picks, DDP buckets of 100 MB (`ddp_kwargs`, default 25), gradients
# that are views of DDP's buckets (`ddp_kwargs={"gradient_as_bucket_view": True}`: no copy into the buckets, which on
# an emulated slow card runs on its capped SMs).
LEVERS: dict[str, dict[str, Any]] = {
    "hetero-explicit-bf16": {"compression": "bf16"},
    "hetero-explicit-auto": {"compression": "auto"},
    "hetero-explicit-bucket100": {"ddp_kwargs": {"bucket_cap_mb": 100}},
    "hetero-explicit-view": {"ddp_kwargs": {"gradient_as_bucket_view": True}},
}
EXTRA_CONFIGS = ("hetero-equal", "hetero-profile-bf16", "hetero-monitor", *LEVERS)
# Configurations whose capacities are the solo rates measured in the first round.
_EXPLICIT = ("hetero-explicit", "hetero-monitor", *LEVERS)
MONITOR_EVERY = 10  # optimizer steps between the monitor's exchanges in "hetero-monitor"
_TIMEOUT_S = 180  # a collective stuck this long fails the scenario instead of eating the device time


def emulate_specs(scenario: str, accelerator: str) -> Optional[list[Optional[dict[str, Any]]]]:
    """The ``emulate`` argument of a scenario: SM shares on GPUs, the equivalent slowdown on CPU."""
    cfg = SCENARIOS[scenario]
    specs: list[Optional[dict[str, Any]]] = []
    for share, memory in zip(cfg["shares"], cfg["memory_gib"]):
        if share >= 1.0 and memory is None:
            specs.append(None)
        elif accelerator == "cpu":
            specs.append({"slowdown": 1.0 / share, "name": f"CPU at {share:.0%}"})
        else:
            spec: dict[str, Any] = {"link": cfg["link"], "sm_share": share} if share < 1.0 else {"link": cfg["link"]}
            if memory is not None:
                spec["memory_gib"] = memory
            specs.append(spec)
    if all(s is None for s in specs) and (cfg["link"] == "nvlink" or accelerator == "cpu"):
        return None
    if accelerator != "cpu" and specs[0] is None and cfg["link"] != "nvlink":
        specs[0] = {"link": cfg["link"]}
    return specs


# -- workloads --------------------------------------------------------------------------------------------------------
class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _lightning_module_class() -> type:
    from lightning.pytorch import LightningModule

    class Workload(LightningModule):
        """Synthetic-input training of ``kind`` ("resnet50" / "gpt", tiny variants for CPU)."""

        def __init__(self, kind: str, tiny: bool, seq: int) -> None:
            super().__init__()
            self.kind, self.tiny, self.seq = kind, tiny, seq
            if kind == "resnet50":
                self.net = tiny_resnet() if tiny else resnet50()
                self.classes, self.pixels = (10, 32) if tiny else (1000, 224)
            else:
                cfg = GPTConfig.tiny() if tiny else GPTConfig.gpt2_small(seq)
                self.net, self.classes = GPT(cfg), cfg.vocab
            self._inputs: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # not buffers: DDP would broadcast them
            # The CUDA streams the steps ran on: the emulated card's capped stream, or not (the emulation check).
            self.streams: set[int] = set()

        def prepare(self, cuda: bool) -> None:
            if self.kind == "resnet50" and cuda:
                self.net.to(memory_format=torch.channels_last)

        def inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            if self._inputs is None or self._inputs[0].shape[0] < n or self._inputs[0].device != self.device:
                g = torch.Generator(device=self.device).manual_seed(0)
                if self.kind == "resnet50":
                    x = torch.randn(n, 3, self.pixels, self.pixels, device=self.device, generator=g)
                    if self.device.type == "cuda":
                        x = x.contiguous(memory_format=torch.channels_last)
                    y = torch.randint(0, self.classes, (n,), device=self.device, generator=g)
                else:
                    seq = self.net.cfg.seq
                    x = torch.randint(0, self.classes, (n, seq + 1), device=self.device, generator=g)
                    y = x
                self._inputs = (x, y)
            x, y = self._inputs
            return x[:n], y[:n]

        def loss(self, batch: torch.Tensor) -> torch.Tensor:
            if self.device.type == "cuda":
                self.streams.add(torch.cuda.current_stream(self.device).cuda_stream)
            x, y = self.inputs(len(batch))
            if self.kind == "resnet50":
                return F.cross_entropy(self.net(x), y)
            logits = self.net(x[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y[:, 1:].reshape(-1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.loss(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.kind == "resnet50":
                return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Workload


# -- one process per device -------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capped(module: Any, emulator: Any, slept_before: float = 0.0) -> Optional[bool]:
    """Whether this rank's steps ran under its emulation: on GPUs every step on the capped (green-context) stream,
    on CPU a slowdown slept. ``None``: nothing to cap on this rank (a whole card, or link settings only)."""
    if emulator is None:
        return None
    if emulator.stream is not None:
        return module.streams == {emulator.stream.cuda_stream}
    if emulator.device.slowdown > 1.0:
        return emulator.slept_seconds > slept_before
    return None


def solo_rate(module: Any, batch: int, steps: int, warmup: int, device: torch.device, emulator: Any,
              precision: str) -> float:
    """Samples/s of a plain loop on this device alone (under its emulation)."""
    from contextlib import nullcontext

    module.to(device)
    module.prepare(device.type == "cuda")
    optimizer = module.configure_optimizers()
    indices = torch.arange(batch)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        with emulator.work() if emulator is not None else nullcontext():
            with autocast:
                loss = module.loss(indices)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    _sync(device)
    return batch * steps / (time.perf_counter() - start)


def _timer_class() -> type:
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        """Wall time of the timed steps (synchronized), and of fit start → first step (start-up profiling)."""

        def __init__(self, warmup: int, steps: int) -> None:
            self.warmup, self.steps = warmup, steps
            self.fit_start = self.first_step = self.t0 = self.t1 = 0.0

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.fit_start = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.first_step = time.perf_counter()
            if batch_idx == self.warmup:
                _sync(pl_module.device)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == self.warmup + self.steps - 1:
                _sync(pl_module.device)
                self.t1 = time.perf_counter()

    return StepTimer


def emulated_steps(base: type) -> type:
    """Lightning's strategy ``base`` with every training and optimizer step under ``self.emulator`` (set by the
    caller, or ``None``): Lightning's baselines on the same emulated lab as ours."""

    class EmulatedSteps(base):  # type: ignore[misc, valid-type]
        emulator: Any = None

        def _work(self) -> Any:
            from contextlib import nullcontext

            return self.emulator.work() if self.emulator is not None else nullcontext()

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            with self._work():
                return super().training_step(*args, **kwargs)

        def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
            with self._work():  # the closure runs forward and backward
                return super().optimizer_step(*args, **kwargs)

    EmulatedSteps.__name__ = f"Emulated{base.__name__}"
    return EmulatedSteps


def _emulated_ddp_class() -> type:
    """Lightning's DDPStrategy with each step under the bench process's emulation (the baseline on the same lab)."""
    from lightning.pytorch.strategies import DDPStrategy

    return emulated_steps(DDPStrategy)


def run_fit(config: str, module: Any, args: argparse.Namespace, world: int, specs: Any, emulator: Any,
            solos: list[float]) -> dict[str, Any]:
    from lightning.pytorch import Trainer

    from lightning_hetero import HeteroDDPStrategy

    slept_before = emulator.slept_seconds if emulator is not None else 0.0
    if config == "ddp":
        strategy = _emulated_ddp_class()(timeout=timedelta(seconds=_TIMEOUT_S))
        strategy.emulator = emulator
    else:
        capacities: Any = solos if config in _EXPLICIT else {
            "hetero-peak": "peak", "hetero-profile": "profile", "hetero-equal": "equal",
            "hetero-profile-bf16": "profile"}[config]
        lever = LEVERS.get(config, {"compression": "bf16" if config.endswith("-bf16") else "none"})
        strategy = HeteroDDPStrategy(capacities=capacities, emulate=specs,
                                     observation={"print_table": False}, resilience={"timeout": _TIMEOUT_S},
                                     compression=lever.get("compression", "none"),
                                     ddp_kwargs=lever.get("ddp_kwargs"))
    timer = _timer_class()(args.warmup, args.steps)
    callbacks: list[Any] = [timer]
    logger: Any = False
    if args.csv_logger or config == "hetero-monitor":
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(os.path.join(args.out, "logs"), name=f"{module.kind}-{config}")
    if config == "hetero-monitor":
        from lightning_hetero import HeteroMonitor

        callbacks.append(HeteroMonitor(every_n_steps=MONITOR_EVERY, summary=False, warn=False))
    batch = args.batch[module.kind]
    trainer = Trainer(accelerator=args.accelerator, devices=world, strategy=strategy, precision=args.precision,
                      max_steps=args.warmup + args.steps, logger=logger, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=callbacks)
    module.prepare(args.accelerator == "gpu")
    n = batch * world * (args.warmup + args.steps + 1)
    trainer.fit(module, train_dataloaders=DataLoader(Indices(n), batch_size=batch, shuffle=False))
    row: dict[str, Any] = {
        "samples_per_s": batch * world * args.steps / (timer.t1 - timer.t0),
        "step_s": (timer.t1 - timer.t0) / args.steps,
        "setup_s": timer.first_step - timer.fit_start,
    }
    if config != "ddp":
        lab, plan = strategy.lab, strategy.plan
        columns = dict(lab.columns)
        row.update(capacity_source=plan.source, capacities=[round(c, 4) for c in plan.capacities],
                   split=list(plan.split), devices=[d.name for d in lab.devices],
                   emulated=columns.get("emulated"), compression=columns.get("compression"),
                   capped_local=capped(module, strategy.emulation))
    else:
        row.update(split=[batch] * world, capped_local=capped(module, emulator, slept_before))
    return row


def worker(local_rank: int, scenario: str, args: argparse.Namespace, port: int, out_file: str) -> None:
    from lightning.pytorch import seed_everything

    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    world = len(SCENARIOS[scenario]["shares"])
    device = rank_device(local_rank, world, port, args.accelerator)
    cuda = device.type == "cuda"
    specs = emulate_specs(scenario, args.accelerator)
    emulator = None
    if specs is not None:  # this process's own emulation, for the solo loop and the DDP baseline
        parsed = parse_emulate(specs)
        emulator = start_emulation(parsed, local_rank, world, describe_device(device, local_rank), device)
        if emulator is not None:
            emulator.activate()
    dist.init_process_group("nccl" if cuda else "gloo", rank=local_rank, world_size=world,
                            timeout=timedelta(seconds=_TIMEOUT_S), device_id=device if cuda else None)
    Workload = _lightning_module_class()
    rows: list[dict[str, Any]] = []
    first_solos: dict[str, list[float]] = {}  # the capacities of hetero-explicit & co: round 1's solo rates
    round_s = 0.0
    for round_index in range(args.rounds):
        round_began = time.time()
        if past_deadline(round_index, round_began, round_s, args.deadline_at, device):
            if local_rank == 0:
                print(f"[bench_lab] {scenario}: another round would end past --deadline-s {args.deadline_s:g}: "
                      f"{round_index} round(s)", flush=True)
            break
        for kind in args.models:
            # Solo first (the ideal of this round); the others in reverse order every other round (drift cancels).
            others = [c for c in args.configs if c != "solo"]
            order = (["solo"] if "solo" in args.configs else []) + (others[::-1] if round_index % 2 else others)
            solos: list[float] = []
            for config in order:
                seed_everything(0, workers=False, verbose=False)
                module = Workload(kind, args.tiny, args.seq)
                began = time.perf_counter()
                try:
                    if config == "solo":
                        slept = emulator.slept_seconds if emulator is not None else 0.0
                        rate = solo_rate(module, args.batch[kind], args.steps, args.warmup, device, emulator,
                                         args.precision)
                        gathered: list[Any] = [None] * world
                        dist.all_gather_object(gathered, rate)
                        solos = [float(r) for r in gathered]
                        first_solos.setdefault(kind, solos)
                        row: dict[str, Any] = {"samples_per_s": sum(solos), "solo_per_rank": solos,
                                               "capped_local": capped(module, emulator, slept)}
                    elif config in _EXPLICIT and kind not in first_solos:
                        row = {"error": "needs the solo rates"}
                    else:
                        row = run_fit(config, module, args, world, specs, emulator, first_solos.get(kind, []))
                except Exception as err:  # an error on every rank (e.g. out of memory): report it, go on
                    row = {"error": f"{type(err).__name__}: {err}"[:300]}
                    print(f"[bench_lab] rank {local_rank} {scenario}/{kind}/{config}: {row['error']}", flush=True)
                # Every rank's emulation check, and what its emulation is (SMs granted against wanted, clamps).
                checks: list[Any] = [None] * world
                dist.all_gather_object(checks, [row.pop("capped_local", None),
                                                emulator.device.summary() if emulator is not None else "whole"])
                row["capped"] = [c[0] for c in checks]
                if config == "solo":
                    row["emulation"] = [c[1] for c in checks]
                row.update(scenario=scenario, model=kind, config=config, round=round_index,
                           config_s=time.perf_counter() - began)
                del module
                keep_row(rows, row, out_file, local_rank == 0, cuda,
                         f"[bench_lab] {scenario} round {round_index + 1} {kind}/{config}: "
                         f"{row.get('samples_per_s', row.get('error'))} ({row['config_s']:.0f} s)")
        round_s = time.time() - round_began
    dist.destroy_process_group()


def keep_row(rows: list[dict[str, Any]], row: dict[str, Any], out_file: str, writer: bool, cuda: bool,
             line: str) -> None:
    """End of one configuration on every rank: its row kept, the device's cache freed, the ranks met, and (the
    writer) ``line`` printed and every row so far written, so a later crash keeps what was measured."""
    rows.append(row)
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    if writer:
        print(line, flush=True)
        with open(out_file, "w") as f:
            json.dump(rows, f)


# -- driver -----------------------------------------------------------------------------------------------------------
def _commit() -> str:
    """The checkout's commit (and "+dirty" with uncommitted changes), or "unknown" outside git. ``BENCH_COMMIT``
    names it where the checkout's git metadata is not the code's (a copied working tree beside a stale ``.git``)."""
    import subprocess

    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


class Stopped(Exception):
    """SIGTERM (``timeout``) reached the driver: the configurations measured so far are still reported."""


def run_ranks(worker: Any, args: tuple, nprocs: int) -> None:
    """``worker(rank, *args)`` in ``nprocs`` spawned processes, joined; on :class:`Stopped` the ranks are ended
    (none is left holding a GPU for the next command) before it propagates."""
    context = mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn", join=False)
    try:
        while not context.join():
            pass
    except Stopped:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        raise


def collect_ranks(worker: Any, args: tuple, nprocs: int, part: str, name: str) -> tuple[list[dict[str, Any]], bool]:
    """:func:`run_ranks`, then the rows they wrote to ``part`` (removed), also after a failure or a SIGTERM (the
    configurations that finished are kept); and whether a SIGTERM stopped them."""
    stopped = False
    try:
        run_ranks(worker, args, nprocs)
    except Stopped:
        stopped = True
        print(f"[{name}] stopped by SIGTERM; reporting what was measured", flush=True)
    except Exception as err:  # keep the configurations that finished before the failure
        print(f"[{name}] failed: {str(err)[-2000:]}", flush=True)
    rows: list[dict[str, Any]] = []
    if os.path.exists(part):
        with open(part) as f:
            rows = json.load(f)
        os.remove(part)
    return rows, stopped


def rank_device(local_rank: int, world: int, port: int, accelerator: str, threads: Optional[int] = None
                ) -> torch.device:
    """A spawned rank's environment for one process group on this host, and its device (CUDA: cuDNN autotuned;
    CPU: ``threads`` intra-op threads, by default the cores shared out)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), NODE_RANK="0")
    if accelerator != "cpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        return device
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    return torch.device("cpu")


def past_deadline(round_index: int, began: float, round_s: float, deadline_at: float, device: torch.device) -> bool:
    """Whether another round, as long as the last, would end past ``deadline_at``: agreed by every rank (a cut keeps
    the complete rounds; the first round always runs)."""
    late = torch.tensor([float(round_index > 0 and began + round_s > deadline_at)], device=device)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return late.item() > 0


def stop_on_sigterm() -> None:
    """``timeout`` signals the whole process group: the ranks end, the driver writes what they measured."""

    def stop(signum: int, frame: Any) -> None:
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(rows: list[dict[str, Any]]) -> None:
    """Each row's ratio to the ideal (Σ solo) and to Lightning's DDP of the same round."""
    for row in rows:
        same = [r for r in rows if r["scenario"] == row["scenario"] and r["model"] == row["model"]
                and r.get("round", 0) == row.get("round", 0)]
        ideal = next((r.get("samples_per_s") for r in same if r["config"] == "solo"), None)
        ddp = next((r.get("samples_per_s") for r in same if r["config"] == "ddp"), None)
        value = row.get("samples_per_s")
        row["ratio_to_ideal"] = value / ideal if ideal and value else None
        row["ratio_to_ddp"] = value / ddp if ddp and value and row["config"] != "solo" else None


def _spread(values: list[float]) -> Optional[dict[str, float]]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per scenario, model and configuration over its rounds: medians with min and max, the emulation
    check of every rank in every round, and (solo) each rank's speed against its share of the SMs."""
    lines = []
    for key in dict.fromkeys((r["scenario"], r["model"], r["config"]) for r in rows):
        mine = [r for r in rows if (r["scenario"], r["model"], r["config"]) == key]
        ok = [r for r in mine if "error" not in r]
        line: dict[str, Any] = {"scenario": key[0], "model": key[1], "config": key[2], "rounds": len(ok)}
        for name in ("samples_per_s", "ratio_to_ideal", "ratio_to_ddp", "step_s", "setup_s"):
            line[name] = _spread([r[name] for r in ok if r.get(name) is not None])
        unemulated = sorted({rank for r in mine for rank, c in enumerate(r.get("capped") or []) if c is False})
        line["unemulated_ranks"] = unemulated
        line["error"] = next((r["error"] for r in mine if "error" in r), None)
        line["split"] = ok[-1].get("split") if ok else None
        line["compression"] = next((r["compression"][0] for r in ok if r.get("compression")), None)
        if key[2] == "solo" and ok:
            ranks = range(len(ok[0]["solo_per_rank"]))
            per_rank = [statistics.median(r["solo_per_rank"][i] for r in ok) for i in ranks]
            shares = SCENARIOS[key[0]]["shares"]
            fastest = max(range(len(shares)), key=lambda i: shares[i])
            line["solo_per_rank"] = per_rank
            # Each rank's speed relative to the fastest, over its share relative to the fastest's: 1.0 = as set.
            line["speed_vs_share"] = [(v / per_rank[fastest]) / (sh / shares[fastest])
                                      for v, sh in zip(per_rank, shares)]
            line["emulation"] = ok[0].get("emulation")
        lines.append(line)
    return lines


def format_detail(detail: Any) -> str:
    """A table cell for a per-rank list (split, solo rates) or a message."""
    if isinstance(detail, list):
        return "[" + ", ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in detail) + "]"
    return str(detail)


def format_table(headers: list[str], lines: list[list[str]]) -> str:
    """Left-aligned columns under a header and a rule."""
    widths = [max([len(h), *(len(l[i]) for l in lines)]) for i, h in enumerate(headers)]  # no lines: the header
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [fmt.format(*l) for l in lines])


def _cell(spread: Optional[dict[str, float]], fmt: str, scale: float = 1.0) -> str:
    """median (min–max) of a spread, or '-'."""
    if spread is None:
        return "-"
    median, low, high = (scale * spread[k] for k in ("median", "min", "max"))
    return f"{median:{fmt}}" + (f" ({low:{fmt}}-{high:{fmt}})" if high > low else "")


def table(lines: list[dict[str, Any]]) -> str:
    headers = ["scenario", "model", "config", "n", "samples/s", "/ideal", "/ddp", "step ms", "setup s", "emulated",
               "split / solo (speed vs share)"]
    out = []
    for line in lines:
        if line["error"] and not line["rounds"]:
            detail = line["error"]
        elif line["config"] == "solo":
            detail = (format_detail(line.get("solo_per_rank")) + " ("
                      + ", ".join(f"{v:.2f}" for v in line.get("speed_vs_share") or []) + ")")
        else:
            detail = format_detail(line.get("split")) + (f" {line['compression']}" if line.get("compression") else "")
        out.append([
            line["scenario"], line["model"], line["config"], str(line["rounds"]),
            _cell(line["samples_per_s"], ".1f"), _cell(line["ratio_to_ideal"], ".2f"),
            _cell(line["ratio_to_ddp"], ".3f"), _cell(line["step_s"], ".1f", 1000.0), _cell(line["setup_s"], ".1f"),
            "NOT rank " + ",".join(map(str, line["unemulated_ranks"])) if line["unemulated_ranks"] else "ok",
            detail,
        ])
    return format_table(headers, out)


def plot(lines: list[dict[str, Any]], path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    groups = list(dict.fromkeys((line["scenario"], line["model"]) for line in lines))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False)
    for ax, (scenario, model) in zip(axes[0], groups):
        same = [line for line in lines if (line["scenario"], line["model"]) == (scenario, model)]
        names = [line["config"] for line in same]
        spreads = [line["samples_per_s"] or {"median": 0.0, "min": 0.0, "max": 0.0} for line in same]
        medians = [sp["median"] for sp in spreads]
        errors = [[m - sp["min"] for m, sp in zip(medians, spreads)],
                  [sp["max"] - m for m, sp in zip(medians, spreads)]]
        ax.bar(names, medians, yerr=errors, capsize=3,
               color=["#999999" if n == "solo" else "#1f77b4" if n == "ddp" else "#2ca02c" for n in names])
        ax.set_title(f"{scenario} / {model} (median, min-max)")
        ax.set_ylabel("samples/s (solo = ideal sum)")
        ax.tick_params(axis="x", rotation=35)
    return save(fig, path)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default="mix2,same2", help=f"comma-separated, of {list(SCENARIOS)}")
    p.add_argument("--models", default="resnet50,gpt", help="comma-separated, of resnet50, gpt")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS + EXTRA_CONFIGS)}")
    p.add_argument("--accelerator", default="gpu", choices=["gpu", "cuda", "cpu"])
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration (default 6, quick 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 15, quick 8)")
    p.add_argument("--quick", action="store_true", help="3 warm-up + 8 timed steps")
    p.add_argument("--tiny", action="store_true", help="tiny models and batches (CPU smoke run)")
    p.add_argument("--resnet-batch", type=int, default=None, help="per-device batch (DDP meaning); default 128")
    p.add_argument("--gpt-batch", type=int, default=None, help="per-device batch of sequences; default 8")
    p.add_argument("--seq", type=int, default=1024, help="GPT sequence length (512-1024)")
    p.add_argument("--csv-logger", action="store_true",
                   help="every configuration logs to a CSVLogger under --out (hetero-monitor always does)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of every configuration (solo first, the others reversed every other round); the "
                        "table shows medians with min-max, ratios taken within each round")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds for the whole command, shared equally by the scenarios: a new round starts only if "
                        "it would end (as long as the last one) within its scenario's share; a scenario's first round "
                        "always runs")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c]
    for name, values, known in (("--scenarios", args.scenarios, SCENARIOS), ("--models", args.models,
                                ("resnet50", "gpt")), ("--configs", args.configs, CONFIGS + EXTRA_CONFIGS)):
        bad = [v for v in values if v not in known]
        if bad or not values:
            p.error(f"{name}: {bad or 'empty'} not in {list(known)}")
    if "solo" not in args.configs and set(_EXPLICIT) & set(args.configs):
        args.configs.insert(0, "solo")  # explicit capacities are the solo rates
    args.accelerator = "cpu" if args.accelerator == "cpu" else "gpu"
    if args.accelerator == "cpu" and "hetero-peak" in args.configs:
        args.configs.remove("hetero-peak")  # CPUs have no published rate
        print("[bench_lab] cpu: hetero-peak skipped (no published rate for CPUs)")
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 3 if args.quick else 6)
    args.steps = args.steps if args.steps is not None else (3 if args.tiny else 8 if args.quick else 15)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    if args.deadline_s is not None and args.deadline_s <= 0:
        p.error("--deadline-s must be > 0")
    args.started_at = time.time()
    args.deadline_at = float("inf")  # the current scenario's (set by main)
    args.batch = {"resnet50": args.resnet_batch or (4 if args.tiny else 128),
                  "gpt": args.gpt_batch or (4 if args.tiny else 8)}
    args.precision = "bf16-mixed" if args.accelerator == "gpu" else "32-true"
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.accelerator == "gpu":
        need = max(len(SCENARIOS[s]["shares"]) for s in args.scenarios)
        if torch.cuda.device_count() < need:
            raise SystemExit(f"{args.scenarios} need {need} CUDA devices; found {torch.cuda.device_count()}.")
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    stop_on_sigterm()
    for index, scenario in enumerate(args.scenarios):
        if args.deadline_s is not None:
            args.deadline_at = args.started_at + args.deadline_s * (index + 1) / len(args.scenarios)
        t = time.perf_counter()
        part = os.path.join(args.out, f".bench_{scenario}.json")
        world = len(SCENARIOS[scenario]["shares"])
        measured, stopped = collect_ranks(worker, (scenario, args, _free_port(), part), world, part,
                                          f"bench_lab {scenario}")
        rows += measured
        print(f"[bench_lab] {scenario}: {time.perf_counter() - t:.0f} s", flush=True)
        if stopped:
            break
    finish(rows)
    lines = summarize(rows)
    result = {
        "scenarios": {s: {**SCENARIOS[s], "emulate": emulate_specs(s, args.accelerator)} for s in args.scenarios},
        "warmup": args.warmup, "steps": args.steps, "batch_per_device": args.batch, "seq": args.seq,
        "precision": args.precision, "tiny": args.tiny, "rounds": args.rounds, "deadline_s": args.deadline_s,
        "wall_s": time.perf_counter() - started, "commit": _commit(),
        "device": torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu",
        "torch": torch.__version__, "summary": lines, "rows": rows,
    }
    with open(os.path.join(args.out, "bench_lab.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = plot(lines, os.path.join(args.out, "bench_lab.png"))
    print(f"[bench_lab] wrote {os.path.join(args.out, 'bench_lab.json')}" + (f" and {png}" if png else
          " (no matplotlib: no plot)") + f"; total {result['wall_s']:.0f} s on {result['device']}")
    for scenario in dict.fromkeys(line["scenario"] for line in lines):
        emulation = next((line["emulation"] for line in lines
                          if line["scenario"] == scenario and line.get("emulation")), None)
        if emulation:
            print(f"[bench_lab] {scenario} emulation per rank: " + "; ".join(emulation))
    unemulated = [f"{l['scenario']}/{l['model']}/{l['config']} rank(s) {l['unemulated_ranks']}"
                  for l in lines if l["unemulated_ranks"]]
    if unemulated:
        print("[bench_lab] NOT EMULATED (steps off the capped stream / no slowdown): " + "; ".join(unemulated))
    print(f"[bench_lab] {result['device']}, commit {result['commit']}, {args.rounds} round(s) of {args.warmup} + "
          f"{args.steps} steps; median (min-max) over rounds; /ideal = ours / Σ solo (ddp row: Lightning / Σ solo), "
          "/ddp = ours / Lightning DDP, both within each round; emulated: every emulated rank's steps ran capped")
    print(table(lines))
    return rows


if __name__ == "__main__":
    main()
