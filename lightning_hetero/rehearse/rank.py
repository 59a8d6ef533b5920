"""One rehearsed rank, in its own process: the config's real ``Trainer`` and strategy as rank ``r`` of the lab.

Started by :mod:`lightning_hetero.rehearse.launch` as ``python -m lightning_hetero.rehearse.rank JOB_JSON``; the
rank writes its :class:`~lightning_hetero.rehearse.job.RankResult` to ``job.out``.
"""

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_hetero.config import sharded_refusals
from lightning_hetero.lab.emulation import start_emulation
from lightning_hetero.lab.emulation_spec import parse_emulate
from lightning_hetero.lab.emulator import Emulator
from lightning_hetero.lab.presets import PRESETS
from lightning_hetero.lab.rehearsal import host_device
from lightning_hetero.observe.errors import user_message
from lightning_hetero.plan.memory import GIB
from lightning_hetero.registry import entry, entry_of, names
from lightning_hetero.rehearse.cards import card_label
from lightning_hetero.rehearse.job import LIGHTNING_MODES, RankJob, RankResult
from lightning_hetero.view import observed

# The fixed workload each rank times under its emulation before its first step (matrix side, repeats).
PROBE_SIDE = {"cuda": 4096, "cpu": 256}
PROBE_REPEATS = 20
PROBE_TRIALS = 3
# Options a strategy rehearsed in place of the config's own (`--strategy`) needs and the config's has no word for:
# the hybrid layout's pipelines, then the planner's choice.
SUBSTITUTED_DEFAULTS: dict[str, dict[str, Any]] = {entry("hetero_hybrid").class_path: {"pipelines": "auto"}}


class StepClock:
    """Points within a step as the device reaches them (CUDA: events on the current stream, read after the step's
    end; CPU: the host clock, which the work keeps pace with), so the step's phases cost no synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class BucketTimes:
    """DDP's gradient buckets of one step as they reach the comm hook: (bytes, the :class:`StepClock` mark)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.ready: list[tuple[int, Any]] = []


def local_gradients_hook(state: Optional[BucketTimes], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce stood in for: the bucket's own gradients (the fake group's work carries no result); with
    ``state``, the bucket's size and the point it was ready noted."""
    buffer = bucket.buffer()
    if state is not None:
        state.ready.append((buffer.numel() * buffer.element_size(), state.clock.mark()))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
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
    """A callback timing every training step (synchronised) and its phases (forward, backward, the rest: see
    :class:`~lightning_hetero.rehearse.timeline.RankPhases`) and noting the batch each rank trained on; for a
    DDP-wrapped model (Lightning's, or ours without a hook of its own) it stands the all-reduce in with
    :func:`local_gradients_hook`, noting when each bucket was ready. With ``emulator`` (Lightning's strategies, which
    have none of their own) each step runs under the card's SM share (CPU: its slowdown), as ours does."""
    from contextlib import ExitStack

    from lightning.pytorch import Callback

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def peak_so_far() -> int:
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    class Probe(Callback):
        def __init__(self) -> None:
            self.started = 0.0
            self.step = ExitStack()  # the emulator's capped step, from batch start to batch end
            self.clock = StepClock(device)
            self.buckets = BucketTimes(self.clock)
            self.marks: list[Any] = []  # the step's start, the first backward's start, the last backward's end
            self.host_marks: list[float] = []  # the same points on the host clock
            self.peaks: list[int] = []  # CUDA: the peak so far at the forward's and at the backward's end
            # CPU: the emulator sleeps a slowed card's extra time off after the step; it belongs to every phase, in
            # proportion (the emulator's count of the seconds slept, before the step).
            self.sleeper: Optional[Emulator] = None
            self.slept = 0.0

        def on_train_start(self, trainer: Any, module: Any) -> None:
            # Before the first step: the rank's emulation (ours: the strategy's own emulator) times a fixed workload,
            # so that a run shows every rank emulated as its card.
            ours = observed(trainer.strategy)
            emulated = emulator if emulator is not None or ours is None else ours.emulation
            result.emulated_speed, result.emulation_probe_seconds = emulation_probe(emulated, device)
            if emulated is not None and device.type == "cpu":
                self.sleeper = emulated

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            from torch.nn.parallel import DistributedDataParallel

            strategy = trainer.strategy
            # Ours registers a hook of its own only with compression, periodic sync or the CPU emulator; otherwise
            # DDP's built-in all-reduce runs, whose fake work carries no result on CUDA.
            ours = observed(strategy)
            own_hook = ours is not None and ours.owns_comm_hook
            ddp_wrapped = isinstance(strategy.model, DistributedDataParallel)
            if result.mode in ("ddp", "hetero") and ddp_wrapped and not own_hook:
                strategy.model.register_comm_hook(self.buckets, local_gradients_hook)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            sync()
            if device.type == "cuda" and result.setup_peak_bytes is None:
                result.setup_peak_bytes = torch.cuda.max_memory_allocated(device)
            self.started = time.perf_counter()
            result.step_started_at.append(time.time())
            cpu = current_cpu()
            if cpu is not None:
                result.step_cpus.append(cpu)
            self.marks, self.buckets.ready = [self.clock.mark()], []
            self.host_marks, self.peaks = [time.perf_counter()], []
            self.slept = self.sleeper.slept_seconds if self.sleeper is not None else 0.0
            result.batch = _first_batch_dim(batch)
            if emulator is not None:
                self.step.enter_context(emulator.work())  # forward, backward and optimizer step on the capped stream

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            if len(self.marks) == 1:  # the first (micro-)batch's backward: the forward ended
                self.marks.append(self.clock.mark())
                self.host_marks.append(time.perf_counter())
                self.peaks.append(peak_so_far())

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            if len(self.marks) >= 2:
                self.marks[2:] = [self.clock.mark()]  # the last (micro-)batch's backward ends the phase
                self.host_marks[2:] = [time.perf_counter()]
                self.peaks[1:] = [peak_so_far()]

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step.close()
            issued = time.perf_counter()
            sync()
            ended = time.perf_counter()
            result.step_seconds.append(ended - self.started)
            if len(self.marks) == 3:
                try:
                    self.record_phases(ended - self.started)
                except RuntimeError as err:  # the device's clock unread: the step's total stands, without phases
                    print(f"rehearsal: step phases not timed ({err})", flush=True)
                    self.marks = []
            if device.type == "cuda":
                result.step_peak_bytes.append(torch.cuda.max_memory_allocated(device))
                if len(self.peaks) == 2:
                    result.phase_peak_bytes.append([*self.peaks, result.step_peak_bytes[-1]])
            result.device_wait_seconds.append(ended - issued)

        def record_phases(self, window: float) -> None:
            start, forward_end, backward_end = self.marks
            slept = max(0.0, self.sleeper.slept_seconds - self.slept) if self.sleeper is not None else 0.0
            stretch = window / (window - slept) if window > slept else 1.0
            forward = self.clock.seconds(start, forward_end) * stretch
            backward = self.clock.seconds(forward_end, backward_end) * stretch
            ready = [(size, self.clock.seconds(forward_end, mark) * stretch) for size, mark in self.buckets.ready]
            result.phase_seconds.append([forward, backward, max(0.0, window - forward - backward)])
            host = [(b - a) * stretch for a, b in zip(self.host_marks, self.host_marks[1:])]
            if len(host) == 2:
                result.host_phase_seconds.append([*host, max(0.0, window - sum(host))])
            if ready and backward > 0:
                result.bucket_bytes = [size for size, _ in ready]
                result.bucket_ready = [min(1.0, max(0.0, at / backward)) for _, at in ready]

    return Probe()


def current_cpu() -> Optional[int]:
    """The CPU this thread runs on now (Linux: field 39 of ``/proc/thread-self/stat``), else ``None``."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def emulation_probe(emulator: Optional[Emulator], device: torch.device) -> tuple[Optional[float], float]:
    """This rank's emulated speed (CUDA: its SM count; CPU: 1 / its slowdown; ``None``: not emulated) and the
    seconds a fixed set of matrix products takes under its emulation (as a step runs): across ranks the times
    should go as the inverse of the speeds."""
    from contextlib import nullcontext

    side = PROBE_SIDE["cuda" if device.type == "cuda" else "cpu"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(side, side, device=device, dtype=dtype)
    speed: Optional[float] = None
    if emulator is not None:
        emulated = emulator.device
        speed = float(emulated.num_sms or emulated.host_sms) if device.type == "cuda" else 1.0 / emulated.slowdown
    with emulator.work() if emulator is not None else nullcontext():
        (a @ a).sum().item()  # warm-up, on the emulated stream
    # The fastest of a few trials: one trial is tens of ms, and a busy host (another job's ranks beside this one)
    # once read an emulated 3090 at 1.98x an emulated A100's time where the same lab read 4.46x in another run.
    seconds = []
    for _ in range(PROBE_TRIALS):
        started = time.perf_counter()
        with emulator.work() if emulator is not None else nullcontext():
            for _ in range(PROBE_REPEATS):
                b = a @ a
            b.sum().item()  # waits for the device
        seconds.append(time.perf_counter() - started)
    return speed, min(seconds)


def carried_options(config: Any, target: str) -> dict[str, Any]:
    """The options of the config's own strategy (a ``class_path``/``init_args`` namespace) that ``target`` (an import
    path) also takes, e.g. ``capacities`` from a ``HeteroDDPStrategy`` config rehearsed as ``hetero_fsdp``."""
    import importlib
    import inspect

    init_args = config.get("init_args") if hasattr(config, "get") else None
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


def rehearsed_config(job: RankJob, config: Any) -> None:
    """Edit the parsed config (of the ``fit`` subcommand) into this rank's: its batch (solo runs), the strategy to
    rehearse (``--strategy``), the lab's cards as the strategy's ``emulate``."""
    from jsonargparse import Namespace

    if job.mode in LIGHTNING_MODES:
        return
    if job.batch_size is not None:
        # The loader's batch is the data module's, or (without one) the model's own `batch_size`; under a class
        # path, in its init_args.
        owner = config.get("data") or config.model
        (owner.init_args if isinstance(owner.get("init_args"), Namespace) else owner).batch_size = job.batch_size
    trainer = config.trainer
    strategy = trainer.get("strategy")
    named = entry_of(strategy) if isinstance(strategy, str) else None
    if named is not None:  # a registry name (`strategy: hetero_fsdp`): its class, with its defaults
        trainer.strategy = strategy = Namespace(class_path=named.class_path, init_args=Namespace())
    if job.strategy is not None and not (isinstance(strategy, Namespace)
                                         and strategy.get("class_path") == job.strategy):
        kept = {**SUBSTITUTED_DEFAULTS.get(job.strategy, {}), **carried_options(strategy, job.strategy)}
        trainer.strategy = strategy = Namespace(class_path=job.strategy, init_args=Namespace(**kept))
    if not (isinstance(strategy, Namespace) and "Hetero" in str(strategy.get("class_path"))):
        raise ValueError(f"`trainer.strategy` of {job.config!r} is not a lightning_hetero strategy: give "
                         f"`--strategy {'|'.join(names())}`.")
    strategy.init_args.emulate = job.lab
    if job.memory is not None:
        strategy.init_args.memory = job.memory


def trainer_overrides(job: RankJob, model: Any, root: str) -> dict[str, Any]:
    """The ``Trainer`` arguments of a rehearsed rank: one device, node ``r`` of the lab's ``N``, ``job.steps`` steps,
    nothing saved; Lightning's own strategies for the baselines."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_hetero.plan.blocks import default_blocks

    overrides: dict[str, Any] = dict(
        accelerator=job.accelerator, devices=1, num_nodes=len(job.lab), max_steps=job.steps, max_epochs=-1,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    lightning = LIGHTNING_MODES.get(job.mode)
    if lightning == "ddp":
        overrides["strategy"] = DDPStrategy()
    elif lightning == "fsdp":
        # `memory="offload"` on a Lightning run: its own CPU offload of every parameter (the baseline for models
        # that do not fit the cards).
        overrides["strategy"] = FSDPStrategy(auto_wrap_policy=set(default_blocks(model)),
                                             cpu_offload=job.memory == "offload")
    return overrides


@contextmanager
def rehearsed_cli(job: RankJob, root: str, built: Callable[[Any], None]) -> Iterator[None]:
    """Every ``LightningCLI`` built inside (the generic one, or the user's script's own) parses as usual, then
    rehearses this rank: the config edited by :func:`rehearsed_config` before its classes are instantiated, the
    ``Trainer`` built with :func:`trainer_overrides`; ``built(cli)`` sees each CLI once its trainer exists, before
    anything is fitted."""
    from lightning.pytorch.cli import LightningCLI

    instantiate_classes, instantiate_trainer = LightningCLI.instantiate_classes, LightningCLI.instantiate_trainer

    def rehearsed_classes(cli: Any) -> None:
        rehearsed_config(job, cli.config[cli.subcommand] if cli.subcommand else cli.config)
        instantiate_classes(cli)
        built(cli)

    def rehearsed_trainer(cli: Any, **kwargs: Any) -> Any:
        return instantiate_trainer(cli, **{**kwargs, **trainer_overrides(job, cli.model, root)})

    LightningCLI.instantiate_classes, LightningCLI.instantiate_trainer = rehearsed_classes, rehearsed_trainer
    try:
        yield
    finally:
        LightningCLI.instantiate_classes, LightningCLI.instantiate_trainer = instantiate_classes, instantiate_trainer


def fit_config(job: RankJob) -> None:
    """The config through a generic LightningCLI (its model and data named by ``class_path``), then ``fit``."""
    import yaml
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    with open(job.config) as f:
        has_data = "data" in (yaml.safe_load(f) or {})
    cli = LightningCLI(LightningModule, LightningDataModule if has_data else None, subclass_mode_model=True,
                       subclass_mode_data=True, save_config_callback=None, run=False, args=["--config", job.config])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def fit_script(job: RankJob) -> None:
    """The user's own LightningCLI script, run here as ``python SCRIPT fit --config CONFIG`` would run it."""
    import runpy

    assert job.script is not None
    sys.argv = [job.script, "fit", "--config", job.config]
    # The script's folder first on the path, as `python SCRIPT` has it: its own modules import.
    sys.path.insert(0, os.path.dirname(os.path.abspath(job.script)))
    runpy.run_path(job.script, run_name="__main__")


def out_of_memory(err: BaseException) -> Optional[BaseException]:
    """The out-of-memory error ``err`` is, or was raised from: a pipeline stage's forward (``torch.distributed.
    pipelining``) raises its errors again as a ``RuntimeError``."""
    seen: set[int] = set()
    cause: Optional[BaseException] = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, torch.OutOfMemoryError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def record_plan(result: RankResult, job: RankJob, strategy: Any) -> None:
    """What the rank's strategy chose: its plan, split and share (ours: its memory plan, and under the hybrid layout
    its part in it), or Lightning's equal batches."""
    if job.mode in ("hetero", "shared", "solo", "real"):
        plan = strategy.plan.as_dict()
        result.split, result.capacity_source = plan["split"], plan["capacity_source"]
        result.capacities_asked = strategy.plan.spec.source
        result.global_batch = plan["global_batch_size"]
        ours = observed(strategy)
        memory_plan = ours.memory_plan if ours is not None else None
        result.memory_modes = [p.mode for p in memory_plan] if memory_plan else None
        result.estimated_bytes = memory_plan[job.rank].needed if memory_plan else None
        result.blocks = memory_plan[job.rank].blocks if memory_plan else None
        result.estimate_source = memory_plan[job.rank].source if memory_plan else None
        result.keep_gathered = memory_plan[job.rank].keep_gathered if memory_plan else None
        result.plan = result.memory_modes[job.rank] if result.memory_modes else "replica"
    else:
        result.global_batch = (result.batch or 0) * len(job.lab)
        result.plan = "replica" if LIGHTNING_MODES.get(job.mode) == "ddp" else "full shard"
    if result.global_batch and result.batch:
        result.share = (result.split[job.rank] if result.split else result.batch) / result.global_batch
    ours = observed(strategy)
    if ours is not None and ours.pipeline_ranks is not None:
        record_layout(result, strategy)


def record_layout(result: RankResult, strategy: Any) -> None:
    """The hybrid layout's part of this rank (``strategy``: a fitted ``HeteroHybridStrategy``): the pipelines, and for
    a stage rank its stage, its pipeline's share of the global batch and the micro-batches of its step."""
    from lightning_hetero.plan.layout import micro_batch_count

    layout = strategy.layout
    result.pipelines = [list(p) for p in layout.pipelines]
    pipeline = layout.pipeline_of(result.rank)
    if pipeline is None or strategy.replica is None or not result.split or not result.global_batch:
        return
    samples = sum(result.split[r] for r in pipeline)
    result.stage = strategy.replica.stage
    result.share = samples / result.global_batch
    replica = strategy.replica
    result.micro_batches = micro_batch_count(samples, len(pipeline), replica.micro_batches, replica.least_micro_batch)
    result.plan = f"stage {result.stage} of pipeline {layout.pipelines.index(pipeline)}"


def run_rank(job: RankJob) -> RankResult:
    """Build the config's Trainer as rank ``job.rank`` of the lab and train ``job.steps`` steps (in this process).

    A script that exits (its own argument errors, a ``SystemExit``) ends the process without a result: the
    launcher reads the error from the rank's output."""
    from lightning_hetero._compat import init_fake_process_group

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
    emulator: Optional[Emulator] = None
    clis: list[Any] = []

    def built(cli: Any) -> None:
        clis.append(cli)
        params = list(cli.model.parameters())
        result.parameters = sum(p.numel() for p in params)
        result.param_bytes = sum(p.numel() * p.element_size() for p in params)
        cli.trainer.callbacks.append(_probe(result, device, emulator))
        precision = str(getattr(cli.trainer.precision_plugin, "precision", "32-true"))
        element = 2 if ("16" in precision and "32" not in precision) else 4
        result.compute_bytes = result.parameters * element
        if LIGHTNING_MODES.get(job.mode) == "fsdp":
            from lightning_hetero.plan.blocks import default_blocks, top_level_blocks

            # The blocks Lightning's FSDPStrategy wraps here (`trainer_overrides`), each gathered on its own.
            result.blocks = len(top_level_blocks(cli.model, default_blocks(cli.model))) or None

    try:
        # "real": the strategy creates its own process group (NCCL on CUDA), as in a run of the lab itself.
        if job.mode == "shared":
            # Without a device binding (Lightning's would pass `device_id`): several ranks share this one device.
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port + 1}", rank=job.rank,
                                    world_size=world)
        elif job.mode in LIGHTNING_MODES:
            if job.mode in ("ddp", "fsdp"):
                # Lightning's own strategies keep an initialised process group (the fake one) instead of creating
                # theirs; run for real ("real_ddp", "real_fsdp") they create it, over the link the emulator set.
                init_fake_process_group(job.rank, world)
            # The card's memory cap and SM share (CPU: slowdown), as our strategy's emulator applies them.
            if device.type == "cuda":
                torch.cuda.set_device(device)
            emulator = start_emulation(parse_emulate(job.lab) or (), job.rank, world, host_device(device), device)
            if emulator is not None:
                emulator.activate()
        with rehearsed_cli(job, root, built):
            if job.script:
                fit_script(job)
            else:
                fit_config(job)
        if not clis:
            raise RuntimeError(f"`--script` {job.script!r} built no LightningCLI: the rehearsal needs one")
        trainer = clis[-1].trainer
        result.ok = True
        record_plan(result, job, trainer.strategy)
    except Exception as err:  # reported per rank; the doctor goes on with the next one
        result.failed_at = time.time()
        oom = out_of_memory(err)
        if oom is not None:
            result.oom, result.error = True, str(oom).splitlines()[0]
            if clis:
                # The plan was made before the step that ran out of memory: the report names the rank's part in it.
                with suppress(Exception):
                    record_plan(result, job, clis[-1].trainer.strategy)
        else:
            import traceback

            traceback.print_exc()  # whole in the rank's log
            result.error = f"{type(err).__name__}: {user_message(err)}"
    if device.type == "cuda":
        result.peak_allocated_bytes = torch.cuda.max_memory_allocated(0)
        result.peak_reserved_bytes = torch.cuda.max_memory_reserved(0)
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    result.host_rss_bytes, result.involuntary_switches = usage.ru_maxrss * 1024, usage.ru_nivcsw
    shutil.rmtree(root, ignore_errors=True)
    with open(job.out, "w") as f:
        json.dump(asdict(result), f)
    return result

if __name__ == "__main__":
    from lightning_hetero.observe.errors import run_main

    payload = json.loads(sys.argv.pop(1))
    run_main(lambda: run_rank(RankJob(**payload)), "lightning-hetero doctor --lab (rehearsed rank)")
