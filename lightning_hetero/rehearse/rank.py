"""``doctor --model CONFIG --lab "A100-80GB,RTX3090,RTX3090"``: rehearse a lab nobody here owns, one rank at a time.

Each target rank runs the config's real training step (its LightningModule, data, ``Trainer`` and strategy, with the
strategy's own sharding, precision and memory plan) alone on this machine's device, as rank ``r`` of an ``N``-rank
job whose collectives are stood in for by torch's fake process group, in a fresh process capped to that card's
memory (and, on CUDA, to its SM share through a green context; on CPU through the emulator's slowdown). The same is
done for Lightning's ``DDPStrategy`` and ``FSDPStrategy`` with equal batches. What comes out:

- **measured**: each rank's peak device memory, its step time under the card's compute share, the plan and batch
  share the strategy chose (from the lab's cards, as the real lab would);
- **predicted**: the step time of the job (slowest rank's compute plus the modelled communication of the gradient
  path over the lab's link class), throughput and its ratio to the sum of the cards' solo rates.

Example::

    python -m lightning_hetero doctor --model configs/rehearse_gpt.yaml --lab "A100-80GB,RTX3090,RTX3090"
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_hetero.config import sharded_refusals
from lightning_hetero.lab.emulation import (PRESETS, EmulationSpec, Emulator, alone, job_link_class, parse_emulate,
                                            start_emulation)
from lightning_hetero.lab.rehearsal import REHEARSE_ENV, host_device
from lightning_hetero.registry import entry, names

GIB = 2**30
# Bandwidth per link class (GB/s): measured between two H200s of one host with the emulator's NCCL settings (NVLink;
# P2P off, as PCIe cards without peer access stage through host memory; P2P and SHM off: TCP sockets).
LINK_GBYTES = {"nvlink": 275.0, "pcie": 25.0, "ethernet": 2.6}
WARMUP_STEPS = 2
# Prediction and measurement agree when within this fraction of each other.
AGREEMENT = 0.10
# A step is host-bound when the device had finished its work by the time the host issued the step's last of it: the
# host then waits for the device less than this share of the step (medians over the timed steps).
HOST_BOUND_WAIT = 0.01


# -- the lab -----------------------------------------------------------------------------------------------------------
def parse_lab(text: str) -> list[Any]:
    """``"A100-80GB,RTX3090,RTX3090"`` (preset names) or a JSON list of names / profile dicts; ``ValueError`` naming
    ``--lab`` otherwise."""
    text = text.strip()
    if text.startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"`--lab`={text!r} is not a JSON list: {err}.") from None
    else:
        entries = [name.strip() for name in text.split(",") if name.strip()]
    if not isinstance(entries, list) or len(entries) < 2:
        raise ValueError(f"`--lab`={text!r} must name at least two cards, e.g. 'A100-80GB,RTX3090,RTX3090' "
                         f"(presets: {sorted(PRESETS)}) or a JSON list of profiles.")
    if any(entry is None for entry in entries):
        raise ValueError("`--lab` entries must be cards (a preset or a profile dict), not null.")
    parse_emulate(entries)
    return entries


def card_label(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    return str(entry.get("preset") or entry.get("name") or "custom")


# -- one rank, in its own process --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankJob:
    """What one rehearsal process runs: ``mode`` is ``"hetero"`` (the config's strategy, or ``strategy``), ``"ddp"``
    or ``"fsdp"`` (Lightning's, equal batches), all with the fake process group; the honesty checks also run
    ``"shared"`` (our strategy for real: the lab's ranks together on this one device, gloo) and ``"solo"`` (one card
    alone, a world of one, ``batch_size`` its rehearsed batch)."""

    config: str
    mode: str
    rank: int
    lab: list[Any]
    steps: int
    out: str
    strategy: Optional[str] = None
    accelerator: str = "cpu"
    port: int = 29555
    batch_size: Optional[int] = None


@dataclass
class RankResult:
    mode: str
    rank: int
    card: str
    ok: bool = False
    oom: bool = False
    error: Optional[str] = None
    batch: Optional[int] = None
    share: Optional[float] = None
    global_batch: Optional[int] = None
    plan: Optional[str] = None
    capacity_source: Optional[str] = None
    capacities_asked: Optional[str] = None  # the strategy's `capacities` source ("auto", "profile", "peak", ...)
    split: Optional[list[int]] = None
    memory_modes: Optional[list[str]] = None
    card_memory_bytes: Optional[int] = None
    local_memory_bytes: Optional[int] = None
    peak_allocated_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    host_rss_bytes: Optional[int] = None
    step_seconds: list[float] = field(default_factory=list)
    # Per step, how long the host waited for the device at the step's end: near 0 when the host is the bottleneck.
    device_wait_seconds: list[float] = field(default_factory=list)
    parameters: Optional[int] = None
    param_bytes: Optional[int] = None
    compute_bytes: Optional[int] = None
    device: Optional[str] = None

    @property
    def step_time(self) -> Optional[float]:
        timed = self.step_seconds[WARMUP_STEPS:] or self.step_seconds
        return statistics.median(timed) if timed else None

    @property
    def step_spread(self) -> Optional[float]:
        """The timed steps' interquartile range over their median: how far one step time can be trusted."""
        timed = self.step_seconds[WARMUP_STEPS:]
        if len(timed) < 4:
            return None
        low, _, high = statistics.quantiles(timed, n=4)
        return (high - low) / statistics.median(timed)

    @property
    def device_wait(self) -> Optional[float]:
        """The median of the timed steps' waits for the device at their end."""
        waits = self.device_wait_seconds[WARMUP_STEPS:]
        return statistics.median(waits) if waits else None

    @property
    def host_bound(self) -> Optional[bool]:
        """Whether the step waited on the host rather than the device: its time is then this machine's CPU speed,
        not the card's. None without a device to wait for (CPU ranks)."""
        wait = self.device_wait
        if wait is None or not self.step_time or self.device in (None, "cpu"):
            return None
        return wait < HOST_BOUND_WAIT * self.step_time


def local_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce stood in for: the bucket's own gradients (the fake group's work carries no result)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _first_batch_dim(batch: Any) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_batch_dim(value)
        if found is not None:
            return found
    return None


def _probe(result: RankResult, device: torch.device, emulator: Optional[Emulator] = None) -> Any:
    """A callback timing every training step (synchronised) and noting the batch each rank trained on; for
    a DDP-wrapped model (Lightning's, or ours without a hook of its own) it stands the all-reduce in with
    :func:`local_gradients_hook`. With ``emulator`` (Lightning's strategies, which have none of their own) each step
    runs under the card's SM share (CPU: its slowdown), as ours does."""
    from contextlib import ExitStack

    from lightning.pytorch import Callback

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class Probe(Callback):
        def __init__(self) -> None:
            self.started = 0.0
            self.step = ExitStack()  # the emulator's capped step, from batch start to batch end

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            from torch.nn.parallel import DistributedDataParallel

            strategy = trainer.strategy
            # Ours registers a hook of its own only with compression, periodic sync or the CPU emulator; otherwise
            # DDP's built-in all-reduce runs, whose fake work carries no result on CUDA.
            own_hook = getattr(strategy, "weighting", None) is not None
            ddp_wrapped = isinstance(strategy.model, DistributedDataParallel)
            if result.mode in ("ddp", "hetero") and ddp_wrapped and not own_hook:
                strategy.model.register_comm_hook(None, local_gradients_hook)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self.started = time.perf_counter()
            result.batch = _first_batch_dim(batch)
            if emulator is not None:
                self.step.enter_context(emulator.work())  # forward, backward and optimizer step on the capped stream

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step.close()
            issued = time.perf_counter()
            sync()
            ended = time.perf_counter()
            result.step_seconds.append(ended - self.started)
            result.device_wait_seconds.append(ended - issued)

    return Probe()


def carried_options(strategy: Any, target: str) -> dict[str, Any]:
    """The options of the config's own strategy (a ``class_path``/``init_args`` namespace) that ``target`` (an import
    path) also takes, e.g. ``capacities`` from a ``HeteroDDPStrategy`` config rehearsed as ``hetero_fsdp``."""
    import importlib
    import inspect

    init_args = strategy.get("init_args") if hasattr(strategy, "get") else None
    if not init_args:
        return {}
    module, _, name = target.rpartition(".")
    strategy_class = getattr(importlib.import_module(module), name)
    accepted = inspect.signature(strategy_class).parameters
    options = dict(vars(init_args)) if not isinstance(init_args, dict) else dict(init_args)
    dropped = sorted(k for k in options if k not in accepted)
    if dropped:
        print(f"rehearsal: {name} does not take the config's strategy options {dropped}: left out", flush=True)
    capacities = options.get("capacities")
    refused = sorted(sharded_refusals(capacities if isinstance(capacities, str) else None, options.get("rebalance"))
                     if getattr(strategy_class, "sharded", False) else ())
    if refused:
        print(f"rehearsal: {name} refuses the config's strategy options {refused} as set: left out", flush=True)
    return {k: v for k, v in options.items() if k in accepted and k not in refused}


def run_rank(job: RankJob) -> RankResult:
    """Build the config's Trainer as rank ``job.rank`` of the lab and train ``job.steps`` steps (in this process)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_hetero._compat import init_fake_process_group
    from lightning_hetero.plan.blocks import default_blocks

    world = len(job.lab)
    device = torch.device("cuda", 0) if job.accelerator == "gpu" else torch.device("cpu")
    result = RankResult(job.mode, job.rank, card_label(job.lab[job.rank]))
    spec = parse_emulate(job.lab)[job.rank]  # type: ignore[index]
    preset = PRESETS[spec.preset] if spec and spec.preset else None
    gib = spec.memory_gib if spec and spec.memory_gib is not None else (preset.memory_gib if preset else None)
    result.card_memory_bytes = int(gib * GIB) if gib is not None else None
    if device.type == "cuda":
        result.local_memory_bytes = torch.cuda.get_device_properties(0).total_memory
        result.device = torch.cuda.get_device_name(0)
    else:
        result.device = "cpu"
    root = tempfile.mkdtemp(prefix="hetero-rehearse-")

    class RehearsalCLI(LightningCLI):
        def before_instantiate_classes(self) -> None:
            if job.mode in ("ddp", "fsdp"):
                return
            from jsonargparse import Namespace

            if job.batch_size is not None:
                # The loader's batch is the data module's, or (without one) the model's own `batch_size`.
                owner = self.config.get("data") or self.config.model
                owner.init_args.batch_size = job.batch_size
            trainer = self.config.trainer
            strategy = trainer.get("strategy")
            if job.strategy is not None and not (isinstance(strategy, Namespace)
                                                 and strategy.get("class_path") == job.strategy):
                kept = carried_options(strategy, job.strategy)
                trainer.strategy = strategy = Namespace(class_path=job.strategy, init_args=Namespace(**kept))
            if not (isinstance(strategy, Namespace) and "Hetero" in str(strategy.get("class_path"))):
                raise ValueError(f"`trainer.strategy` of {job.config!r} is not a lightning_hetero strategy: give "
                                 f"`--strategy {'|'.join(names())}`.")
            strategy.init_args.emulate = job.lab

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            if job.mode == "ddp":
                kwargs["strategy"] = DDPStrategy()
            elif job.mode == "fsdp":
                kwargs["strategy"] = FSDPStrategy(auto_wrap_policy=set(default_blocks(self.model)))
            kwargs.update(accelerator=job.accelerator, devices=1, num_nodes=world, max_steps=job.steps,
                          max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=root)
            return super().instantiate_trainer(**kwargs)

    emulator: Optional[Emulator] = None
    try:
        if job.mode == "shared":
            # Without a device binding (Lightning's would pass `device_id`): several ranks share this one device.
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port + 1}", rank=job.rank,
                                    world_size=world)
        elif job.mode in ("ddp", "fsdp"):
            # Lightning's own strategies keep an initialised process group (the fake one) instead of creating theirs.
            init_fake_process_group(job.rank, world)
            # The card's memory cap and SM share (CPU: slowdown), as our strategy's emulator applies them.
            if device.type == "cuda":
                torch.cuda.set_device(device)
            emulator = start_emulation(parse_emulate(job.lab) or (), job.rank, world, host_device(device), device)
            if emulator is not None:
                emulator.activate()
        import yaml

        with open(job.config) as f:
            has_data = "data" in (yaml.safe_load(f) or {})
        cli = RehearsalCLI(LightningModule, LightningDataModule if has_data else None, subclass_mode_model=True,
                           subclass_mode_data=True, save_config_callback=None, run=False,
                           args=["--config", job.config])
        params = list(cli.model.parameters())
        result.parameters = sum(p.numel() for p in params)
        result.param_bytes = sum(p.numel() * p.element_size() for p in params)
        trainer = cli.trainer
        trainer.callbacks.append(_probe(result, device, emulator))
        precision = str(getattr(trainer.precision_plugin, "precision", "32-true"))
        element = 2 if ("16" in precision and "32" not in precision) else 4
        result.compute_bytes = result.parameters * element
        trainer.fit(cli.model, datamodule=cli.datamodule)
        result.ok = True
        strategy = trainer.strategy
        if job.mode in ("hetero", "shared", "solo"):
            plan = strategy.plan.as_dict()  # type: ignore[attr-defined]
            result.split, result.capacity_source = plan["split"], plan["capacity_source"]
            result.capacities_asked = strategy.plan.spec.source  # type: ignore[attr-defined]
            result.global_batch = plan["global_batch_size"]
            memory_plan = getattr(strategy, "memory_plan", None)
            result.memory_modes = [p.mode for p in memory_plan] if memory_plan else None
            result.plan = result.memory_modes[job.rank] if result.memory_modes else "replica"
        else:
            result.global_batch = (result.batch or 0) * world
            result.plan = "replica" if job.mode == "ddp" else "full shard"
        if result.global_batch and result.batch:
            result.share = (result.split[job.rank] if result.split else result.batch) / result.global_batch
    except torch.OutOfMemoryError as err:
        result.oom, result.error = True, str(err).splitlines()[0]
    except Exception as err:  # reported per rank; the doctor goes on with the next one
        import traceback

        traceback.print_exc()  # whole in the rank's log
        result.error = f"{type(err).__name__}: {err}"
    if device.type == "cuda":
        result.peak_allocated_bytes = torch.cuda.max_memory_allocated(0)
        result.peak_reserved_bytes = torch.cuda.max_memory_reserved(0)
    import resource

    result.host_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shutil.rmtree(root, ignore_errors=True)
    with open(job.out, "w") as f:
        json.dump(asdict(result), f)
    return result


def rank_environment(job: RankJob) -> dict[str, str]:
    """Rank ``r`` of ``N`` as Lightning sees it: its own node of one process, started from outside."""
    env = dict(os.environ, LOCAL_RANK="0", NODE_RANK=str(job.rank), WORLD_SIZE=str(len(job.lab)),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), PYTHONUNBUFFERED="1")
    env.pop(REHEARSE_ENV, None)
    if job.mode == "hetero":
        env[REHEARSE_ENV] = f"{job.rank}/{len(job.lab)}"
    return env


def launch_ranks(jobs: Sequence[RankJob], timeout: float, log: Any) -> list[RankResult]:
    """Run ranks in fresh processes, together (each in its own session: on timeout or interruption every process
    group is killed, data loader workers included)."""
    processes = []
    try:
        for job in jobs:
            cmd = [sys.executable, "-m", "lightning_hetero.rehearse.rank", json.dumps(asdict(job))]
            processes.append(subprocess.Popen(cmd, env=rank_environment(job), stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for process in processes:
            _kill_group(process)
    return [_collect(job, process, timeout if timed_out else None) for job, process in zip(jobs, processes)]


def launch_rank(job: RankJob, timeout: float, log: Any) -> RankResult:
    """Run one rank in a fresh process (see :func:`launch_ranks`)."""
    return launch_ranks([job], timeout, log)[0]


def _collect(job: RankJob, process: "subprocess.Popen[bytes]", timed_out: Optional[float]) -> RankResult:
    if timed_out is not None and process.returncode in (None, -signal.SIGKILL):
        return RankResult(job.mode, job.rank, card_label(job.lab[job.rank]), error=f"timed out after {timed_out:g} s")
    try:
        with open(job.out) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return RankResult(job.mode, job.rank, card_label(job.lab[job.rank]),
                          error=f"the rank's process exited with code {process.returncode} (see the log)")
    return RankResult(**data)


def _kill_group(process: "subprocess.Popen[bytes]") -> None:
    """End the rank's process and every child it started (data loader workers included)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


# -- prediction --------------------------------------------------------------------------------------------------------
def communication_seconds(mode: str, world: int, param_bytes: int, compute_bytes: int, gbytes: float) -> float:
    """Seconds per step of a ring collective path on a link of ``gbytes`` GB/s (every rank sends what a ring sends).

    Replicas (DDP): one all-reduce of the gradients, 2 (N-1)/N × gradient bytes. Sharded (FSDP): the parameters
    all-gathered for forward and again for backward, (N-1)/N × compute-dtype bytes each, and one reduce-scatter of
    the gradients, (N-1)/N × gradient bytes.
    """
    ring = (world - 1) / world
    if mode in ("hetero_ddp", "ddp"):
        wire = 2 * ring * param_bytes
    else:
        wire = 2 * ring * compute_bytes + ring * param_bytes
    return wire / (gbytes * 1e9)


def predict(hetero: Sequence[RankResult], ddp: Sequence[RankResult], fsdp: Sequence[RankResult], strategy: str,
            link: str) -> dict[str, Any]:
    """Step time, throughput and ratio to Σ solo of ours vs DDP vs FSDP, from the rehearsed step times.

    Each strategy's compute time on a card is that rank's own measured step time; a rank that did not run (out of
    memory) is extrapolated from our rank's rate on that card, linearly in the batch, and listed in ``estimated``.
    A card's solo rate is its best measured samples/s over the rehearsed runs.
    """
    rates = [r.batch / r.step_time if r.ok and r.batch and r.step_time else None for r in hetero]
    base = next((r for r in hetero if r.ok), None)
    out: dict[str, Any] = {"link": link, "link_gbytes_per_s": LINK_GBYTES[link], "rates": rates, "strategies": {}}
    if base is None or any(rate is None for rate in rates):
        return out
    world = len(hetero)
    global_batch = base.global_batch or sum(r.batch or 0 for r in hetero)
    solo = [max([rate] + [r.batch / r.step_time for r in (*ddp, *fsdp)  # type: ignore[operator]
                          if r.rank == i and r.ok and r.batch and r.step_time])
            for i, rate in enumerate(rates)]
    out["solo_samples_per_s"] = solo
    out["sum_solo_samples_per_s"] = sum(solo)
    ours = "hetero_fsdp" if base.memory_modes else "hetero_ddp"
    runs = {ours: (hetero, [r.batch for r in hetero]), "ddp": (ddp, [global_batch / world] * world),
            "fsdp": (fsdp, [global_batch / world] * world)}
    for name, (results, batches) in runs.items():
        if not results:
            continue  # not rehearsed (baselines off, or Lightning's FSDPStrategy on CPU)
        fits = all(r.ok for r in results)
        measured = {r.rank: r.step_time for r in results if r.ok and r.step_time}
        compute = [measured.get(i) or b / rate for i, (b, rate) in enumerate(zip(batches, rates))]  # type: ignore
        comm = communication_seconds(name, world, base.param_bytes or 0, base.compute_bytes or 0, LINK_GBYTES[link])
        step = max(compute) + comm
        out["strategies"][name] = {
            "fits": fits, "batches": batches, "compute_seconds": compute, "communication_seconds": comm,
            "estimated": [i for i in range(world) if i not in measured],
            "step_seconds": step, "samples_per_s": global_batch / step if fits else None,
            "ratio_to_sum_solo": global_batch / step / sum(solo) if fits else None,
            "oom_ranks": [r.rank for r in results if r.oom],
        }
    return out


# -- report ------------------------------------------------------------------------------------------------------------
def _gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def aligned(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """``rows`` (the first one the header) as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _step_ms(r: RankResult, unit: str = "") -> str:
    """The median step in ms, with half the steps' interquartile spread where there are enough of them."""
    if not r.step_time:
        return "-"
    spread = r.step_spread
    return f"{r.step_time * 1e3:.1f}{unit}" + (f" ±{spread / 2:.0%}" if spread is not None else "")


def _bound(host_bound: Optional[bool]) -> str:
    return "-" if host_bound is None else "host" if host_bound else "device"


def format_rehearsal(report: dict[str, Any]) -> str:
    hetero = [RankResult(**r) for r in report["hetero"]]
    lines = [f"Rehearsal of {report['config']} on lab {report['lab_text']} ({report['strategy']}), one rank at a time "
             f"on {report['local_device']} with the fake process group; {report['steps']} steps per rank."]
    cuda = report["accelerator"] == "gpu"
    rows = [("rank", "card", "plan", "share", "batch", "peak GiB", "card GiB", "headroom", "step ms", "bound",
             "status")]
    for r in hetero:
        peak = r.peak_allocated_bytes if cuda else None
        headroom = (r.card_memory_bytes - peak) if (peak is not None and r.card_memory_bytes) else None
        rows.append((str(r.rank), r.card, str(r.plan or "-"), f"{r.share:.1%}" if r.share is not None else "-",
                     str(r.batch or "-"), _gib(peak), _gib(r.card_memory_bytes), _gib(headroom), _step_ms(r),
                     _bound(r.host_bound), "ok" if r.ok else ("OOM" if r.oom else f"error: {r.error}")))
    lines += aligned(rows)
    if not cuda:
        rss = ", ".join(f"rank {r.rank} {_gib(r.host_rss_bytes)}" for r in hetero)
        lines.append(f"  CPU: no device memory cap or peak (n/a); host-side peak RSS per rank process (GiB): {rss}")
    for name in ("ddp", "fsdp"):
        results = [RankResult(**r) for r in report[name]]
        if not results:
            continue
        parts = []
        for r in results:
            peak = f", peak {_gib(r.peak_allocated_bytes)} GiB" if cuda and r.ok else ""
            verdict = "fits" if r.ok else ("OOM" if r.oom else f"error ({r.error})")
            parts.append(f"rank {r.rank} {r.card} batch {r.batch or '-'}: {verdict}{peak}")
        lightning = "DDPStrategy" if name == "ddp" else "FSDPStrategy"
        lines.append(f"Lightning {lightning} (equal batches): " + "; ".join(parts))
    prediction = report["prediction"]
    lines.append("")
    if not prediction.get("strategies"):
        lines.append("Speed: not predicted (a rank of our strategy did not run).")
    else:
        lines.append(f"Predicted step (from the measured step times; link {prediction['link']} at "
                     f"{prediction['link_gbytes_per_s']:g} GB/s):")
        rows = [("strategy", "compute ms (per rank)", "comm ms", "step ms", "samples/s", "vs sum solo")]
        for name, s in prediction["strategies"].items():
            compute = "/".join(f"{c * 1e3:.1f}" + ("*" if i in s["estimated"] else "")
                               for i, c in enumerate(s["compute_seconds"]))
            failed = f"OOM on ranks {s['oom_ranks']}" if s["oom_ranks"] else "failed"
            rows.append((name, compute, f"{s['communication_seconds'] * 1e3:.1f}", f"{s['step_seconds'] * 1e3:.1f}",
                         f"{s['samples_per_s']:.1f}" if s["samples_per_s"] else failed,
                         f"{s['ratio_to_sum_solo']:.2f}" if s["ratio_to_sum_solo"] else "-"))
        lines += aligned(rows, indent="  ")
        solo = ", ".join(f"{rate:.1f}" for rate in prediction["solo_samples_per_s"])
        lines.append(f"  sum of the cards' solo rates: {prediction['sum_solo_samples_per_s']:.1f} samples/s ({solo}: "
                     "each card's best measured rate)")
        if any(s["estimated"] for s in prediction["strategies"].values()):
            lines.append("  * not measured (the rank did not run): our rank's rate on that card, linear in the batch")
    lines += [f"assumption: {a}" for a in report["assumptions"]]
    lines += [f"NOTE: {n}" for n in report["notes"]]
    return "\n".join(lines)


ASSUMPTIONS = (
    "memory: measured (torch.cuda.max_memory_allocated of the rank's own process under the card's memory cap); "
    "the CUDA context and NCCL buffers (~0.5-1 GiB on a real card) are not included",
    "compute: each rank's step time (forward, backward, optimizer) measured on this device under the card's SM "
    "share (CPU: the emulator's slowdown), with collectives stood in for, for ours and Lightning's DDP/FSDP alike",
    "link: the slowest link class of the lab; bandwidths (GB/s) " + ", ".join(f"{k} {v:g}" for k, v in
                                                                            LINK_GBYTES.items())
    + " (NCCL between two H200s with the emulator's settings); ring collectives",
    "overlap: none (communication added after the slowest rank's compute: an upper bound on the step time)",
    "gradients uncompressed, in the parameters' dtype; FSDP all-gathers in the compute dtype",
)


def draw(report: dict[str, Any], path: str) -> Optional[str]:
    """Memory per card against its capacity, and the predicted throughput of the three strategies (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hetero = [RankResult(**r) for r in report["hetero"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r.rank}: {r.card}" for r in hetero]
    cuda = report["accelerator"] == "gpu"
    peaks = [(r.peak_allocated_bytes if cuda else r.host_rss_bytes) or 0 for r in hetero]
    left.bar(labels, [p / GIB for p in peaks], label="peak measured" if cuda else "host RSS (CPU: no device cap)")
    left.scatter(labels, [(r.card_memory_bytes or 0) / GIB for r in hetero], color="red", marker="_", s=900,
                 label="card memory")
    left.set_ylabel("GiB")
    left.set_title("memory per card")
    left.legend()
    strategies = report["prediction"].get("strategies", {})
    names = list(strategies)
    values = [strategies[n]["samples_per_s"] or 0 for n in names]
    right.bar(names, values, color=["tab:green", "tab:blue", "tab:orange"][: len(names)])
    for i, n in enumerate(names):
        if not strategies[n]["fits"]:
            right.text(i, 0, "OOM", ha="center", va="bottom", color="red")
    right.set_ylabel("predicted samples/s")
    right.set_title("predicted throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the command -------------------------------------------------------------------------------------------------------
def rehearse(config: str, lab_text: str, strategy: Optional[str] = None, steps: int = 6, out_dir: Optional[str] = None,
             baselines: bool = True, timeout: float = 900.0, accelerator: Optional[str] = None) -> dict[str, Any]:
    """Rehearse ``config`` on the lab ``lab_text``; writes ``rehearsal.log``, ``.json`` and ``.png`` to ``out_dir``
    and returns the report."""
    if not os.path.isfile(config):
        raise ValueError(f"`--model`={config!r} is not a file.")
    if strategy is not None and strategy not in names():
        raise ValueError(f"`--strategy`={strategy!r} must be one of {sorted(names())}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < WARMUP_STEPS + 2:
        raise ValueError(f"`--steps`={steps!r} must be an integer >= {WARMUP_STEPS + 2}.")
    lab = parse_lab(lab_text)
    accelerator = accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
    out_dir = out_dir or f"rehearsal-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(out_dir, exist_ok=True)
    specs: list[Optional[EmulationSpec]] = list(parse_emulate(lab) or ())
    link = job_link_class(specs)
    report: dict[str, Any] = {
        "config": config, "lab_text": lab_text, "lab": lab, "strategy": strategy or "the config's",
        "steps": steps, "accelerator": accelerator,
        "local_device": torch.cuda.get_device_name(0) if accelerator == "gpu" else "cpu",
        "hetero": [], "ddp": [], "fsdp": [], "notes": [], "assumptions": list(ASSUMPTIONS),
    }
    log_path = os.path.join(out_dir, "rehearsal.log")
    # A SIGTERM (a scheduler's timeout) unwinds like Ctrl-C, so the ranks' process groups are killed on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="hetero-rehearse-") as scratch, open(log_path, "w") as log:
        modes = ("hetero", "ddp", "fsdp") if baselines else ("hetero",)
        if accelerator != "gpu":
            # Lightning's FSDPStrategy runs on CUDA only.
            modes = tuple(m for m in modes if m != "fsdp")
            report["notes"].append("Lightning FSDPStrategy not rehearsed: it needs a CUDA device")
        for mode in modes:
            for rank in range(len(lab)):
                job = RankJob(config=config, mode=mode, rank=rank, lab=lab, steps=steps,
                              out=os.path.join(scratch, f"{mode}-rank{rank}.json"),
                              strategy=entry(strategy).class_path if strategy else None, accelerator=accelerator)
                log.write(f"\n===== {mode} rank {rank} ({card_label(lab[rank])}) =====\n")
                log.flush()
                result = launch_rank(job, timeout, log)
                report[mode].append(asdict(result))
                print(f"  rehearsed {mode:<6} rank {rank} ({result.card}): "
                      f"{'ok' if result.ok else 'OOM' if result.oom else result.error}", flush=True)
                if mode == "hetero" and rank == 0 and result.error and not result.oom:
                    # The job itself is broken (config, model): every rank would say the same.
                    break
    hetero = [RankResult(**r) for r in report["hetero"]]
    report["notes"] += notes(hetero, accelerator)
    report["prediction"] = predict(hetero, [RankResult(**r) for r in report["ddp"]],
                                   [RankResult(**r) for r in report["fsdp"]], strategy or "", link)
    text = format_rehearsal(report)
    with open(log_path, "a") as log:
        log.write("\n" + text + "\n")
    with open(os.path.join(out_dir, "rehearsal.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot = draw(report, os.path.join(out_dir, "rehearsal.png"))
    print(text)
    print(f"written: {log_path}, {os.path.join(out_dir, 'rehearsal.json')}" + (f", {plot}" if plot else ""))
    return report


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def notes(hetero: Sequence[RankResult], accelerator: str) -> list[str]:
    """What the user must know about this rehearsal's figures: ranks the local device could not hold, and caps it
    could not apply."""
    out = []
    for r in hetero:
        smaller = r.local_memory_bytes is not None and r.card_memory_bytes is not None and \
            r.local_memory_bytes < r.card_memory_bytes
        if smaller:
            out.append(f"rank {r.rank} ({r.card}): this device has {_gib(r.local_memory_bytes)} GiB, the card "
                       f"{_gib(r.card_memory_bytes)} GiB: rehearsed with less memory than the card has"
                       + (" (its OOM here does not prove an OOM on the card)" if r.oom else ""))
    if hetero and all(r.oom for r in hetero):
        reason = "; ".join(f"rank {r.rank}: {'OOM' if r.oom else r.error}" for r in hetero)
        out.append(f"the local device ({accelerator}) could not hold even one rank of this lab ({reason}): rehearse "
                   "on a device with at least the smallest card's memory, or lower the batch / choose a memory plan.")
    measured = {r.capacities_asked for r in hetero if r.capacities_asked in ("auto", "profile")}
    if measured and hetero[0].capacity_source:
        out.append(f"capacities {sorted(measured)} are measured across the ranks at the start of a real run; the "
                   f"rehearsal cannot (each rank runs alone) and used '{hetero[0].capacity_source}' (the cards' "
                   "published rates, or equal where there are none); the real shares follow the measured speeds")
    for r in hetero:
        if r.host_bound:
            out.append(f"rank {r.rank} ({r.card}): host-bound: the device had finished its work when the host issued "
                       f"the step's last (it waited {r.device_wait * 1e3:.1f}"  # type: ignore[operator]
                       f" ms of {r.step_time * 1e3:.1f} ms), so this step time is this machine's CPU speed, not the "
                       "card's: on the lab the host's CPU and load set it, and the prediction is no better than that")
    if accelerator != "gpu":
        out.append("CPU rehearsal: no device memory is capped or measured (peaks n/a; host RSS shown); speeds are the "
                   "emulator's CPU slowdowns, not the cards'")
    return out


if __name__ == "__main__":
    from lightning_hetero.observe.errors import run_main

    payload = json.loads(sys.argv.pop(1))
    run_main(lambda: run_rank(RankJob(**payload)), "lightning-hetero doctor --lab (rehearsed rank)")


# -- honesty check -----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _relative(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    return None if not predicted or not measured else predicted / measured - 1.0


def solo_card(lab: Sequence[Any], rank: int, accelerator: str) -> Any:
    """The lab's card ``rank`` as a lab of one that keeps its speed in the lab (CPU slowdowns are lab-relative)."""
    specs = parse_emulate(list(lab)) or ()
    spec = alone(specs[rank], specs, "cuda" if accelerator == "gpu" else "cpu")
    return lab[rank] if spec is specs[rank] or spec is None else spec.as_dict()


def honesty_check(config: str, lab_text: str, steps: int = 6, out_dir: str = "rehearsal-check",
                  strategy: Optional[str] = None, timeout: float = 900.0) -> dict[str, Any]:
    """Rehearse ``lab_text``, then run the same ranks for real, together on this one device (gloo, each capped as
    its card), and each card alone (emulated solo, its rehearsed batch): the rehearsed plan, shares and peak memory
    against the real run's, and each card's rehearsed step time against its solo step time. Differences beyond
    :data:`AGREEMENT` are named in ``report["disagreements"]``."""
    report = rehearse(config, lab_text, strategy, steps=steps, out_dir=out_dir, baselines=False, timeout=timeout)
    lab = report["lab"]
    accelerator = report["accelerator"]
    rehearsed = [RankResult(**r) for r in report["hetero"]]
    rehearsed += [RankResult("hetero", r, card_label(lab[r]), error="not rehearsed (rank 0 failed)")
                  for r in range(len(rehearsed), len(lab))]
    chosen = entry(strategy).class_path if strategy else None
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="hetero-rehearse-check-") as scratch, \
            open(os.path.join(out_dir, "check.log"), "w") as log:
        shared = launch_ranks([RankJob(config, "shared", r, lab, steps, os.path.join(scratch, f"shared-rank{r}.json"),
                                       chosen, accelerator, port=port) for r in range(len(lab))], timeout, log)
        solo = [launch_rank(RankJob(config, "solo", 0, [solo_card(lab, r, accelerator)], steps,
                                    os.path.join(scratch, f"solo-rank{r}.json"),
                                    chosen, accelerator, port=_free_port(), batch_size=rehearsed[r].batch), timeout,
                            log) if rehearsed[r].ok else RankResult("solo", r, rehearsed[r].card, error="not rehearsed")
                for r in range(len(lab))]
    rows, disagreements = [], []
    for r, (mine, real, solo_run) in enumerate(zip(rehearsed, shared, solo)):
        row, differs = compare_rank(r, mine, real, solo_run, cuda=accelerator == "gpu")
        rows.append(row)
        disagreements += differs
    # Every run's own record (its step times included), so that a disagreement can be looked into afterwards.
    check = {"rows": rows, "disagreements": disagreements, "agreement": AGREEMENT,
             "shared": [asdict(r) for r in shared], "solo": [asdict(r) for r in solo]}
    report["check"] = check
    with open(os.path.join(out_dir, "check.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(format_check(check))
    return report


def compare_rank(r: int, mine: RankResult, real: RankResult, solo: RankResult, cuda: bool
                 ) -> tuple[dict[str, Any], list[str]]:
    """Rank ``r`` rehearsed (``mine``) against the same rank really run together with the others (``real``: plan,
    split, peak memory) and its card emulated alone (``solo``: step time); the row, and each difference in words."""
    row: dict[str, Any] = {
        "rank": r, "card": mine.card,
        "plan": [mine.plan, real.plan], "split": [mine.split, real.split],
        "peak_bytes": [mine.peak_allocated_bytes, real.peak_allocated_bytes] if cuda else None,
        "step_seconds": [mine.step_time, solo.step_time],
        "step_spread": [mine.step_spread, solo.step_spread],
        "host_bound": [mine.host_bound, solo.host_bound],
    }
    row["peak_error"] = _relative(*row["peak_bytes"]) if cuda else None
    row["step_error"] = _relative(*row["step_seconds"])
    differs = []
    if mine.plan != real.plan or mine.split != real.split:
        differs.append(f"rank {r}: rehearsed plan {mine.plan} split {mine.split}, real {real.plan} {real.split}"
                       + (f" ({real.error})" if real.error else ""))
    if row["peak_error"] is None and cuda:
        differs.append(f"rank {r}: peak not compared ({mine.error or real.error})")
    elif row["peak_error"] is not None and abs(row["peak_error"]) > AGREEMENT:
        differs.append(f"rank {r}: rehearsed peak {_gib(mine.peak_allocated_bytes)} GiB vs "
                       f"{_gib(real.peak_allocated_bytes)} GiB really run together ({row['peak_error']:+.1%})")
    if row["step_error"] is None:
        differs.append(f"rank {r}: step time not compared ({mine.error or solo.error})")
    elif abs(row["step_error"]) > AGREEMENT:
        why = ("; host-bound (rehearsed/solo: " + "/".join(_bound(b) for b in row["host_bound"]) + "): the times "
               "are this machine's CPU speed, which varies with its load") if any(row["host_bound"]) else ""
        differs.append(f"rank {r}: rehearsed step {_step_ms(mine, ' ms')} vs emulated solo {_step_ms(solo, ' ms')} "
                       f"({row['step_error']:+.1%}){why}")
    return row, differs


def format_check(check: dict[str, Any]) -> str:
    rows = [("rank", "card", "plan (reh/real)", "peak GiB (reh/real)", "err", "step ms (reh/solo)", "err",
             "bound (reh/solo)")]
    for row in check["rows"]:
        peaks = row["peak_bytes"] or [None, None]
        steps = [f"{s * 1e3:.1f}" if s else "-" for s in row["step_seconds"]]
        rows.append((str(row["rank"]), row["card"], "/".join(map(str, row["plan"])),
                     f"{_gib(peaks[0])}/{_gib(peaks[1])}",
                     f"{row['peak_error']:+.1%}" if row["peak_error"] is not None else "n/a",
                     "/".join(steps), f"{row['step_error']:+.1%}" if row["step_error"] is not None else "n/a",
                     "/".join(_bound(b) for b in row["host_bound"])))
    lines = ["Honesty check: rehearsed vs the same ranks really run together on this device (peak) and each card "
             "emulated solo (step time)"]
    lines += aligned(rows)
    lines += [f"DIFFERS (> {check['agreement']:.0%}): {d}" for d in check["disagreements"]] or \
        [f"all within {check['agreement']:.0%}"]
    return "\n".join(lines)
