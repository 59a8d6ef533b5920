"""Live rebalancing: hysteresis on noise, convergence after a rank slows down, every sample once per epoch."""

import os
import random
import tempfile
import time
from collections import Counter
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.plan.rebalance import StepTimer, propose
from tests.helpers import TinyModel, free_port, retry_timing


def test_propose_has_hysteresis() -> None:
    # 2 % measured difference: the split hardly moves -> no change
    assert propose([1, 1], [1.0, 1.02], 32, None, threshold=0.05) is None
    old, new, moved, gain = propose([1, 1], [3.0, 1.0], 32, None, threshold=0.05)
    assert (old, new) == ([16, 16], [24, 8]) and moved == pytest.approx(0.25) and gain == pytest.approx(0.5)
    # caps still bound the new split
    assert propose([1, 1], [3.0, 1.0], 32, [20, 32], threshold=0.05)[1] == [20, 12]


def test_propose_gates_on_the_predicted_step_not_on_samples_moved() -> None:
    # 12/4 at rates 230:100: the split by rate is 11/5 (slow rank 50 ms, fast rank 47.8 ms) against 52.2 ms at 12/4,
    # a gain of 4.2 %. One sample is 6.25 % of the batch, but near the rounding point (2.4:1) both splits take about as
    # long and a wandering ratio moved that sample back and forth at each exchange (seen in CI): no move.
    assert propose([12, 4], [230.0, 100.0], 16, None, threshold=0.05) is None
    old, new, moved, gain = propose([12, 4], [230.0, 100.0], 16, None, threshold=0.04)
    assert new == [11, 5] and moved == pytest.approx(1 / 16) and gain == pytest.approx(1 - 50 / (12 / 0.23))
    # At 3:1 from 11/5 the step shortens by a fifth: that move happens.
    assert propose([11, 5], [330.0, 110.0], 16, None, threshold=0.05)[1] == [12, 4]
    # Many samples moving among ranks the step does not wait for gains nothing: no move.
    assert propose([1, 2, 0.01], [1.0, 1.0, 0.01], 10, None, threshold=0.05) is None


class TimedModel(TinyModel):
    """Sleeps per sample in forward: rank 1 ``factor`` times longer, ``late_factor`` from ``change_at`` steps on;
    ``jitter`` draws each step's sleep uniformly within ±jitter (its own RNG: training RNG untouched)."""

    def __init__(self, per_sample: float = 0.002, factor: float = 1.0, late_factor: float = 1.0,
                 change_at: int = 10**9, jitter: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self._jitter_rng = random.Random(1)

    def loss(self, batch: Any) -> torch.Tensor:
        h = self.hparams
        scale = 1.0
        if self.global_rank == 1:
            scale = h.factor if self.trainer.global_step < h.change_at else h.late_factor
        noise = 1.0 + h.jitter * (2 * self._jitter_rng.random() - 1)
        time.sleep(h.per_sample * scale * noise * len(batch[0]))
        return super().loss(batch)


class _Splits(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: list[tuple[int, int, int, list[int]]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        sampler = trainer.strategy.hetero.train_batch_sampler
        self.rows.append((trainer.current_epoch, batch_idx, sampler.split_at(batch_idx)[1],
                          [int(i) for i in batch[2]]))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        decisions = [(d.first_batch, d.new_split) for d in trainer.strategy.share_controller.decisions]
        torch.save({"rows": self.rows, "decisions": decisions},
                   os.path.join(self.out_dir, f"splits{trainer.global_rank}.pt"))


def _fit(model: LightningModule, epochs: int, **strategy_kwargs: Any) -> list[dict]:
    out = tempfile.mkdtemp()
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = HeteroDDPStrategy(start_method="fork", observation={"print_table": False}, resilience={"timeout": 120},
                                 capacities="equal",
                                 **strategy_kwargs)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, callbacks=[_Splits(out)],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return [torch.load(os.path.join(out, f"splits{r}.pt")) for r in range(2)]


def _each_index_once_per_epoch(records: list[dict], n: int, epochs: int) -> None:
    for epoch in range(epochs):
        seen = Counter(i for rec in records for e, _, _, idx in rec["rows"] if e == epoch for i in idx)
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, f"epoch {epoch}"


def test_rebalance_converges_after_slowdown_and_keeps_every_sample() -> None:
    n, epochs = 160, 3  # global batch 16 -> 10 steps per epoch

    def attempt(i: int) -> None:
        model = TimedModel(per_sample=0.002, factor=1.0, late_factor=3.0, change_at=6, batch_size=8, n=n)
        records = _fit(model, epochs, rebalance={"every": 3, "threshold": 0.05, "smoothing": 0.7})
        assert records[0]["decisions"] == records[1]["decisions"]
        _each_index_once_per_epoch(records, n, epochs)
        rank1 = [size for _, _, size, _ in records[0]["rows"]]
        # Rank 1 became 3x slower at step 6: its share goes to 16 / 4 = 4 samples, within a bounded number of steps.
        assert all(size == 8 for size in rank1[:6])
        settled = rank1[6 + 12:]  # four rebalancing rounds later
        assert settled and all(abs(size - 4) <= 1 for size in settled), rank1
        # No sample moves back and forth: after the slowdown, each decision only shrinks rank 1's share.
        rank1_shares = [8] + [split[1] for _, split in records[0]["decisions"]]
        assert all(b < a for a, b in zip(rank1_shares, rank1_shares[1:])), records[0]["decisions"]

    # The sleeps are the speeds; the host's noise comes on top: at load average 8 on 2 cores 3 fits of 10 moved a
    # sample back (13/3 then 12/4) or settled at 6. A fit outside the bands is run again.
    retry_timing(3, attempt)


def test_no_rebalance_on_noise() -> None:
    n, epochs = 160, 2

    def attempt(i: int) -> None:
        model = TimedModel(per_sample=0.002, jitter=0.3, batch_size=8, n=n)
        records = _fit(model, epochs, rebalance={"every": 4, "threshold": 0.1, "smoothing": 0.5})
        _each_index_once_per_epoch(records, n, epochs)
        assert records[0]["decisions"] == [] and records[1]["decisions"] == []
        assert all(size == 8 for _, _, size, _ in records[0]["rows"])

    # The injected jitter is ±30 %; a loaded host's late wake-ups come on top (1 fit of 5 moved a sample with two busy
    # loops beside a load average of 7-10 on 2 cores, none of 25 at load 2-9): a fit that rebalanced is run again.
    retry_timing(3, attempt)


class BusyModel(TinyModel):
    """Real CPU work per sample (the CPU emulator's slowdown is proportional to CPU time, not to sleeps)."""

    def loss(self, batch: Any) -> torch.Tensor:
        a = torch.full((192, 192), 0.01)
        for _ in range(2 * len(batch[0])):
            a = torch.tanh(a @ a)
        return super().loss(batch) + 0.0 * a.sum()


@pytest.mark.slow
def test_rebalance_sees_the_cpu_emulator_slowdown() -> None:
    """Rank 1 emulated 3x slower (it sleeps after each step): rebalancing moves its share from 8 towards 4.

    The emulator pauses twice the step's CPU time, so on a loaded host, where a step's wall time exceeds its CPU time,
    rank 1 is less than 3x slower (its share settled at 6 in 4 fits of 15 at load average 8 on 2 cores): slow, and a
    fit outside the band is run again."""
    n, epochs = 192, 2  # global batch 16 -> 12 steps per epoch

    def attempt(i: int) -> None:
        records = _fit(BusyModel(batch_size=8, n=n), epochs,
                       rebalance={"every": 3, "threshold": 0.05, "smoothing": 0.7}, emulate=[None, {"slowdown": 3.0}])
        assert records[0]["decisions"] == records[1]["decisions"]
        _each_index_once_per_epoch(records, n, epochs)
        rank1 = [size for _, _, size, _ in records[0]["rows"]]
        assert rank1[0] == 8 and max(rank1[-6:]) <= 5, rank1

    retry_timing(3, attempt)


class _FakeEvent:
    """Stands in for a CUDA event: counts its records."""

    def __init__(self) -> None:
        self.records = 0

    def record(self) -> None:
        self.records += 1


def test_step_timer_marks_the_end_of_backward_after_every_gradient_once_per_backward() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    pre = torch.nn.Linear(3, 3)  # on the input side when used: its gradients are accumulated after all of `net`'s
    accumulated: list = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: accumulated.append(time.perf_counter()))
             for p in [*net.parameters(), *pre.parameters()]]
    timer = StepTimer(torch.device("cpu"))

    def step(use_pre: bool) -> Any:
        accumulated.clear()
        timer.start()
        x = torch.randn(5, 3)
        loss = net(pre(x) if use_pre else x).sum()
        timer.watch(loss)
        loss.backward()
        return timer.end_mark()

    for use_pre in (False, True, False):  # the parameter that finishes last changes from one step to the next
        end = step(use_pre)
        assert len(accumulated) == (6 if use_pre else 4) and end >= max(accumulated)
    timer.start()
    assert timer.end_mark() is None  # no backward yet
    loss = net(torch.randn(2, 3)).sum()
    timer.stop()
    timer.watch(loss)  # outside a step: nothing is marked
    loss.backward()
    assert timer.end_mark() is None
    for h in hooks:
        h.remove()

    # The CUDA branch, with a fake event: one record per backward, not one per parameter.
    timer._cuda = True
    timer._start_event, timer._end_event = _FakeEvent(), _FakeEvent()
    timer.start()
    for _ in range(2):  # two backwards in one step (micro-batches): the second one's record is the end
        loss = net(pre(torch.randn(5, 3))).sum()
        timer.watch(loss)
        loss.backward()
    assert timer._end_event.records == 2 and timer.end_mark() is timer._end_event


def test_step_timer_marks_the_end_before_ddp_waits_for_the_all_reduce(tmp_path: Any) -> None:
    """A comm hook whose all-reduce takes 0.3 s: the end mark is the local backward's, not the all-reduce's."""
    import threading

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def slow_all_reduce(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future = torch.futures.Future()
        threading.Timer(0.3, lambda: future.set_result(bucket.buffer())).start()
        return future

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(8, 2))
        model.register_comm_hook(None, slow_all_reduce)
        timer = StepTimer(torch.device("cpu"))
        for _ in range(2):  # DDP rebuilds its buckets after the first backward
            timer.start()
            loss = model(torch.randn(4, 8)).sum()
            timer.watch(loss)
            began = time.perf_counter()
            loss.backward()
            returned = time.perf_counter()
            end = timer.end_mark()
            assert returned - began >= 0.3 and began < end < returned - 0.25, (began, end, returned)
    finally:
        dist.destroy_process_group()


def test_propose_judges_the_splits_the_loader_cuts_under_a_least_share() -> None:
    """With BatchNorm trained unsynced the loader never gives a rank fewer than 2: both splits respect it."""
    old, new, _, _ = propose([1, 1], [30.0, 1.0], 16, None, threshold=0.05, minimum=2)
    assert old == [8, 8] and new == [14, 2]
    assert propose([1, 1], [30.0, 1.0], 16, None, threshold=0.05)[1] == [15, 1]
