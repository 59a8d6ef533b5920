"""Shares that follow the measured speed of every rank: live rebalancing.

:class:`ShareController` is the rebalancing decision of :class:`~lightning_hetero.strategies.core.HeteroCore`
(``strategy.share_controller``). With ``rebalance=True`` a :class:`StepTimer` measures each step's compute time (from
``training_step`` start to the end of its local backward, minus time blocked in collectives the strategy issues inside
the step; data loading and the gradient all-reduce wait are outside that window), and every ``rebalance_every``
batches all ranks exchange their measurements in one ``all_gather``. Every rank then updates the same exponential
moving average of per-rank throughput and takes the same decision (:func:`propose`): new shares only when the
measured rates predict them to shorten the step by more than ``rebalance_threshold``, keyed to a global-batch index
past every rank's prefetched batches.

The shares it starts from are restored or profiled before the training loader's first batch
(:class:`~lightning_hetero.plan.state.ShareState`, :class:`~lightning_hetero.plan.profile_run.ShareProfiler`). It
reads the strategy through a :class:`~lightning_hetero.view.StrategyView` and writes share changes into the
:class:`~lightning_hetero.plan.shares.SharePlan` (their one owner).

Example::

    controller = ShareController(view, plan, lab, profiler, rebalance=True, every=20, threshold=0.05, smoothing=0.5)
    controller.start(train_sampler)  # then on_train_batch_start(batch_idx, samples) at every batch
"""

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_hetero._compat as _compat
from lightning_hetero.plan.profile_run import ShareProfiler
from lightning_hetero.plan.profiling import ProfileResult
from lightning_hetero.plan.shares import LabView, PlannedSampler, SharePlan
from lightning_hetero.plan.split import split_batch
from lightning_hetero.view import StrategyView
from lightning_hetero.view import running_strategy


def when_backward_ends(loss: torch.Tensor, callback: Callable[[], None]) -> None:
    """Call ``callback`` once the backward that ``loss`` will start has accumulated every gradient (register before
    it starts). A hook on the loss queues it on autograd's engine, which runs queued callbacks after the backward's
    last gradient and before DDP's own end-of-backward callback waits for the gradient all-reduce (in the order they
    were queued, DDP's when its last bucket is ready). On CUDA the engine runs it on the stream ``backward()`` was
    called from, after syncing it with every stream the backward used. Two Python calls a backward, whatever the
    number of parameters or the order they finish in."""

    def queue(grad: torch.Tensor) -> None:
        _compat.queue_after_backward(callback)

    loss.register_hook(queue)


class StepTimer:
    """Compute seconds of one training step on this rank, waits excluded.

    The step's compute ends where its local backward does: :meth:`watch` marks it with :func:`when_backward_ends`
    (on CUDA one event recorded on the stream the backward was called from).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._active = False
        self._start: Any = None
        self._end: Any = None
        self._excluded = 0.0
        if self._cuda:  # re-recorded each step
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._end_event = torch.cuda.Event(enable_timing=True)

    def watch(self, loss: Any) -> None:
        """Mark the end of the backward that ``loss`` will start (call before it does; ignored outside a step)."""
        if self._active and isinstance(loss, torch.Tensor) and loss.requires_grad:
            when_backward_ends(loss, self.mark_end)

    def mark_end(self) -> None:
        """This step's backward ends now (the latest call of a step wins)."""
        if not self._active:
            return
        if self._cuda:
            self._end_event.record()  # a later backward of the same step (micro-batches) records it again
            self._end = self._end_event
        else:
            self._end = time.perf_counter()

    def start(self) -> None:
        self._active = True
        self._end, self._excluded = None, 0.0
        if self._cuda:
            self._start_event.record()
            self._start = self._start_event
        else:
            self._start = time.perf_counter()

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Time inside is not compute (a collective issued from within the step, before its backward ends)."""
        if not self._active or self._end is not None:
            yield
            return
        if self._cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize(self.device)
            self._excluded += time.perf_counter() - t0

    def end_mark(self) -> Any:
        """The step's backward-end mark without waiting for it: a ``perf_counter`` value or a recorded CUDA event
        (``None`` if no gradient was accumulated since :meth:`start`)."""
        return self._end

    def stop(self) -> Optional[float]:
        """Seconds of the step begun by :meth:`start` (``None`` if it had no backward). Call after the step."""
        if not self._active:
            return None
        self._active = False
        if self._end is None:
            return None
        if self._cuda:
            self._end.synchronize()
            seconds = self._start.elapsed_time(self._end) / 1000.0
        else:
            seconds = self._end - self._start
        return max(seconds - self._excluded, 1e-9)


@dataclass(frozen=True)
class Decision:
    """A share change every rank takes identically."""

    first_batch: int
    old_capacities: tuple[float, ...]
    new_capacities: tuple[float, ...]
    old_split: tuple[int, ...]
    new_split: tuple[int, ...]
    moved: float  # fraction of the global batch that changes rank
    gain: float  # fraction by which the measured rates predict the step to shorten

    def message(self) -> str:
        old = ", ".join(f"{s}" for s in self.old_split)
        new = ", ".join(f"{s}" for s in self.new_split)
        rates = ", ".join(f"{c:.4g}" for c in self.new_capacities)
        return (
            f"{running_strategy()} rebalance from global batch {self.first_batch}: split [{old}] -> [{new}] "
            f"(step predicted {self.gain:.1%} shorter, {self.moved:.1%} of the batch moves; measured samples/s "
            f"[{rates}])"
        )


def propose(
    current: Sequence[float],
    throughput: Sequence[float],
    global_batch_size: int,
    caps: Optional[Sequence[int]],
    threshold: float,
    minimum: int = 1,
) -> Optional[tuple[list[int], list[int], float, float]]:
    """(old split, new split, moved fraction, gain) when the split by measured ``throughput`` (samples/s) is
    predicted to make the step more than ``threshold`` shorter than the split by ``current`` capacities; else
    ``None``. The gain is 1 - new step / old step, each the slowest rank's share over its rate. ``minimum``: the
    fewest samples the loader gives a rank (the share plan's), so both splits are the ones the loader cuts.

    Gating on the step rather than on how many samples move keeps a rate ratio that wanders around a rounding point
    from moving a sample back and forth: near that point both splits take about as long.
    """
    old = split_batch(global_batch_size, current, caps, minimum)
    new = split_batch(global_batch_size, throughput, caps, minimum)
    gain = 1.0 - predicted_step(new, throughput) / predicted_step(old, throughput)
    if gain <= threshold:
        return None
    moved = sum(max(0, n - o) for n, o in zip(new, old)) / global_batch_size
    return old, new, moved, gain


def predicted_step(split: Sequence[int], throughput: Sequence[float]) -> float:
    """Seconds the slowest rank takes for its share at the given samples/s: the step time of a synchronous step."""
    return max(b / rate for b, rate in zip(split, throughput))


def gather_measurements(values: Sequence[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), in rank order: one ``all_gather``."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


class ShareController:
    """Live rebalancing of one training run: step timing, the measurement exchange and the share decision.

    Profiling at start is :class:`~lightning_hetero.plan.profile_run.ShareProfiler`'s, the checkpointed share state
    and the resume :class:`~lightning_hetero.plan.state.ShareState`'s; this class saves only its moving average and
    counters into that state.
    """

    def __init__(
        self,
        view: StrategyView,
        plan: SharePlan,
        lab: LabView,
        profiler: ShareProfiler,
        rebalance: bool = False,
        every: int = 20,
        threshold: float = 0.05,
        smoothing: float = 0.5,
    ) -> None:
        self.view = view
        self.plan = plan
        self.lab = lab
        self.profiler = profiler
        self.rebalance = rebalance
        self.every = every
        self.threshold = threshold
        self.smoothing = smoothing
        self._slept_mark = 0.0  # the emulator's cumulative sleep at the last step boundary
        self.sampler: Optional[PlannedSampler] = None
        self.timer: Optional[StepTimer] = None
        self.ema: Optional[list[float]] = None
        self.batches_seen = 0
        self.decisions: list[Decision] = []
        self._window = [0.0, 0.0]  # samples, compute seconds since the last exchange
        self._last_samples = 0  # real samples of the step being timed
        self._skip_next = True  # the first step after (re)start warms up allocators and caches

    @property
    def profile(self) -> Optional[ProfileResult]:
        """The profiling record (rates and caps measured at start); the capacities in force are the plan's."""
        return self.profiler.profile

    @property
    def caps(self) -> Optional[tuple[int, ...]]:
        """Per-rank memory caps (the plan's)."""
        return self.plan.caps

    # -- checkpoint (part of the share state, plan/state.py) ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state.get("ema")
        self.batches_seen = int(state.get("batches_seen", 0))

    def start(self, sampler: PlannedSampler) -> None:
        """The training loader is built (its shares restored or planned): time its steps from the next one on."""
        self.sampler = sampler
        if self.rebalance and self.timer is None:
            self.timer = StepTimer(self.view.root_device)
        self._skip_next = True

    def _trainer(self) -> Any:
        module = self.view.lightning_module
        assert module is not None
        return module.trainer

    # -- every training batch --------------------------------------------------------------------------------------
    def step_started(self) -> None:
        if self.timer is not None:
            self.timer.start()

    def backward_started(self, loss: Any) -> None:
        if self.timer is not None:
            self.timer.watch(loss)

    def excluded(self) -> Any:
        return self.timer.excluded() if self.timer is not None else _nothing()

    def on_train_batch_start(self, batch_idx: int, local_samples: int) -> None:
        """Account the previous step; every ``every`` batches exchange measurements and maybe rebalance."""
        if self.timer is None or self.sampler is None:
            return
        seconds = self.timer.stop()
        emulator = self.lab.emulation
        if emulator is not None:
            # The CPU emulator's slowdown sleeps after the step, outside the timed window; it stands for compute.
            slept, self._slept_mark = emulator.slept_seconds - self._slept_mark, emulator.slept_seconds
            seconds = None if seconds is None else seconds + slept
        if seconds is not None and self._last_samples > 0 and not self._skip_next:
            self._window[0] += self._last_samples
            self._window[1] += seconds
        self._skip_next = False
        self._last_samples = local_samples
        self.batches_seen += 1
        if self.batches_seen % self.every == 0:
            decision = self.exchange(batch_idx)
            if decision is not None:
                self._apply(decision)

    def exchange(self, batch_idx: int) -> Optional[Decision]:
        """The one collective of a rebalancing round and the decision every rank derives from it."""
        assert self.sampler is not None
        rows = gather_measurements([*self._window, float(self.sampler.batches_yielded)], self.view.root_device)
        self._window = [0.0, 0.0]
        if any(samples <= 0 or seconds <= 0 for samples, seconds, _ in rows):
            return None  # some rank measured nothing this round (padding steps only)
        rates = [samples / seconds for samples, seconds, _ in rows]
        a = self.smoothing
        first_round = self.ema is None
        self.ema = rates if first_round else [a * r + (1 - a) * e for r, e in zip(rates, self.ema)]
        self._log_rates()
        if first_round:
            return None  # the first window carries start-up costs (allocator, kernel selection): never act on it alone
        current = self.plan.capacities
        proposal = propose(current, self.ema, self.sampler.global_batch_size, self.caps, self.threshold,
                           self.plan.min_share)
        if proposal is None:
            return None
        old, new, moved, gain = proposal
        first = max(int(max(y for _, _, y in rows)), batch_idx + 1)
        return Decision(first, tuple(current), tuple(self.ema), tuple(old), tuple(new), moved, gain)

    def _apply(self, decision: Decision) -> None:
        assert self.sampler is not None
        self.plan.adopt(decision.new_capacities, "rebalanced", caps=self.plan.caps, first_batch=decision.first_batch,
                        epoch=self.sampler.sampler.epoch)
        self.decisions.append(decision)
        self._skip_next = True
        trainer = self._trainer()
        if self.view.global_rank == 0:
            rank_zero_info(decision.message())
            if trainer.logger is not None:
                total = sum(decision.new_split)
                metrics = {f"hetero/share_rank{r}": b / total for r, b in enumerate(decision.new_split)}
                metrics["hetero/rebalance_moved"] = decision.moved
                metrics["hetero/rebalance_gain"] = decision.gain
                trainer.logger.log_metrics(metrics, step=trainer.global_step)

    def _log_rates(self) -> None:
        trainer = self._trainer()
        if self.view.global_rank == 0 and trainer.logger is not None and self.ema is not None:
            trainer.logger.log_metrics(
                {f"hetero/samples_per_s_rank{r}": v for r, v in enumerate(self.ema)}, step=trainer.global_step
            )

    def teardown(self) -> None:
        self.timer = None


@contextmanager
def _nothing() -> Iterator[None]:
    yield
