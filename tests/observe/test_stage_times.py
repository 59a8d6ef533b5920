"""The monitor on a pipeline's stage ranks: compute, send/recv and bubble per stage, from the split of a step's
waits (unit) to a 3-rank hybrid fit whose second stage is emulated 4x slower (its compute grows, the first stage
idles in the bubble)."""

import json
import os

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_hetero.observe.analysis import accumulate, analyse, summary_text
from lightning_hetero.observe.monitor import SIDECAR, HeteroMonitor, _StepRows
from lightning_hetero.observe.windows import window_metrics
from lightning_hetero.observe.report import find_sidecar, load_windows
from lightning_hetero.observe.stage_times import STAGE_EVENT, StageTimer, split_transfers, stage_fields
from tests.helpers import retry_timing
from tests.strategies.test_hybrid import Chain, hybrid


def test_the_fastest_receive_is_the_transfer_the_rest_is_bubble() -> None:
    # (span, compute, posting, waits, receives, fastest receive): stage 0 waited 0.5 s in 4 receives, stage 1
    # 0.04 s in 4 whose fastest took 0.01 s: each receive costs 0.01 s of transfer, the rest of the waits is idle;
    # posting is send/recv.
    stage0, stage1 = (1.0, 0.4, 0.002, 0.5, 4, 0.1), (1.0, 0.9, 0.001, 0.04, 4, 0.01)
    (sent0, idle0), (sent1, idle1) = split_transfers([stage0, stage1])
    assert (sent0, idle0, sent1, idle1) == pytest.approx((0.042, 0.46, 0.041, 0.0))
    assert split_transfers([(1.0, 1.0, 0.0, 0.0, 0, 0.0)] * 2) == [(0.0, 0.0), (0.0, 0.0)]


def test_stage_steps_fold_into_the_window() -> None:
    """Rank 0 data-parallel, ranks 1 and 2 a pipeline: a stage rank's cycle splits into compute, send/recv, bubble,
    sync and data; a data-parallel rank's is untouched."""
    dp = [[1.0, 0.1, 0.2, 8, 0] + [0.0] * 6]
    stage0 = [[1.0, 0.1, 0.1, 0, 0, 0.7, 0.2, 0.0, 0.46, 4, 0.1]]
    stage1 = [[1.0, 0.1, 0.1, 8, 0, 0.7, 0.62, 0.0, 0.04, 4, 0.01]]
    w = analyse([dp, stage0, stage1], pipelines=[[1, 2]])
    assert w["pipelines"] == [[1, 2]]
    assert w["sendrecv"] == pytest.approx([0.0, 0.04, 0.04])
    assert w["bubble"] == pytest.approx([0.0, 0.42, 0.0])
    # compute = cycle - data - sync - send/recv - bubble
    assert w["compute"] == pytest.approx([0.7, 0.8 - 0.46, 0.8 - 0.04])
    assert w["stage_compute"] == pytest.approx([0.0, 0.2, 0.62])
    assert analyse([dp, stage0, stage1])["compute"][1] == pytest.approx(0.8)  # without pipelines: as before
    names = [row[0] for row in summary_text(accumulate(None, w), [[1, 2]])[0]]
    assert names == ["0", "1 (pipeline 0, stage 0)", "2 (pipeline 0, stage 1)"]
    metrics = window_metrics({**w, "nvml": {}})
    assert metrics["monitor/bubble_s_rank1"] == pytest.approx(0.42) and "monitor/bubble_s_rank0" not in metrics


def test_a_stage_timer_replays_into_its_step_row() -> None:
    """The timer's marks (here: numbers as on CPU) become the stage fields of the step they ran in; two schedule
    steps of one optimizer step (gradient accumulation) add up."""
    from lightning_hetero.observe.monitor import _END, _RELEASE, _START

    clock = iter([0.0, 0.1, 0.3, 0.3, 0.35, 0.36, 0.38, 0.4, 0.6, 0.6, 0.62, 0.7] + [1.0, 1.1, 1.2, 1.3])
    events: list = []
    timer = StageTimer(lambda: next(clock), events.append)
    timer.begin()
    timer.compute(lambda: None)  # 0.1-0.3
    assert timer.posted(lambda: "works") == "works"  # 0.3-0.35
    timer.waited(True, lambda: None)  # 0.36-0.38
    timer.compute(lambda: None)  # 0.4-0.6
    timer.waited(False, lambda: None)  # 0.6-0.62
    timer.end()  # 0.7
    timer.begin()
    timer.waited(True, lambda: None)  # 1.1-1.2
    timer.end()  # 1.3
    assert stage_fields(*events[0][1:], lambda a, b: b - a) == pytest.approx((0.7, 0.4, 0.05, 0.04, 1, 0.02))
    log = [(_START, -0.1, 4, 0), events[0], (_END, 0.8), (_START, 0.9, 4, 0), events[1], (_RELEASE, 1.4, None),
           (_END, 1.5)]
    row = _StepRows(lambda a, b: b - a).rows(log)
    assert row[5:11] == pytest.approx([0.7 + 0.3, 0.4, 0.05, 0.04 + 0.1, 2, 0.02])
    assert events[0][0] == STAGE_EVENT


@pytest.mark.slow
def test_a_slow_stage_computes_longer_and_its_neighbour_idles(tmp_path) -> None:
    """A 3-rank hybrid fit (rank 0 data-parallel, ranks 1 and 2 a 2-stage pipeline, stage 1 emulated 4x slower)
    with the monitor: each stage rank reports compute, send/recv and bubble, which add up to its schedule's step;
    the slow stage computes longer than the other, and the other idles in the bubble waiting for it."""
    def attempt(i: int) -> None:  # a loaded host's noise can leave one run outside the bands: measured again
        seed_everything(0)
        model = Chain(n=96, batch_size=16)
        strategy = hybrid([[1, 2]], [2, 1, 1], emulate=[None, None, {"slowdown": 4.0}], micro_batches=4)
        trainer = Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=8, log_every_n_steps=4,
                          callbacks=[HeteroMonitor(warmup_steps=2)], logger=CSVLogger(str(tmp_path / str(i))),
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(model)
        path = find_sidecar(str(tmp_path / str(i)))
        assert os.path.basename(path) == SIDECAR
        window = load_windows(path)[-1]  # steps 5-8
        print(json.dumps({k: window[k] for k in ("pipelines", "stage_span", "stage_compute", "sendrecv", "bubble",
                                                 "compute", "cycle")}))
        assert window["pipelines"] == [[1, 2]]
        fast, slow = 1, 2
        for r in (fast, slow):
            parts = window["stage_compute"][r] + window["sendrecv"][r] + window["bubble"][r]
            # The schedule's own Python between its calls is in no part: a few percent of a step.
            assert parts == pytest.approx(window["stage_span"][r], rel=0.15), r
            assert window["stage_span"][r] <= window["cycle"][r]
            assert window["sendrecv"][r] > 0.0
        assert window["stage_compute"][slow] > 2.0 * window["stage_compute"][fast]
        assert window["bubble"][fast] > 0.3 * window["stage_span"][fast]
        # The slow stage idles too, only while the first micro-batch fills the pipeline.
        assert window["bubble"][fast] > 2.0 * window["bubble"][slow]
        assert window["bubble"][0] == window["sendrecv"][0] == 0.0  # the data-parallel rank

    retry_timing(2, attempt)
