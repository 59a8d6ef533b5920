"""``HeteroMonitor``: where every rank's time goes, logged through the Trainer's own logger.

Each optimizer step is one *cycle* on every rank: from the moment the previous gradient all-reduce released the ranks
to the moment this one does. A cycle lasts equally long on every rank (a collective ends for all at once) and splits
into:

- **data**: the time between two batches: the loader's fetch of the next batch, its copy to the device and Lightning's
  per-batch work (measured from the callback hooks alone; Lightning's per-batch stop-flag broadcast is part of it, so
  a rank whose optimizer update finished early waits there too);
- **compute**: forward, backward up to this rank's last local gradient, the optimizer update (on CPU ranks emulating a
  slower card, its slowdown pause too);
- **sync**: time inside collectives: the gradient all-reduce after the local backward ended and collectives issued
  inside the step (``self.log(..., sync_dist=True)``).

Sync is split across ranks: the rank that arrived last at the collectives waited for nobody, so its sync time is the
**exposed communication** of the step, the same for every rank; whatever a rank spent in sync beyond that is **wait**,
time lost to slower ranks (what capacity-weighted shares exist to remove). That is exact when one rank is last at every
collective of the step. Ranks exchange their per-step records only on logging steps (one ``all_gather`` every
``log_every_n_steps``), so the step itself gains no collective.

Timing uses ``time.perf_counter`` on CPU and CUDA events on GPUs (recorded in the step, read on logging steps: no
synchronize per step). The step's hooks only append marks to an event log, turned into per-step rows on logging
steps. The local backward's end is marked by HeteroDDPStrategy's comm hook as the last bucket enters it, or under
other strategies by a callback autograd runs once the backward's last gradient is accumulated
(:func:`~lightning_hetero.plan.rebalance.when_backward_ends`). With ``nvidia-ml-py`` installed (extra ``monitor``),
GPU utilisation, memory, power, temperature, SM clock and thermal throttling come from NVML.

Rank 0 logs, per logging window (``r`` = rank): ``monitor/compute_s_rank{r}``, ``wait_s``, ``data_s``, ``comm_s``
(means per step), ``monitor/busy_rank{r}`` (compute ÷ step), ``monitor/solo_samples_per_s_rank{r}`` (samples ÷
compute: the rank's rate if it never waited), ``monitor/share_rank{r}``, ``monitor/step_s``, ``monitor/samples_per_s``,
``monitor/tokens_per_s`` (when the batch's first tensor holds token ids: an integer tensor of two or more dimensions),
``monitor/ideal_fraction`` (samples/s ÷ Σ solo rates), ``monitor/comm_compute_ratio`` (exposed communication ÷ the
slowest rank's compute), and the NVML values (``gpu_util_rank{r}``, ``mem_gib``, ``power_w``, ``temp_c``,
``sm_clock_mhz``, ``thermal_throttle``); ``monitor/exchange_s_rank{r}`` and ``monitor/comm_bytes_rank{r}`` where
the strategy times or counts them (see below). It also appends every window to ``hetero_monitor.jsonl`` in the logger's
``log_dir`` (no file without a logger that has one), which ``python -m lightning_hetero report LOGDIR`` plots, and
prints a summary table at the end of ``fit`` with, under it, the advice that would make steps at least 10 % shorter
(busy < 85 %: shares or more loader workers; exposed communication > 0.3 × compute: compression or bucket size, or
under the hybrid layout the stage exchange's overlap and compression), each with its expected gain.

A stage rank of a pipelined replica (``HeteroHybridStrategy``) also reports its schedule's step: its micro-batches'
compute (``stage_compute``), its pipeline transfers (``sendrecv``) and its time idle waiting for a neighbour stage
(``bubble``), timed by :class:`~lightning_hetero.observe.stage_times.StageTimer`; its compute column is what remains
of its step without them. The summary names each stage rank's pipeline and stage.

Under ``HeteroHybridStrategy`` every rank also reports its part of the stage gradient exchange: ``exchange``, the time
it was blocked in it after its backward (:meth:`HeteroMonitor.timed_exchange`: the late all-reduces and the waits on
those begun during the backward; a part of its sync, between the backward's end and the release), and
``comm_bytes``, the bytes it handed to it (each held stage's buffer). ``comm_bytes`` comes from any strategy that
counts its gradient collectives' bytes (``comm_bytes_last_step``: HeteroDDPStrategy's comm hooks too).

Example::

    trainer = Trainer(strategy=HeteroDDPStrategy(), callbacks=[HeteroMonitor()])   # or observation={"monitor": True}
"""

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_hetero.observe.analysis import STEP_FIELDS
from lightning_hetero.observe.nvml import nvml_handle, nvml_readings
from lightning_hetero.observe.stage_times import NO_STAGE, STAGE_EVENT, StageTimer, merge_stage, stage_fields
from lightning_hetero.plan.rebalance import when_backward_ends
from lightning_hetero.observe.windows import SIDECAR, WindowRecord
from lightning_hetero.view import ObservedStrategy, observed

__all__ = ["SIDECAR", "HeteroMonitor"]

# The step's hooks only read the clock and append one tuple to the rank's event log; :class:`_StepRows` turns the log
# into rows on logging steps. (In a 2-core VM's training loop every Python call or object a hook makes costs several
# microseconds, on both ranks' critical path: work that can wait for the logging step does.)
_START = 0  # (kind, mark, samples, tokens): a batch starts
_RELEASE = 1  # (kind, mark, backward-end mark or None): after the closure: the gradient all-reduce is done
_END = 2  # (kind, mark): the batch ends
_COLLECTIVE = 3  # (kind, begin, end): a collective issued from within the step
_EXCLUDED = 4  # (kind, begin, end): validation inside training, part of no step
_EXCHANGE = 5  # (kind, begin, end): the monitor's own exchange, counted as sync of the next step
# STAGE_EVENT = 6 (kind, begin, end, pieces): a pipeline stage rank's schedule step (observe/stage_times.py)
_GRAD_EXCHANGE = 7  # (kind, begin, end): the strategy's gradient exchange after the backward (timed_exchange)
_BYTES = 8  # (kind, bytes): what the rank handed to the step's gradient collectives (the strategy's count)
_INTERVALS = (_COLLECTIVE, _EXCLUDED, _EXCHANGE, STAGE_EVENT, _GRAD_EXCHANGE)


class _Step:
    """One optimizer step of this rank being assembled from the event log (seconds and counts)."""

    __slots__ = ("origin", "release", "backward_end", "gaps", "colls", "excluded", "samples", "tokens", "stage",
                 "exchange", "nbytes")

    def __init__(self, origin: Any) -> None:
        self.origin = origin  # the previous step's release: the step starts when the ranks were let go
        self.release: Any = None
        self.backward_end: Any = None
        self.gaps = self.colls = self.excluded = 0.0
        self.samples = self.tokens = 0
        self.stage: tuple[float, ...] = NO_STAGE  # a pipeline stage rank's schedule steps in it
        self.exchange = 0.0  # time in the strategy's timed gradient exchange
        self.nbytes = math.nan  # bytes of the step's gradient collectives (NaN: the strategy counts none)

    def row(self, seconds: Callable[[Any, Any], float]) -> tuple[float, ...]:
        data = self.gaps - self.excluded if self.gaps > self.excluded else 0.0
        tail = seconds(self.backward_end, self.release) if self.backward_end is not None else 0.0
        # The timed exchange runs between the backward's end and the release: part of that wait, or all of it
        # where no backward end was marked.
        sync = self.colls + max(tail, self.exchange, 0.0)
        return (seconds(self.origin, self.release) - self.excluded, data, sync, self.samples, self.tokens,
                *self.stage, self.exchange, self.nbytes)


class _StepRows:
    """Replays the event log into one row (``STEP_FIELDS``) per completed optimizer step. What spans two logging
    windows stays here: the last release and batch end, intervals owed to the next step, a step still open."""

    def __init__(self, seconds: Callable[[Any, Any], float]) -> None:
        self.seconds = seconds
        self.last_release: Any = None
        self.last_end: Any = None
        self.owed_sync = 0.0  # exchanges since the last batch end: sync of the next step
        self.owed_excluded = 0.0  # validation since the last batch end
        self.open: Optional[_Step] = None

    def rows(self, events: Sequence[tuple]) -> list[float]:
        """Row after row, flat, for the steps the events complete."""
        seconds, step, flat = self.seconds, self.open, []
        for event in events:
            kind = event[0]
            if kind == _START:
                _, mark, samples, tokens = event
                if step is None:
                    step = _Step(self.last_release if self.last_release is not None else mark)
                if self.last_end is not None:
                    step.gaps += seconds(self.last_end, mark)
                    self.last_end = None
                step.colls += self.owed_sync
                step.excluded += self.owed_excluded
                self.owed_sync = self.owed_excluded = 0.0
                step.samples += samples
                step.tokens += tokens
            elif kind == _RELEASE:
                if step is not None and step.release is None:  # a second optimizer: the first one's release counts
                    step.release, step.backward_end = event[1], event[2]
            elif kind == _END:
                self.last_end = event[1]
                if step is not None and step.release is not None:  # else an accumulating batch: the step goes on
                    flat += step.row(seconds)
                    self.last_release, step = step.release, None
            elif kind == _COLLECTIVE:
                if step is not None:  # between batches it is part of the gap, which counts as sync anyway
                    step.colls += seconds(event[1], event[2])
            elif kind == _EXCLUDED:
                self.owed_excluded += seconds(event[1], event[2])
            elif kind == STAGE_EVENT:
                if step is not None:
                    fields = stage_fields(event[1], event[2], event[3], seconds)
                    step.stage = fields if step.stage is NO_STAGE else merge_stage(step.stage, fields)
            elif kind == _GRAD_EXCHANGE:
                if step is not None:
                    step.exchange += seconds(event[1], event[2])
            elif kind == _BYTES:
                if step is not None:
                    step.nbytes = float(event[1])
            elif kind == _EXCHANGE and self.last_end is not None:
                self.owed_sync += seconds(event[1], event[2])
                self.last_end = event[2]
        self.open = step
        return flat


class HeteroMonitor(Callback):
    """Per-rank compute, wait, data-loading and exposed communication time of every training step.

    Args:
        every_n_steps: optimizer steps between exchanges (and logged windows); ``None``: the Trainer's
            ``log_every_n_steps``.
        warmup_steps: first optimizer steps left out of the advice and the summary (allocator, caches).
        warn: print advice at the end of ``fit`` (rank 0, under the summary): only what would make steps at least
            10 % shorter over the steps after warm-up, with the expected gain; never as warnings.
        summary: print the table at the end of ``fit`` (rank 0; with ``rich`` when installed).
        nvml: read NVML on CUDA ranks when ``nvidia-ml-py`` is installed.
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        warmup_steps: int = 1,
        warn: bool = True,
        summary: bool = True,
        nvml: bool = True,
    ) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"`every_n_steps`={every_n_steps!r} must be a positive integer or None.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"`warmup_steps`={warmup_steps!r} must be a non-negative integer.")
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.warn = warn
        self.summary = summary
        self.nvml = nvml
        self.record = WindowRecord(warmup_steps)  # rank 0: the fit's logged windows, their sums, the sidecar
        self._pipelines: Optional[list[list[int]]] = None  # the job's pipelined replicas (global ranks, stage order)
        self._reset_run()

    def _reset_run(self) -> None:
        self._running = False
        self._marks_from_hook = False  # the strategy's comm hook marks the backward's end (else a hook on the loss)
        self._strategy: Optional[ObservedStrategy] = None
        self._every = 1
        self._device = torch.device("cpu")
        self._events: list[tuple] = []  # this window's events (see _START ...), replayed on logging steps
        self._push = self._events.append
        self._rows = _StepRows(self._seconds)
        self._released = False  # an optimizer step was taken in this batch
        self._backward_end: Any = None  # this batch's backward-end mark (CUDA: one event, re-recorded per bucket)
        self._steps_done = 0
        self._unexchanged = 0  # completed steps not yet exchanged
        self._count_tokens = True  # until the first batch shows whether its first tensor holds token ids
        self._path: Optional[tuple[Any, ...]] = None  # keys from a batch to its first tensor
        self._nvml_handle: Any = None
        self._validation_began: Any = None

    # -- clock ------------------------------------------------------------------------------------------------------
    def _mark(self) -> Any:
        """Now, on this rank's clock: ``time.perf_counter()`` on CPU, a recorded CUDA event on GPUs."""
        if self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        if a is None or b is None:
            return 0.0
        if self._device.type == "cuda":
            return a.elapsed_time(b) / 1000.0
        return b - a

    @staticmethod
    def _host_seconds(a: Optional[float], b: Optional[float]) -> float:
        return 0.0 if a is None or b is None else b - a

    def timed_collective(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``collective(*args, **kwargs)``, a collective issued from within the step, timed as sync (the strategy
        runs its weighted ``reduce`` through this)."""
        begin = self._mark()
        out = collective(*args, **kwargs)
        self._push((_COLLECTIVE, begin, self._mark()))
        return out

    def timed_exchange(self, exchange: Callable[..., Any], *args: Any) -> Any:
        """``exchange(*args)``, the strategy's gradient exchange after the backward (its late collectives, its wait on
        those begun during the backward), timed as the rank's exchange time, a part of its sync."""
        begin = self._mark()
        out = exchange(*args)
        self._push((_GRAD_EXCHANGE, begin, self._mark()))
        return out

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run()
        self.record.close()
        self.record = WindowRecord(self.warmup_steps)
        self._device = trainer.strategy.root_device
        for name in ("_mark", "_seconds", "_backward_ended"):
            self.__dict__.pop(name, None)
        if self._device.type != "cuda":  # host clock: no device check per mark
            self._mark = time.perf_counter  # type: ignore[method-assign]
            self._seconds = self._host_seconds  # type: ignore[method-assign]
            self._backward_ended = self._backward_ended_on_host  # type: ignore[method-assign]
        self._rows = _StepRows(self._seconds)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._running = True
        strategy = self._strategy = observed(trainer.strategy)
        self._every = self.every_n_steps or max(1, trainer.log_every_n_steps)
        # HeteroDDPStrategy's comm hook marks the backward's end for free; other strategies: a hook on the loss.
        self._marks_from_hook = strategy is not None and strategy.observe_backward_end(self._backward_ended)
        self._pipelines = None
        if strategy is not None:
            strategy.attach_monitor(self)
            # HeteroHybridStrategy: a stage rank of a pipelined replica times its schedule's steps.
            self._pipelines = strategy.pipeline_ranks or None
            strategy.observe_pipeline_stage(StageTimer(self._mark, self._push))
        if self.nvml and self._device.type == "cuda":
            self._nvml_handle = nvml_handle(self._device)
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        if trainer.global_rank == 0 and log_dir:  # without a logger (or one without a log_dir): no file
            self.record.open_sidecar(log_dir)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        samples = self._strategy.train_step_size if self._strategy is not None else None
        tokens = 0
        if samples is None or self._count_tokens:
            samples, tokens = self._counts(batch, samples)
        self._push((_START, self._mark(), samples, tokens))
        self._backward_end = None

    def _counts(self, batch: Any, samples: Optional[int]) -> tuple[int, int]:
        """(samples, tokens) from the batch's first tensor, searched for once and looked up by its keys after."""
        first = _at(batch, self._path)
        if first is None:
            self._path = _first_tensor_path(batch)
            first = _at(batch, self._path)
        samples, tokens = _counts_of(first, samples)
        if self._path is not None and first is not None:
            self._count_tokens = tokens > 0  # by the first batch: a loader yields batches of one structure
        return samples, tokens

    def _backward_ended(self) -> None:
        """Called as each gradient bucket is ready (or once at the backward's end): the last call of a batch counts.
        On CUDA one event per batch is recorded again (a new event per bucket cost ~3 ms a step on GPT-2 small)."""
        if self._backward_end is None:
            self._backward_end = torch.cuda.Event(enable_timing=True)
        self._backward_end.record()

    def _backward_ended_on_host(self) -> None:
        self._backward_end = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._running and not self._marks_from_hook and isinstance(loss, torch.Tensor) and loss.requires_grad:
            when_backward_ends(loss, self._backward_ended)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Lightning calls this after the closure: forward, backward and DDP's gradient all-reduce are done.
        self._push((_RELEASE, self._mark(), self._backward_end))
        self._released = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = self._mark()
        if self._released:  # the strategy's byte count of the step's gradient collectives, where it keeps one
            nbytes = self._strategy.comm_bytes_last_step if self._strategy is not None else None
            if nbytes is not None:
                self._push((_BYTES, nbytes))
        self._push((_END, end))
        if self._released:  # else an accumulating batch: the step goes on
            self._released = False
            self._steps_done += 1
            self._unexchanged += 1
            if self._steps_done % self._every == 0:
                self._exchange(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._running and not trainer.sanity_checking:
            self._validation_began = self._mark()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation runs between two training batches: its time belongs to no step.
        if self._validation_began is not None:
            self._push((_EXCLUDED, self._validation_began, self._mark()))
            self._validation_began = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._unexchanged:
            self._exchange(trainer)
        self._stop_watching(trainer)
        if trainer.global_rank == 0:
            self.record.print_end(observed(trainer.strategy), self.summary, self.warn, self._pipelines)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_watching(trainer)

    def _stop_watching(self, trainer: Trainer) -> None:
        strategy = observed(trainer.strategy)
        if self._running and strategy is not None:
            if self._marks_from_hook:
                strategy.observe_backward_end(self._backward_ended, observe=False)
            strategy.attach_monitor(None)
            strategy.observe_pipeline_stage(None)
        self._running, self._marks_from_hook, self._strategy = False, False, None
        self.record.close()
        self._nvml_handle = None  # not picklable (the spawn launcher pickles the strategy that holds this callback)

    # -- the exchange on logging steps ------------------------------------------------------------------------------
    def _local_rows(self) -> list[float]:
        """This rank's steps since the last exchange, row after row (waits for the window's last CUDA event)."""
        events = self._events
        if self._device.type == "cuda" and events:
            last = events[-1]
            (last[2] if last[0] in _INTERVALS else last[1]).synchronize()
        flat = self._rows.rows(events)
        events.clear()
        self._unexchanged = 0
        return flat

    def _exchange(self, trainer: Trainer) -> None:
        begin = self._mark()
        flat = self._local_rows()
        steps = len(flat) // len(STEP_FIELDS)
        flat += nvml_readings(self._nvml_handle)
        world = trainer.world_size
        if world > 1 and dist.is_available() and dist.is_initialized():
            packed = torch.tensor(flat, dtype=torch.float32 if self._device.type == "cuda" else torch.float64,
                                  device=self._device)
            parts = [torch.empty_like(packed) for _ in range(world)]
            dist.all_gather(parts, packed)
            gathered = [part.tolist() for part in parts]
        else:
            gathered = [flat]
        # The exchange is a collective too: the next step counts it as sync, not as data loading.
        self._push((_EXCHANGE, begin, self._mark()))
        if trainer.global_rank == 0 and steps > 0:
            width = len(STEP_FIELDS)
            table = [[values[i * width:(i + 1) * width] for i in range(steps)] for values in gathered]
            self.record.add(trainer, table, [values[steps * width:] for values in gathered], self._steps_done,
                            self._pipelines)

    @property
    def windows(self) -> list[dict[str, Any]]:
        """Rank 0: every logged window of the last fit (what the sidecar holds)."""
        return self.record.windows

    @property
    def totals(self) -> Optional[dict[str, list[float]]]:
        """Rank 0: the last fit's sums per rank after warm-up."""
        return self.record.totals


def _counts_of(first: Optional[torch.Tensor], samples: Optional[int]) -> tuple[int, int]:
    """(samples, tokens): ``samples`` when the strategy counted them, else the first tensor's length; tokens when the
    first tensor is an integer tensor of two or more dimensions (token ids: batch × sequence)."""
    tokens = 0
    if first is not None and first.dim() >= 2 and not first.is_floating_point() and not first.is_complex() \
            and first.dtype != torch.bool:
        tokens = int(first.shape[0] * first.shape[1])
    if samples is None:
        samples = (int(first.shape[0]) if first.dim() else 1) if first is not None else 0
    return int(samples), tokens


def _first_tensor_path(batch: Any) -> Optional[tuple[Any, ...]]:
    """Keys and indices that lead from ``batch`` to its first tensor (token ids first in a mapping), or ``None``."""
    if isinstance(batch, torch.Tensor):
        return ()
    if isinstance(batch, Mapping):
        for key in ("input_ids", "tokens", "input"):
            if isinstance(batch.get(key), torch.Tensor):
                return (key,)
        items: Any = batch.items()
    elif isinstance(batch, (list, tuple)):
        items = enumerate(batch)
    else:
        return None
    for key, item in items:
        rest = _first_tensor_path(item)
        if rest is not None:
            return (key, *rest)
    return None


def _at(batch: Any, path: Optional[tuple[Any, ...]]) -> Optional[torch.Tensor]:
    """The tensor at ``path`` in ``batch``; ``None`` when the batch has another structure."""
    if path is None:
        return None
    try:
        for key in path:
            batch = batch[key]
    except (KeyError, IndexError, TypeError):
        return None
    return batch if isinstance(batch, torch.Tensor) else None
