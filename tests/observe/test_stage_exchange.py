"""The hybrid layout's stage gradient exchange in the monitor: each rank's time blocked in it (a part of its sync)
and the bytes it hands to it, from the event log (unit) to a 3-rank hybrid fit (rank 0 data-parallel, ranks 1 and
2 a 2-stage pipeline) whose window, metrics and summary show each holder's stage buffer."""

import csv
import glob
import math
import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_hetero.observe.analysis import accumulate, advice, analyse, summary_headers, summary_text
from lightning_hetero.observe.monitor import _BYTES, _END, _GRAD_EXCHANGE, _RELEASE, _START, HeteroMonitor, _StepRows
from lightning_hetero.observe.windows import window_metrics
from lightning_hetero.observe.report import find_sidecar, load_windows
from tests.strategies.test_hybrid import Chain, hybrid

NO_STAGE = [0.0] * 6


def test_without_a_backward_end_mark_the_timed_exchange_is_the_sync() -> None:
    """The exchange runs after the backward's end mark and before the release, so it is a part of that wait; where
    no end was marked it is the whole of it (and never counted twice)."""
    events = [(_START, 0.0, 4, 0), (_GRAD_EXCHANGE, 0.5, 0.8), (_RELEASE, 0.9, None), (_BYTES, 100), (_END, 1.0),
              (_START, 1.0, 4, 0), (_GRAD_EXCHANGE, 1.5, 1.6), (_RELEASE, 1.8, 1.4), (_END, 1.9)]
    rows = _StepRows(lambda a, b: b - a).rows(events)
    width = len(rows) // 2
    assert rows[:width] == pytest.approx([0.9, 0.0, 0.3, 4, 0] + NO_STAGE + [0.3, 100])
    # Step 2: the wait after the backward (0.4 s) holds the exchange (0.1 s); no byte count this step.
    assert rows[width:] == pytest.approx([0.9, 0.0, 0.4, 4, 0] + NO_STAGE + [0.1, math.nan], nan_ok=True)


def test_exchange_time_and_bytes_fold_into_window_summary_and_metrics() -> None:
    """Rank 0 holds both stages (two buffers), ranks 1 and 2 one each; rank 2 arrived last at its group."""
    rows = [[[1.0, 0.1, 0.3, 8, 0] + NO_STAGE + [0.25, 3000.0]] * 2,
            [[1.0, 0.1, 0.2, 0, 0] + NO_STAGE + [0.15, 1700.0]] * 2,
            [[1.0, 0.1, 0.1, 8, 0] + NO_STAGE + [0.05, 1300.0]] * 2]
    w = analyse(rows)
    assert w["exchange"] == pytest.approx([0.25, 0.15, 0.05])
    assert w["comm_bytes"] == pytest.approx([3000.0, 1700.0, 1300.0])
    assert w["comm"] == pytest.approx([0.1] * 3) and w["wait"] == pytest.approx([0.2, 0.1, 0.0])
    metrics = window_metrics({**w, "nvml": {}})
    assert metrics["monitor/exchange_s_rank1"] == pytest.approx(0.15)
    assert metrics["monitor/comm_bytes_rank0"] == pytest.approx(3000.0)
    totals = accumulate(None, w)
    table, notes = summary_text(totals)
    headers = summary_headers(None, totals)
    assert headers[4:8] == ["data ms", "comm ms", "exchange ms", "comm MB"]
    assert [row[headers.index("exchange ms")] for row in table] == ["250.00 (25%)", "150.00 (15%)", "50.00 (5%)"]
    assert [row[headers.index("comm MB")] for row in table] == ["0.003", "0.0017", "0.0013"]
    assert "exchange: the rank's time blocked in the stage gradient exchange" in notes
    # Records without the exchange's fields (a strategy that neither times nor counts it): none in the window.
    plain = analyse([[row[:5] for row in rank] for rank in rows])
    assert "exchange" not in plain and "comm_bytes" not in plain
    assert summary_headers(None, accumulate(None, plain))[4:7] == ["data ms", "comm ms", "step ms"]
    # Counted on some ranks only: the others' bytes are unknown, not 0.
    rows[1] = [row[:-1] + [math.nan] for row in rows[1]]
    w = analyse(rows)
    assert math.isnan(w["comm_bytes"][1]) and "monitor/comm_bytes_rank1" not in window_metrics({**w, "nvml": {}})
    assert summary_text(accumulate(None, w))[0][1][headers.index("comm MB")] == "-"


def test_exposed_exchange_advice_names_the_hybrid_levers() -> None:
    """Under the hybrid layout the comm advice names the stage exchange's levers, and weighs the least time a rank
    was blocked in it (the others waited there too): a step whose exposed communication is not the exchange gets
    none."""
    exchanged = analyse([[[1.0, 0.0, 0.6, 8, 0] + NO_STAGE + [0.5, 1.0]], [[1.0, 0.0, 0.5, 8, 0] + NO_STAGE +
                                                                          [0.4, 1.0]]])
    message = dict(advice(exchanged))["comm"]
    assert "overlap_stage_exchange=True" in message and "stage_compression='bf16'" in message
    assert "bucket_cap_mb" not in message and "up to 20% shorter steps" in message
    elsewhere = analyse([[[1.0, 0.0, 0.6, 8, 0] + NO_STAGE + [0.02, 1.0]], [[1.0, 0.0, 0.5, 8, 0] + NO_STAGE +
                                                                           [0.01, 1.0]]])
    assert "comm" not in dict(advice(elsewhere))


def _stage_bytes(model, names) -> int:
    """A stage buffer: the stage's fp32 gradients and one fp32 presence flag per parameter."""
    params = dict(model.named_parameters())
    return sum(params[n].numel() * 4 + 4 for n in names)


class SavePartition(Callback):
    """Rank 0 saves each stage's parameter names and whether the fit overlapped (the ranks are forked)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            sync = trainer.strategy.stage_sync
            torch.save({"partition": sync.partition, "overlap": sync.overlap}, self.path)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "late"])
def test_a_hybrid_fit_shows_each_holders_exchange(tmp_path, capfd, overlap) -> None:
    """Rank 0 (data-parallel) hands both stage groups their buffers, each stage rank its own stage's: the window's
    ``comm_bytes`` are exactly those, every step; each rank's time blocked in the exchange is above 0 and a part of
    its sync (comm + wait); the metrics and the summary carry both."""
    seed_everything(0)
    model = Chain(n=96, batch_size=16)
    trainer = Trainer(accelerator="cpu", devices=3, strategy=hybrid([[1, 2]], [2, 1, 1], micro_batches=2,
                                                                    overlap_stage_exchange=overlap),
                      max_steps=6, log_every_n_steps=3,
                      callbacks=[HeteroMonitor(warmup_steps=1, warn=False), SavePartition(str(tmp_path / "p.pt"))],
                      logger=CSVLogger(str(tmp_path)), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model)
    saved = torch.load(str(tmp_path / "p.pt"))
    assert saved["overlap"] == overlap
    partition = saved["partition"]
    stage0, stage1 = (_stage_bytes(model, names) for names in partition)
    expected = [stage0 + stage1, stage0, stage1]
    windows = load_windows(find_sidecar(str(tmp_path)))
    assert [w["steps"] for w in windows] == [3, 3]
    for w in windows:
        assert w["comm_bytes"] == expected  # means of equal steps: exact
        for r in range(3):
            assert 0.0 < w["exchange"][r] <= w["comm"][r] + w["wait"][r] + 1e-9, (r, w)
    (metrics_csv,) = glob.glob(os.path.join(str(tmp_path), "**", "metrics.csv"), recursive=True)
    with open(metrics_csv) as f:
        logged = [row for row in csv.DictReader(f) if row.get("monitor/comm_bytes_rank0")]
    assert [float(logged[-1][f"monitor/comm_bytes_rank{r}"]) for r in range(3)] == expected
    assert all(float(logged[-1][f"monitor/exchange_s_rank{r}"]) > 0 for r in range(3))
    out = capfd.readouterr().out
    assert "exchange ms" in out and "comm MB" in out
