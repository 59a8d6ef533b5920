"""Shares that follow the measured speed of every rank: profiling at start, live rebalancing, exact resume.

:class:`ShareController` is what :class:`~lightning_hetero.strategies.ddp.HeteroDDPStrategy` calls into:

- when the training loader is built (before its first batch is drawn) it restores the shares of a resumed run and
  where in the epoch it stopped, or profiles the model (:mod:`lightning_hetero.plan.profiling`) and applies the measured
  shares from batch 0;
- with ``rebalance=True`` a :class:`StepTimer` measures each step's compute time (from ``training_step`` start to the
  end of its local backward, minus time blocked in collectives the strategy issues inside the step; data loading and
  the gradient all-reduce wait are outside that window), and every ``rebalance_every`` batches all ranks exchange their
  measurements in one ``all_gather``. Every rank then updates the same exponential moving average of per-rank
  throughput and takes the same decision (:func:`propose`): new shares only when the measured rates predict them to
  shorten the step by more than ``rebalance_threshold``, keyed to a global-batch index past every rank's prefetched
  batches.

It reads the strategy through a :class:`~lightning_hetero.view.StrategyView` and writes capacities, caps and share
changes into the :class:`~lightning_hetero.plan.shares.SharePlan` (their one owner).

Example::

    controller = ShareController(view, plan, lab, rebalance=True, every=20, threshold=0.05, smoothing=0.5)
    rank_states.register("shares", controller)
"""

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import lightning_hetero._compat as _compat
from lightning_hetero.lab.setup import LabSetup
from lightning_hetero.plan.profiling import ProfileResult, profile_lightning_module, table_columns
from lightning_hetero.plan.shares import SharePlan
from lightning_hetero.plan.split import split_batch
from lightning_hetero.view import StrategyView


class PlannedSampler(Protocol):
    """What the controller reads of the training batch sampler (``data/sampler.py``), which reads the plan."""

    sampler: Any
    rank: int
    world_size: int
    global_batch_size: int
    batches_yielded: int
    start_batch: int

    @property
    def capacities(self) -> tuple[float, ...]: ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], start_batch: int = 0) -> None: ...


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
            f"HeteroDDPStrategy rebalance from global batch {self.first_batch}: split [{old}] -> [{new}] "
            f"(step predicted {self.gain:.1%} shorter, {self.moved:.1%} of the batch moves; measured samples/s "
            f"[{rates}])"
        )


def propose(
    current: Sequence[float],
    throughput: Sequence[float],
    global_batch_size: int,
    caps: Optional[Sequence[int]],
    threshold: float,
) -> Optional[tuple[list[int], list[int], float, float]]:
    """(old split, new split, moved fraction, gain) when the split by measured ``throughput`` (samples/s) is
    predicted to make the step more than ``threshold`` shorter than the split by ``current`` capacities; else
    ``None``. The gain is 1 - new step / old step, each the slowest rank's share over its rate.

    Gating on the step rather than on how many samples move keeps a rate ratio that wanders around a rounding point
    from moving a sample back and forth: near that point both splits take about as long.
    """
    old = split_batch(global_batch_size, current, caps)
    new = split_batch(global_batch_size, throughput, caps)
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
    """Profiling, live rebalancing and the checkpointed share state of one training run.

    ``state_dict`` holds the profile, the rebalancer's moving average and counters, and the train sampler's share
    schedule; the sampler's position is Lightning's restored batch progress (checked against the saved one).
    """

    def __init__(
        self,
        view: StrategyView,
        plan: SharePlan,
        lab: LabSetup,
        profile: bool = False,
        profile_steps: int = 4,
        memory_headroom: float = 0.1,
        max_batch_per_rank: Optional[int] = None,
        rebalance: bool = False,
        every: int = 20,
        threshold: float = 0.05,
        smoothing: float = 0.5,
    ) -> None:
        self.view = view
        self.plan = plan
        self.lab = lab
        self.profile_enabled = profile
        self.profile_steps = profile_steps
        self.memory_headroom = memory_headroom
        self.max_batch_per_rank = max_batch_per_rank
        self.rebalance = rebalance
        self.every = every
        self.threshold = threshold
        self.smoothing = smoothing
        self.profile: Optional[ProfileResult] = None
        self._slept_mark = 0.0  # the emulator's cumulative sleep at the last step boundary
        self.sampler: Optional[PlannedSampler] = None
        self.timer: Optional[StepTimer] = None
        self.ema: Optional[list[float]] = None
        self.batches_seen = 0
        self.position = 0  # batches of the current epoch whose step has run
        self.decisions: list[Decision] = []
        self._window = [0.0, 0.0]  # samples, compute seconds since the last exchange
        self._last_samples = 0  # real samples of the step being timed
        self._skip_next = True  # the first step after (re)start warms up allocators and caches
        self._restored: Optional[dict[str, Any]] = None
        self._expect_batch: Optional[int] = None
        self._devices: Optional[list[str]] = None  # the lab's device classes, saved to detect changed cards

    @property
    def caps(self) -> Optional[tuple[int, ...]]:
        """Per-rank memory caps (the plan's)."""
        return self.plan.caps

    # -- checkpoint ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "profile": None if self.profile is None else self.profile.state_dict(),
            "caps": None if self.caps is None else list(self.caps),
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "ema": self.ema,
            "batches_seen": self.batches_seen,
            "position": self.position,
            "devices": self._devices,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Applied when the training loader is built (Lightning restores callbacks before that).
        self._restored = dict(state)

    def reshard(self, states: list[Optional[dict[str, Any]]], rank: int, world_size: int) -> Optional[dict[str, Any]]:
        """A checkpoint of another world size: keep the global position (epoch, global batch index, global batch
        size) and plan shares anew for the ranks that are here. Every rank's saved copy is the same."""
        state = next((s for s in states if s is not None), None)
        if state is None:
            return None
        sampler = state.get("sampler")
        return {
            "position": state.get("position", 0),
            "sampler": None if sampler is None else {**sampler, "changes": None},
            "replan": f"the checkpoint was written by {len(states)} ranks, this job has {world_size}",
        }

    # -- start of training -----------------------------------------------------------------------------------------
    def on_train_loader(self, sampler: PlannedSampler, dataloader: Any) -> None:
        """Before the loader's first batch is drawn: restore a resumed run's shares, or profile (a collective)."""
        self.sampler = sampler
        plan = self.plan
        trainer = self._trainer()
        restored, self._restored = self._restored, None
        if restored is None and trainer.fit_loop.restarting:  # e.g. a checkpoint of Lightning's `DDPStrategy`
            restored = {"replan": "the checkpoint holds no share state (another strategy wrote it)"}
        self._devices = [d.device_class for d in self.lab.lab.devices]
        replan = None if restored is None else _replan_reason(restored, self._devices)
        if restored is not None:
            self._restore(restored, sampler, trainer, replan is not None)
            if replan is not None:
                rank_zero_info(f"HeteroDDPStrategy resume: {replan}; shares are planned for this lab "
                               f"(capacities '{plan.source}').")
        if restored is None or replan is not None:
            # One rank has nobody to share with: profiling it would only delay the first step.
            if self.profile_enabled and self.profile is None and sampler.world_size > 1:
                self.profile = self._run_profile(sampler, dataloader)
                if self.profile is not None:
                    plan.set_caps(self.profile.caps)
                    plan.update(self.profile.capacities, "profile")
            if plan.caps is None and self.max_batch_per_rank is not None:
                plan.set_caps((self.max_batch_per_rank,) * sampler.world_size)
            # The latest shares (profiled, or rebalanced before a loader reload) from the loader's first batch.
            plan.change(plan.capacities, first_batch=0, epoch=sampler.sampler.epoch)
        kept = restored is not None and replan is None
        plan.update(sampler.capacities, "restored" if kept else plan.source)
        if self.profile is not None:
            self.lab.add_columns(table_columns(self.profile))
        elif plan.caps is not None:
            self.lab.add_columns({"mem cap": [str(c) for c in plan.caps]})
        if self.rebalance and self.timer is None:
            self.timer = StepTimer(self.view.root_device)
        self._skip_next = True

    def _trainer(self) -> Any:
        module = self.view.lightning_module
        assert module is not None
        return module.trainer

    def _run_profile(self, sampler: PlannedSampler, dataloader: Any) -> Optional[ProfileResult]:
        view = self.view
        module = view.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            rank_zero_warn("HeteroDDPStrategy: manual optimization cannot be profiled; keeping "
                           f"'{self.plan.source}' capacities.")
            return None
        order = list(sampler.sampler)  # the epoch's order from its own generator: nothing global advances
        # Up to a whole global batch: a refinement pass may time this rank at its (possibly large) share.
        need = sampler.global_batch_size
        offset = sampler.rank * max(1, need // sampler.world_size)
        indices = [order[(offset + i) % len(order)] for i in range(need)]
        emulator = self.lab.emulation
        result = profile_lightning_module(
            module,
            dataloader.dataset,
            dataloader.collate_fn,
            indices,
            sampler.global_batch_size,
            view.root_device,
            forward_context=view.precision_plugin.forward_context,
            steps=self.profile_steps,
            headroom=self.memory_headroom,
            max_batch_per_rank=self.max_batch_per_rank,
            optimizers=view.optimizers,
            step_context=emulator.work if emulator is not None else _nothing,
            classes=[d.device_class for d in self.lab.lab.devices],
        )
        if result is None:
            rank_zero_warn("HeteroDDPStrategy: `training_step` returned no loss to time; keeping "
                           f"'{self.plan.source}' capacities.")
            return None
        rates = ", ".join(f"{c:.4g}" for c in result.capacities)
        rank_zero_info(f"HeteroDDPStrategy profiled the model in {result.cost_s:.2f} s: samples/s [{rates}]"
                       + (f", memory caps {list(result.caps)}" if result.caps else ""))
        return result

    def _restore(self, state: dict[str, Any], sampler: PlannedSampler, trainer: Any, replan: bool) -> None:
        if not replan:  # measurements of other devices (or another world size) say nothing about these
            self.profile = None if state.get("profile") is None else ProfileResult.from_state_dict(state["profile"])
            self.plan.set_caps(state["caps"] if state.get("caps") else None)
            self.ema = state.get("ema")
            self.batches_seen = int(state.get("batches_seen", 0))
        saved_g = (state.get("sampler") or {}).get("global_batch_size")
        explicit_g = self.plan.global_batch_size
        if saved_g is not None and explicit_g is not None and saved_g != explicit_g:
            raise ValueError(
                f"`global_batch_size`={explicit_g} but the checkpoint was trained with a global batch of {saved_g}: "
                "the position in the epoch and the optimizer's hyper-parameters refer to it. Leave "
                "`global_batch_size` unset (the checkpoint's is kept) or start a new run."
            )
        if saved_g is not None and saved_g != sampler.global_batch_size:
            rank_zero_info(f"HeteroDDPStrategy resume: keeping the checkpoint's global batch of {saved_g} samples "
                           f"(the loader's batch_size x {sampler.world_size} ranks would give "
                           f"{sampler.global_batch_size}).")
            sampler.global_batch_size = int(saved_g)  # before counting the epoch's batches below
        fit_loop = trainer.fit_loop
        # Lightning restarts a map-style loader from its first batch but continues batch_idx from its restored
        # progress (`ready`); the sampler skips exactly those batches so index k is still global batch k.
        start = fit_loop.epoch_loop.batch_progress.current.ready if fit_loop.restarting else 0
        epoch = fit_loop.epoch_progress.current.processed
        limit = trainer.limit_train_batches
        batches = len(sampler) if isinstance(limit, float) and limit == 1.0 else (
            min(len(sampler), limit) if isinstance(limit, int) else int(len(sampler) * limit))
        # A stream without a length knows its last batch only from Lightning's saved `is_last_batch`.
        if start >= batches or (start and fit_loop.epoch_loop.batch_progress.is_last_batch):
            # Saved after the epoch's last batch: Lightning closes that epoch and draws the next one from the
            # iterator it creates now, so that iterator must already be the next epoch's, from its first batch.
            start, epoch = 0, epoch + 1
        if state.get("sampler") is not None:
            # On a changed lab the saved shares are dropped: this lab's are planned after this.
            sampler.load_state_dict({**state["sampler"], "changes": None} if replan else state["sampler"],
                                    start_batch=start)
        else:
            sampler.start_batch = start
            if start:
                rank_zero_warn(
                    f"HeteroDDPStrategy resume: the checkpoint stopped at batch {start} of epoch {epoch} but holds no "
                    "sampler state of this strategy, so which samples that epoch had drawn is unknown. The epoch goes "
                    f"on from global batch {start} of this strategy's order: some of its samples may repeat or be "
                    "missed. From the next epoch on every sample is seen once."
                )
        sampler.sampler.set_epoch(epoch)
        self.position = start
        self._expect_batch = start if start else None

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
        if self._expect_batch is not None:
            expected, self._expect_batch = self._expect_batch, None
            if batch_idx != expected:
                raise RuntimeError(
                    f"HeteroDDPStrategy resumed its sampler at global batch {expected} but Lightning resumed at "
                    f"batch_idx {batch_idx}; samples would be lost or repeated."
                )
        self.position = batch_idx + 1
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
        current = self.sampler.capacities
        proposal = propose(current, self.ema, self.sampler.global_batch_size, self.caps, self.threshold)
        if proposal is None:
            return None
        old, new, moved, gain = proposal
        first = max(int(max(y for _, _, y in rows)), batch_idx + 1)
        return Decision(first, tuple(current), tuple(self.ema), tuple(old), tuple(new), moved, gain)

    def _apply(self, decision: Decision) -> None:
        assert self.sampler is not None
        self.plan.change(decision.new_capacities, first_batch=decision.first_batch, epoch=self.sampler.sampler.epoch)
        self.plan.update(decision.new_capacities, "rebalanced")
        self.decisions.append(decision)
        self._skip_next = True
        trainer = self._trainer()
        if self.view.global_rank == 0:
            rank_zero_info(decision.message())
            if trainer.logger is not None:
                metrics = {f"hetero/share_rank{r}": b / sum(decision.new_split) for r, b in enumerate(decision.new_split)}
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


def _replan_reason(state: dict[str, Any], devices: list[str]) -> Optional[str]:
    """Why a restored share state cannot be kept on this lab (``None``: same world size and cards)."""
    if state.get("replan"):
        return str(state["replan"])
    saved = state.get("devices")
    if saved is not None and list(saved) != devices:
        return f"the devices changed ({', '.join(saved)} -> {', '.join(devices)})"
    return None


@contextmanager
def _nothing() -> Iterator[None]:
    yield
