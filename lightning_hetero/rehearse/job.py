"""What one rehearsal process runs (:class:`RankJob`) and what it measured (:class:`RankResult`)."""

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_hetero.rehearse.timeline import RankPhases

# The steps of a rank not timed (compilation, allocator and cache warm-up).
WARMUP_STEPS = 2
# A step is host-bound when the device had finished its work by the time the host issued the step's last of it: the
# host then waits for the device less than this share of the step (medians over the timed steps).
HOST_BOUND_WAIT = 0.01
# Modes that run the job for real, rank r alone on GPU r with its own process group (NCCL), each rank emulated as its
# card: ours, Lightning's DDPStrategy, Lightning's FSDPStrategy.
REAL_MODES = ("real", "real_ddp", "real_fsdp")
# Lightning's strategy each of its modes runs (rehearsed on the fake process group, or for real).
LIGHTNING_MODES = {"ddp": "ddp", "fsdp": "fsdp", "real_ddp": "ddp", "real_fsdp": "fsdp"}


@dataclass(frozen=True)
class RankJob:
    """What one rehearsal process runs: ``mode`` is ``"hetero"`` (the config's strategy, or ``strategy``), ``"ddp"``
    or ``"fsdp"`` (Lightning's, equal batches), all with the fake process group; the honesty checks also run
    ``"shared"`` (our strategy for real: the lab's ranks together on this one device, gloo), ``"real"`` (our strategy
    for real, rank ``r`` alone on the machine's GPU ``r``, with its own process group: NCCL), ``"real_ddp"`` and
    ``"real_fsdp"`` (Lightning's, likewise) and ``"solo"`` (one card alone, a world of one, ``batch_size`` its
    rehearsed batch)."""

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
    # The user's LightningCLI script the config belongs to (None: a generic CLI over the config's class paths).
    script: Optional[str] = None
    # The GPU (of those visible) the rank's process gets alone; None: the first (rehearsals), rank r (real runs).
    gpu: Optional[int] = None
    # A sharded strategy's `memory` rule for every rank ("keep", "offload:4", ...); None: the config's. Lightning's
    # FSDP ("real_fsdp") takes "offload" only: its CPU offload of every parameter.
    memory: Optional[str] = None


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
    # A sharded strategy's blocks kept gathered from forward to backward (its memory plan's `keep_gathered`).
    keep_gathered: Optional[bool] = None
    card_memory_bytes: Optional[int] = None
    local_memory_bytes: Optional[int] = None
    peak_allocated_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    # CUDA: the peak before the first step (set-up, sharding) and after each step, to tell where the peak was reached.
    setup_peak_bytes: Optional[int] = None
    step_peak_bytes: list[int] = field(default_factory=list)
    # CUDA, per step: the peak so far at the forward's end, the backward's end and the step's end (the allocator's
    # host-side count: no synchronisation), to tell in which phase of which step the peak was reached.
    phase_peak_bytes: list[list[int]] = field(default_factory=list)
    host_rss_bytes: Optional[int] = None
    # The strategy's own estimate of this rank's device memory under its plan (a sharded strategy's memory plan).
    estimated_bytes: Optional[int] = None
    step_seconds: list[float] = field(default_factory=list)
    # Per step, how long the host waited for the device at the step's end: near 0 when the host is the bottleneck.
    device_wait_seconds: list[float] = field(default_factory=list)
    parameters: Optional[int] = None
    param_bytes: Optional[int] = None
    compute_bytes: Optional[int] = None
    device: Optional[str] = None
    # The blocks a sharded strategy gathers one at a time (its memory plan's; Lightning's FSDP: the blocks it
    # wraps), for the step's timeline.
    blocks: Optional[int] = None
    # Where the memory plan's estimate came from: "formula", or measured before training ("allocator", ...).
    estimate_source: Optional[str] = None
    # The rank's emulation shown at work: its speed as emulated (CUDA: SMs; CPU: 1/slowdown; None: not emulated) and
    # the time of a fixed workload run under it before the first step, to hold against the other ranks'.
    emulated_speed: Optional[float] = None
    emulation_probe_seconds: Optional[float] = None
    # Per step, its phases in seconds: [forward, backward, the rest (the optimizer step)], timed on the device; for a
    # rank run for real they include its waits for the other ranks.
    phase_seconds: list[list[float]] = field(default_factory=list)
    # The same phases on the host clock (when the host issued each phase's last work): close to `phase_seconds` when
    # the step is host-bound, i.e. it timed this process's host, not the card.
    host_phase_seconds: list[list[float]] = field(default_factory=list)
    # Per step, the CPU the training thread ran on at its start (Linux; else empty), and the process's involuntary
    # context switches at its end: ranks whose host-bound steps shared a core, or were preempted, show it.
    step_cpus: list[int] = field(default_factory=list)
    involuntary_switches: Optional[int] = None
    # Per step, the host clock (`time.time`) at its start: ranks of one machine, compared, show whether they start
    # together.
    step_started_at: list[float] = field(default_factory=list)
    # Replicas rehearsed: DDP's gradient buckets in the order they were ready (bytes), and when, as a fraction of the
    # backward (the last timed step).
    bucket_bytes: list[int] = field(default_factory=list)
    bucket_ready: list[float] = field(default_factory=list)
    # The hybrid layout: its pipelines (global ranks, stage order), this rank's stage (None: a data-parallel
    # replica) and the micro-batches its pipeline's step runs; `share` is then its replica's (a pipeline's).
    pipelines: Optional[list[list[int]]] = None
    stage: Optional[int] = None
    micro_batches: Optional[int] = None
    # When the rank failed (`time.time`): of ranks run together, the first to fail tells why the others stopped.
    failed_at: Optional[float] = None

    @property
    def step_time(self) -> Optional[float]:
        timed = self.step_seconds[WARMUP_STEPS:] or self.step_seconds
        return statistics.median(timed) if timed else None

    @property
    def phases(self) -> Optional[RankPhases]:
        """The timed steps' median phases (and the buckets' ready points), or ``None`` where none were timed."""
        timed = self.phase_seconds[WARMUP_STEPS:] or self.phase_seconds
        if not timed:
            return None
        forward, backward, optimizer = (statistics.median(column) for column in zip(*timed))
        return RankPhases(forward, backward, optimizer, tuple(self.bucket_ready))

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

    @property
    def host_phases(self) -> Optional[list[float]]:
        """The timed steps' median phases on the host clock (see ``host_phase_seconds``), or ``None``."""
        timed = self.host_phase_seconds[WARMUP_STEPS:] or self.host_phase_seconds
        return [statistics.median(column) for column in zip(*timed)] if timed else None

    @property
    def peak_reached(self) -> Optional[str]:
        """Where the peak was first reached: ``"set-up"``, or ``"step 3 backward"`` (steps counted from 1; the
        phases of ``phase_peak_bytes``); ``None`` without the per-phase peaks."""
        if self.peak_allocated_bytes is None or not self.phase_peak_bytes:
            return None
        if self.setup_peak_bytes is not None and self.setup_peak_bytes >= self.peak_allocated_bytes:
            return "set-up"
        for step, peaks in enumerate(self.phase_peak_bytes, start=1):
            for phase, peak in zip(("forward", "backward", "rest"), peaks):
                if peak >= self.peak_allocated_bytes:
                    return f"step {step} {phase}"
        return "after the last step"
