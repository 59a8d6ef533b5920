"""HeteroMonitor: the time split of a window (unit), and on two CPU ranks with a 3x slower rank that the fast rank
waits about 2/3 of its step with equal shares and almost never with profiled shares, with totals matching wall time."""

import glob
import json
import math
import os
import time
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.observe.analysis import advice, analyse, summary_text
from lightning_hetero.observe.monitor import SIDECAR, HeteroMonitor
from tests.helpers import TinyModel, free_port, retry_timing


def _window(rows_rank0: list, rows_rank1: list) -> dict:
    return analyse(torch.tensor([rows_rank0, rows_rank1], dtype=torch.float64))


def test_analyse_splits_sync_into_wait_and_exposed_comm() -> None:
    # fields: cycle, data, sync, samples, tokens. Rank 1 computes 3x longer; both spend 1 s in data.
    w = _window([[10.0, 1.0, 6.5, 48, 0]] * 2, [[10.0, 1.0, 0.5, 16, 0]] * 2)
    assert w["comm"] == pytest.approx([0.5, 0.5])  # the last rank's sync: exposed communication
    assert w["wait"] == pytest.approx([6.0, 0.0])
    assert w["compute"] == pytest.approx([2.5, 8.5])
    assert w["busy"] == pytest.approx([0.25, 0.85])
    assert w["solo"] == pytest.approx([96 / 5.0, 32 / 17.0])
    assert w["samples_per_s"] == pytest.approx(128 / 20.0)
    assert w["ideal_fraction"] == pytest.approx((128 / 20.0) / (96 / 5.0 + 32 / 17.0))
    assert w["comm_compute_ratio"] == pytest.approx(1.0 / 17.0)
    assert w["tokens_per_s"] is None
    kinds = [k for k, _ in advice(w)]
    assert kinds == ["wait"]  # rank 0 waits 60%; rank 1 is 85% busy
    slow_links = _window([[10.0, 0.0, 5.0, 32, 0]], [[10.0, 0.0, 4.0, 32, 0]])
    messages = dict(advice(slow_links))
    assert "compression" in messages["comm"] and "bucket_cap_mb" in messages["comm"]
    starved = _window([[10.0, 3.0, 0.2, 32, 0]], [[10.0, 3.0, 0.2, 32, 0]])
    assert "num_workers" in dict(advice(starved))["data"]
    assert "up to 30% shorter steps (3e+03 of 1e+04 ms)" in dict(advice(starved))["data"]


def test_advice_only_where_it_pays_off() -> None:
    """A toy run's milliseconds: loading 0.4 ms of a 4 ms step (10 %, but below what a worker's hand-off costs),
    communication 0.6 ms (halved by compression: 7.5 %) and a wait balanced shares would save 0.2 ms: no advice."""
    toy = _window([[0.004, 0.0004, 0.0009, 56, 0]] * 3, [[0.004, 0.0004, 0.0006, 8, 0]] * 3)
    assert toy["wait"][0] == pytest.approx(0.0003) and toy["comm"][0] == pytest.approx(0.0006)
    assert advice(toy) == []
    # The same shape at 10 s steps: loading pays off, and is said with its gain.
    big = _window([[10.0, 3.0, 0.2, 32, 0]], [[10.0, 0.0, 0.2, 32, 0]])
    assert [k for k, _ in advice(big)] == ["data"]


def test_summary_and_token_rate() -> None:
    w = _window([[2.0, 0.0, 0.5, 4, 512]], [[2.0, 0.0, 0.5, 4, 512]])
    assert w["tokens_per_s"] == pytest.approx(1024 / 2.0)
    from lightning_hetero.observe.analysis import accumulate

    rows, foot = summary_text(accumulate(None, w))
    assert rows[0][0] == "0" and rows[0][1] == "50.0%" and "tokens/s" in foot and "of ideal" in foot
    ids = torch.zeros(4, 128, dtype=torch.long)
    tokens = HeteroMonitor()
    assert tokens._counts({"input_ids": ids, "labels": ids}, None) == (4, 512)
    assert tokens._path == ("input_ids",) and tokens._count_tokens
    assert tokens._counts({"input_ids": ids[:2, :8]}, None) == (2, 16)  # looked up by its key
    assert tokens._counts([ids[:3]], None) == (3, 384)  # another structure: searched again
    features = HeteroMonitor()
    assert features._counts((torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)), None) == (4, 0)
    assert not features._count_tokens  # no token ids: with the strategy's sample count the batch is not read again
    assert features._counts((torch.zeros(6, 8),), 5) == (5, 0)  # the strategy's count wins
    with pytest.raises(ValueError, match="every_n_steps"):
        HeteroMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="monitor"):
        HeteroDDPStrategy(observation={"monitor": "yes"})  # type: ignore[arg-type]


def test_event_log_replays_into_step_rows_across_windows() -> None:
    """The hooks' event log becomes one row per optimizer step: gaps with loader time, a collective inside the step,
    the wait after the backward's end (carried by the release), an accumulating batch, validation left out, the
    monitor's own exchange counted as sync of the next step, a second optimizer's release ignored; the same rows when
    a window ends mid-step; a timed gradient exchange inside the wait after the backward, and the step's bytes."""
    from lightning_hetero.observe.monitor import (_BYTES, _COLLECTIVE, _END, _EXCHANGE, _EXCLUDED, _GRAD_EXCHANGE,
                                                  _RELEASE, _START, _StepRows)

    events = [
        (_START, 0.0, 4, 0), (_COLLECTIVE, 0.2, 0.3), (_RELEASE, 1.0, 0.6), (_END, 1.1),
        (_EXCHANGE, 1.1, 1.3), (_EXCLUDED, 1.3, 1.8),  # the exchange after step 1, then validation
        (_START, 2.0, 4, 64), (_END, 2.6),  # accumulating: no release
        (_START, 2.7, 4, 64), (_COLLECTIVE, 2.71, 2.72), (_GRAD_EXCHANGE, 3.1, 3.3), (_RELEASE, 3.4, 3.0),
        (_RELEASE, 3.5, 3.45), (_BYTES, 4096), (_END, 3.6),
    ]
    # cycle, data, sync (collective + wait after the backward), samples, tokens; no pipeline stage (six zeros); no
    # timed exchange, no byte count (NaN)
    step1 = [1.0, 0.0, 0.1 + 0.4, 4, 0] + [0.0] * 6 + [0.0, math.nan]
    # Step 2 runs from step 1's release to its own, less validation (0.5 s); its gaps between batches (0.7 + 0.1 s
    # after the exchange, 0.5 of them validation) leave 0.3 s of data; sync = exchange + collective + wait, the timed
    # gradient exchange (0.2 s) a part of that wait.
    step2 = [3.4 - 1.0 - 0.5, 0.3, 0.2 + 0.01 + 0.4, 8, 128] + [0.0] * 6 + [0.2, 4096]
    whole = _StepRows(lambda a, b: b - a).rows(events)
    assert whole == pytest.approx(step1 + step2, nan_ok=True)
    for cut in (5, 8, 11, 14):
        rows = _StepRows(lambda a, b: b - a)
        assert rows.rows(events[:cut]) + rows.rows(events[cut:]) == pytest.approx(step1 + step2, nan_ok=True), cut


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_a_slow_loader_shows_as_data_time(tmp_path) -> None:
    """Data time is measured from the callback hooks alone: a loader that takes 40 ms a batch shows about that much
    data time a step (a monitor that missed the loader would see none of it)."""
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple:
            time.sleep(0.01)
            return torch.randn(8), torch.tensor(i % 4), i

    def attempt(i: int) -> None:
        monitor = HeteroMonitor()
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=12, log_every_n_steps=4, callbacks=[monitor],
                          logger=CSVLogger(tmp_path / str(i)), enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False)
        trainer.fit(TinyModel(), DataLoader(Slow(), batch_size=4))
        windows = monitor.windows[1:]  # the first window holds the loader's start
        data = sum(w["data"][0] * w["steps"] for w in windows) / sum(w["steps"] for w in windows)
        assert 0.035 <= data < 0.08, data

    # Wall-clock sleeps: a loaded host's late wake-ups can carry one fit past the band's top.
    retry_timing(3, attempt)


PER_SAMPLE = 0.012


class SleepyModel(TinyModel):
    """Sleeps ``per_sample`` seconds per sample in forward, 3x longer on rank 1: a card 3x slower on a model whose
    step is dominated by per-sample work (sleeps, not CPU: robust on a loaded machine)."""

    def __init__(self, per_sample: float = PER_SAMPLE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.per_sample = per_sample

    def loss(self, batch: Any) -> torch.Tensor:
        time.sleep(self.per_sample * (3.0 if self.global_rank == 1 else 1.0) * len(batch[0]))
        return super().loss(batch)


class _Releases(Callback):
    """Rank 0's wall clock at the first batch start and at every optimizer step's release."""

    def __init__(self, path: str) -> None:
        self.path, self.first, self.releases = path, None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.first = self.first or time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.releases.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump({"first": self.first, "releases": self.releases}, f)


def _fit(tmp_path, capacities: str) -> tuple[list[dict], dict]:
    os.environ["MASTER_PORT"] = str(free_port())
    out = str(tmp_path / capacities)
    strategy = HeteroDDPStrategy(start_method="fork", observation={"print_table": False, "monitor": True},
                                 resilience={"timeout": 120}, capacities=capacities, profiling={"steps": 2})
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, log_every_n_steps=3,
                      callbacks=[_Releases(os.path.join(out, "wall.json"))], logger=CSVLogger(out),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(SleepyModel(batch_size=16, n=32 * 8))
    (sidecar,) = glob.glob(os.path.join(out, "**", SIDECAR), recursive=True)
    with open(sidecar) as f:
        windows = [json.loads(line) for line in f]
    with open(os.path.join(out, "wall.json")) as f:
        return windows, json.load(f)


def _fraction(windows: list[dict], key: str, rank: int) -> float:
    """Share of rank's step time spent in ``key`` over every step after the first."""
    num = sum(w[key][rank] * w["steps"] for w in windows[1:])
    den = sum(w["cycle"][rank] * w["steps"] for w in windows[1:])
    return num / den


@pytest.mark.slow
def test_fast_rank_waits_two_thirds_with_equal_shares_and_not_with_profiled(tmp_path) -> None:
    equal, wall = _fit(tmp_path, "equal")
    assert sum(w["steps"] for w in equal) == 8 and equal[-1]["shares"] == [0.5, 0.5]
    # Every step's parts add up to the wall time rank 0 saw, from the first batch to the last release.
    measured = sum(w["cycle"][0] * w["steps"] for w in equal)
    assert measured == pytest.approx(wall["releases"][-1] - wall["first"], rel=0.10)
    for w in equal:
        for r in range(2):
            parts = w["compute"][r] + w["wait"][r] + w["data"][r] + w["comm"][r]
            assert parts == pytest.approx(w["cycle"][r], rel=1e-6)
    fast_wait = _fraction(equal, "wait", 0)
    print(f"\nequal shares: fast rank waits {fast_wait:.1%} of its step; slow rank {_fraction(equal, 'wait', 1):.1%}")
    print("windows:", [(w["steps"], [round(x, 4) for x in w["wait"]], [round(x, 4) for x in w["cycle"]])
                       for w in equal])
    # 2/3 when the per-sample work is all there is; the loop's own few milliseconds per step lower it a little.
    assert fast_wait == pytest.approx(2 / 3, abs=0.08)
    # The wait is the injected difference: rank 1 sleeps 2 x 16 samples x PER_SAMPLE longer per step.
    wait_s = sum(w["wait"][0] * w["steps"] for w in equal[1:]) / sum(w["steps"] for w in equal[1:])
    assert wait_s == pytest.approx(32 * PER_SAMPLE, rel=0.10)
    assert _fraction(equal, "wait", 1) < 0.05
    assert equal[-1]["ideal_fraction"] < 0.8

    profiled, _ = _fit(tmp_path, "profile")
    fast_wait = _fraction(profiled, "wait", 0)
    print(f"profiled shares {profiled[-1]['shares']}: fast rank waits {fast_wait:.1%}; "
          f"ideal fraction {profiled[-1]['ideal_fraction']:.2f}")
    assert profiled[-1]["shares"][0] == pytest.approx(0.75, abs=0.05)
    assert fast_wait < 0.15
    assert profiled[-1]["ideal_fraction"] > 0.85


def test_report_draws_png_from_sidecar(tmp_path, capsys) -> None:
    from lightning_hetero.__main__ import main

    run = tmp_path / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    with open(run / SIDECAR, "w") as f:
        for step, shares in ((5, (24, 8)), (10, (26, 6))):
            w = _window([[0.1, 0.01, 0.05, shares[0], 0]] * 5, [[0.1, 0.01, 0.01, shares[1], 0]] * 5)
            w.update(step=step, nvml={"temp_c": [70.0, None]})
            f.write(json.dumps(w) + "\n")
    main(["report", str(tmp_path)])
    png = run / "hetero_monitor.png"
    assert png.stat().st_size > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # a wrong directory: one line saying what to do, no traceback
        main(["report", str(tmp_path / "nothing")])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith("lightning-hetero report: error: no hetero_monitor.jsonl under")
    assert "observation={'monitor': True}" in said and "monitor=True" not in said


def test_doctor_model_command(tmp_path) -> None:
    from lightning_hetero.observe.doctor import dry_run_command

    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    config = os.path.join(root, "configs", "cpu_lab.yaml")
    cmd = dry_run_command(config, script="examples/train_digits.py", steps=8, root_dir=str(tmp_path))
    assert cmd[1] == "examples/train_digits.py" and cmd[2:5] == ["fit", "--config", config]
    assert "--trainer.max_steps=8" in cmd and "--trainer.callbacks+=lightning_hetero.HeteroMonitor" in cmd
    assert dry_run_command(config)[1:3] == ["-m", "lightning_hetero.observe.doctor"]
    with pytest.raises(ValueError, match="steps"):
        dry_run_command(config, steps=1)
    with pytest.raises(ValueError, match="config"):
        dry_run_command(str(tmp_path / "missing.yaml"))


class QuietSleepyModel(SleepyModel):
    """No ``self.log(..., sync_dist=True)``: the gradient all-reduce is the step's only collective."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)


@pytest.mark.parametrize("strategy_name", ["lightning_ddp", "hetero_ddp"])
def test_the_wait_in_the_gradient_all_reduce_follows_the_backward_end_mark(tmp_path, strategy_name: str) -> None:
    """The fast rank's wait is all in the gradient all-reduce, after the backward's end mark (without that mark it
    would be counted as compute). Under HeteroDDPStrategy the mark comes from its comm hook, under Lightning's DDP
    from a hook on the loss."""
    from lightning.pytorch.strategies import DDPStrategy

    def attempt(i: int) -> None:
        out = str(tmp_path / f"run{i}")
        os.environ["MASTER_PORT"] = str(free_port())
        strategy = (DDPStrategy(start_method="fork") if strategy_name == "lightning_ddp" else
                    HeteroDDPStrategy(start_method="fork", capacities="equal", observation={"print_table": False},
                                      resilience={"timeout": 120}))
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=7, log_every_n_steps=3,
                          callbacks=[HeteroMonitor(summary=False, warn=False)], logger=CSVLogger(out),
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(QuietSleepyModel(batch_size=8, n=16 * 7))
        (sidecar,) = glob.glob(os.path.join(out, "**", SIDECAR), recursive=True)
        with open(sidecar) as f:
            windows = [json.loads(line) for line in f]
        assert sum(w["steps"] for w in windows) == 7
        fast_wait = _fraction(windows, "wait", 0)
        print(f"\n{strategy_name}, equal batches, rank 1 3x slower: fast rank waits {fast_wait:.1%} of its step")
        assert fast_wait == pytest.approx(2 / 3, abs=0.1)
        assert _fraction(windows, "wait", 1) < 0.05

    # The sleeps are the speeds, the host's noise comes on top (the fast rank waited 52% in 1 fit of 20 at load
    # average 8 on 2 cores): a fit outside the band is run again.
    retry_timing(3, attempt)


def test_summary_table_is_whole_in_a_log_file(capsys) -> None:
    """Not a terminal (a log file, a pipe): rich cut the table to 80 columns ("ra…", "sha…", "5.038e+…")."""
    pytest.importorskip("rich")
    from lightning_hetero.observe.analysis import print_summary

    totals = {"compute": [0.5, 0.25], "wait": [0.01, 0.2], "data": [0.01, 0.01], "comm": [0.05, 0.05],
              "cycle": [0.6, 0.6], "samples": [2519000.0, 800000.0], "tokens": [0.0, 0.0], "steps": [10.0]}
    print_summary(totals, (6, 15))
    out = capsys.readouterr().out
    assert "…" not in out, out
    assert "steps 6-15 (after warm-up" in out
    for cell in ("rank", "share", "75.9%", "50.00 (83%)", "20.00 (33%)", "5.038e+06", "3.2e+06"):
        assert cell in out, (cell, out)


def test_warnings_name_their_steps_and_skip_what_the_run_does() -> None:
    w = _window([[10.0, 1.0, 6.5, 48, 0]] * 2, [[10.0, 1.0, 0.5, 16, 0]] * 2)
    w = {**w, "first_step": 5}
    plain = dict(advice(w))["wait"]
    assert plain.startswith("HeteroMonitor, steps 6-7: rank 0 computes only 25% of each step and waits 60%")
    # Balanced at the measured rates (96/5 and 32/17 samples/s) the slowest compute of 8.5 s would be 6.07 s.
    assert "up to 24% shorter steps (2.43e+03 of 1e+04 ms)" in plain, plain
    assert "capacities='profile' (or 'auto') and rebalance=True" in plain
    profiled = dict(advice(w, capacity_source="profile", rebalance=False))["wait"]
    assert "capacities=" not in profiled and "use rebalance=True" in profiled
    done = dict(advice(w, capacity_source="rebalanced", rebalance=True))["wait"]
    assert "capacities are measured and rebalanced already" in done and "use " not in done
    # The sharded strategy refuses profiled capacities and rebalancing: neither is advised there.
    sharded = dict(advice(w, capacity_source="peak", rebalance=False, sharded=True))["wait"]
    assert "use capacities in proportion to those speeds (a mapping or weights)" in sharded, sharded
    assert "profile" not in sharded and "rebalance" not in sharded
