"""Predict over unequal ranks: each sample predicted once, on one rank, under every launcher and both strategies; a
rank's padding step (no sample of its own, run for the collectives) reaches no prediction writer and is not returned."""

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_hetero.strategies.predictions import PaddingPredictions
from tests.helpers import free_port
from tests.strategies._predict_worker import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "strategies", "_predict_worker.py")


def _predict(out_dir: str, strategy: str, sizes: list[int], capacities: list[int],
             start_method: str, stream: bool = False) -> tuple[list[dict], Optional[list[Any]]]:
    """Every rank's writer records, and (popen: each process returns its own) what ``trainer.predict`` returned."""
    if start_method == "popen":
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
        env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        result = subprocess.run([sys.executable, WORKER, out_dir, strategy, ",".join(map(str, sizes)),
                                 ",".join(map(str, capacities))], env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        os.environ["MASTER_PORT"] = str(free_port())
        run(out_dir, strategy, sizes, capacities, start_method, stream)
    world = len(capacities)
    records = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    returned = None
    if start_method == "popen":
        returned = [torch.load(os.path.join(out_dir, f"returned{r}.pt")) for r in range(world)]
    return records, returned


def _assert_each_sample_once(records: list[dict], returned: Optional[list[Any]], sizes: list[int],
                             indexed: bool = True) -> None:
    """``indexed=False``: a stream, for which Lightning records no batch indices."""
    for loader, n in enumerate(sizes):
        calls = [call for record in records for call in record["batch"] if call[0] == loader]
        for _, _, batch_indices, samples in calls:
            assert batch_indices == (samples if indexed else [])  # a writer's batch indices are the batch's own
        assert sorted(s for call in calls for s in call[3]) == list(range(n)), calls
        epoch = [record["epoch"] for record in records]
        for received in epoch:
            if indexed:
                assert received["batch_indices"][loader] == received["predictions"][loader]
        assert sorted(s for received in epoch for p in received["predictions"][loader] for s in p) == list(range(n))
        if returned is not None:
            assert sorted(s for rank in returned for p in rank[loader] for s in p) == list(range(n)), returned


# The case: 3 samples at batch size 1 on [3, 1] (rank 1 has one sample, then a padding step), and a loader
# of one sample (fewer than the ranks: Lightning's own prediction sampler refused it in setup).
@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "start_method"), [
    ("ddp", "popen"), ("ddp", "spawn"), ("ddp", "fork"), ("fsdp", "popen"), ("fsdp", "fork")])
def test_padding_steps_reach_no_writer_and_each_sample_is_predicted_once(tmp_path: Any, strategy: str,
                                                                         start_method: str) -> None:
    records, returned = _predict(str(tmp_path), strategy, [3, 1], [3, 1], start_method)
    assert [len(r["batch"]) for r in records] == [3, 1]  # rank 1's two padding steps (one per loader) are not written
    _assert_each_sample_once(records, returned, [3, 1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_sample_on_two_ranks_is_predicted_once(tmp_path: Any, strategy: str) -> None:
    """One loader of one sample, the slower rank 0 the one without it: rank 0 runs a padding step only."""
    records, _ = _predict(str(tmp_path), strategy, [1], [1, 3], "fork")
    assert [len(r["batch"]) for r in records] == [0, 1]
    _assert_each_sample_once(records, None, [1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_stream_predicts_each_sample_once(tmp_path: Any, strategy: str) -> None:
    """A plain IterableDataset: rank 1's padding steps (its stream splitter knows them) re-read a sample that is
    another rank's; no writer sees it and it is not returned."""
    records, _ = _predict(str(tmp_path), strategy, [3], [3, 1], "fork", stream=True)
    # Global batches of 2 (loader batch x world) split [1, 1], then the last sample to rank 0 and a padding step
    # for rank 1, which no writer sees.
    assert [len(r["batch"]) for r in records] == [2, 1]
    _assert_each_sample_once(records, None, [3], indexed=False)


class _Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.steps: list[int] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        self.steps.append(batch_idx)


@pytest.mark.parametrize("loaders", [1, 2])
def test_padding_entries_leave_the_stored_predictions_and_the_writers_are_restored(loaders: int) -> None:
    """What the prediction loop stored for a padding step (the last of each loader here) is taken out of the lists it
    returns and hands epoch writers; the writer objects are as they were after the run."""
    writer = _Writer()
    loop = SimpleNamespace(_predictions=[["p0", "p1", None] for _ in range(loaders)],
                           epoch_batch_indices=[[[0], [1], [0]] for _ in range(loaders)],
                           current_batch_indices=[0])
    trainer = SimpleNamespace(callbacks=[writer], predict_loop=loop)
    returned = loop._predictions  # what `trainer.predict` returns: the same lists
    padding = PaddingPredictions()
    padding.start(trainer)
    for loader in range(loaders):
        for step in range(3):
            output = padding.step((step, loader), padding=step == 2, output=f"p{step}")
            assert output == (None if step == 2 else f"p{step}")  # a padding step's output reaches no one
            writer.on_predict_batch_end(trainer, None, None, None, step, loader)
    assert writer.steps == [0, 1] * loaders  # never the padding step
    padding.end(trainer)
    assert returned == [["p0", "p1"]] * loaders and loop.epoch_batch_indices == [[[0], [1]]] * loaders
    assert "on_predict_batch_end" not in vars(writer) and "on_predict_epoch_end" not in vars(writer)
