"""Every value Lightning logs under the strategy equals what one process logs on the same global batches.

A tiny linear model (learning rate 0, so every step sees the same parameters) logs, in training, validation and
test, a batch mean (``sync_dist=True`` with the default mean), sums, maxima and minima of its per-sample losses, the
batch's sample count, and a ``torchmetrics.MeanMetric``, at step and epoch level. Each rank records what Lightning
logged and which dataset indices each of its steps saw; the reference is one process over the union of the ranks'
samples at each step (the global batch), and over all of an epoch's samples for epoch values.
"""

import os
from collections.abc import Sequence
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.loggers import Logger
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import MeanMetric

from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy
from lightning_hetero.data.sampler import EvaluationBatchSampler, GlobalOrder, HeteroBatchSampler, for_evaluation
from lightning_hetero.plan.split import split_batch
from tests.helpers import IndexedDataset, free_port

# What each step logs, by name: the batch's mean loss (default reduce_fx, weighted by batch size), the sum, max and
# min of its per-sample losses (reduce_fx of that name) and its sample count (reduce_fx="sum": every sample once).
REDUCTIONS = ("mean", "sum", "max", "min", "count")


def per_sample_losses(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(x), y, reduction="none")


class LoggingModel(LightningModule):
    def __init__(self, n_train: int, n_eval: int, batch_size: int, on_step: bool) -> None:
        super().__init__()
        self.n_train, self.n_eval, self.batch_size, self.on_step = n_train, n_eval, batch_size, on_step
        torch.manual_seed(0)
        self.net = nn.Linear(8, 4)
        self.metric = nn.ModuleDict({f"{stage}_loss": MeanMetric() for stage in ("train", "val", "test")})

    def _step(self, stage: str, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        losses = per_sample_losses(self.net, x, y)
        values = {"mean": losses.mean(), "sum": losses.sum(), "max": losses.max(), "min": losses.min(),
                  "count": torch.tensor(float(len(losses)))}
        for name, value in values.items():
            reduce_fx = "mean" if name == "mean" else "sum" if name == "count" else name
            self.log(f"{stage}_{name}", value, sync_dist=True, reduce_fx=reduce_fx, on_step=self.on_step,
                     on_epoch=True)
        self.metric[f"{stage}_loss"].update(losses.detach())
        self.log(f"{stage}_metric", self.metric[f"{stage}_loss"], on_step=False, on_epoch=True)
        return losses.mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        return torch.stack([index.float(), per_sample_losses(self.net, x, y)], dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Learning rate 0: every step sees the initial parameters, so the reference needs no training.
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.n_train), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.n_eval, seed=1), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.n_eval, seed=1), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.n_eval, seed=1), batch_size=self.batch_size)


class RecordingLogger(Logger):
    """Every logged dict, on every rank (Lightning's loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.records.append(dict(metrics))


class IndexRecorder(BasePredictionWriter):
    """The dataset indices of each step, per stage, the predictions and what the logger received; saved per rank at
    the stage's end (the fork launcher hands back rank 0's results only)."""

    def __init__(self, out_dir: str, logger: RecordingLogger) -> None:
        super().__init__(write_interval="batch")
        self.out_dir, self.logger = out_dir, logger
        self.indices: dict[str, list[list[int]]] = {"train": [], "val": [], "test": []}
        self.predictions: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.indices["train"].append([int(i) for i in batch[2]])

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.indices["val"].append([int(i) for i in batch[2]])

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self.indices["test"].append([int(i) for i in batch[2]])

    def write_on_batch_end(self, trainer: Trainer, pl_module: LightningModule, prediction: Any,
                           batch_indices: Optional[Sequence[int]], batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        if prediction is not None:
            # A prediction writer receives each batch's true dataset indices.
            assert list(batch_indices or []) == batch[2].tolist()
            self.predictions.append(prediction)

    def _save(self, trainer: Trainer) -> None:
        torch.save({"indices": self.indices, "records": self.logger.records, "predictions": self.predictions},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._save(trainer)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer)


def run(model: LoggingModel, out_dir: str, capacities: list[float], strategy_class: type, stage: str,
        data: Optional[dict] = None) -> list[dict]:
    """One ``stage`` (fit, validate, test or predict) over forked CPU ranks; each rank's record."""
    os.environ["MASTER_PORT"] = str(free_port())
    logger = RecordingLogger()
    recorder = IndexRecorder(out_dir, logger)
    strategy = strategy_class(start_method="fork", capacities=capacities, observation={"print_table": False},
                              resilience={"timeout": 120}, data=data)
    trainer = Trainer(accelerator="cpu", devices=len(capacities), strategy=strategy, max_epochs=1,
                      callbacks=[recorder], logger=logger, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      log_every_n_steps=1)
    getattr(trainer, stage)(model)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(len(capacities))]


def reference(losses: torch.Tensor, indices: list[int]) -> dict[str, float]:
    """What one process logs for a batch (or an epoch) of these dataset indices."""
    values = losses[torch.tensor(indices)]
    return {"mean": float(values.mean()), "sum": float(values.sum()), "max": float(values.max()),
            "min": float(values.min()), "count": float(len(values))}


def global_batches(records: list[dict], stage: str) -> list[list[int]]:
    """The union of the ranks' samples at each step (a padding step re-reads a sample another rank holds)."""
    steps = len(records[0]["indices"][stage])
    assert all(len(r["indices"][stage]) == steps for r in records), "ranks ran different numbers of steps"
    return [sorted({i for r in records for i in r["indices"][stage][k]}) for k in range(steps)]


def epoch_values(records: list[dict], key: str) -> list[float]:
    """Each rank's logged epoch value of ``key``."""
    return [next(rec[key] for rec in r["records"] if key in rec) for r in records]


def check_stage(records: list[dict], stage: str, losses: torch.Tensor, n: int, on_step: bool,
                exactly_once: bool) -> None:
    batches = global_batches(records, stage)
    everything = [i for b in batches for i in b]
    if exactly_once:
        seen = sorted(i for r in records for b in r["indices"][stage] for i in b)
        assert seen == list(range(n)), f"{stage}: evaluated {len(seen)} samples of {n}, or not each once"
    assert sorted(everything) == list(range(n))
    truth = reference(losses, everything)
    suffix = "_epoch" if on_step else ""
    for name in REDUCTIONS:
        for rank, got in enumerate(epoch_values(records, f"{stage}_{name}{suffix}")):
            assert got == pytest.approx(truth[name], rel=1e-5), (stage, name, rank, got, truth[name])
    for rank, got in enumerate(epoch_values(records, f"{stage}_metric")):
        assert got == pytest.approx(truth["mean"], rel=1e-5), (stage, "MeanMetric", rank, got, truth["mean"])
    if on_step:
        for name in REDUCTIONS:
            logged = [rec[f"{stage}_{name}_step"] for rec in records[0]["records"] if f"{stage}_{name}_step" in rec]
            expected = [reference(losses, b)[name] for b in batches]
            assert logged == pytest.approx(expected, rel=1e-5), (stage, name)


def losses_of(model: LoggingModel, dataset: IndexedDataset) -> torch.Tensor:
    with torch.no_grad():
        return per_sample_losses(model.net, dataset.x, dataset.y)


def check_predictions(records: list[dict], losses: torch.Tensor, n: int) -> None:
    """Every sample predicted once; each rank's predictions a run of the dataset order, ranks in rank order."""
    per_rank = [torch.cat(r["predictions"]) if r["predictions"] else torch.zeros(0, 2) for r in records]
    indices = [p[:, 0].long().tolist() for p in per_rank]
    assert [i for rank in indices for i in rank] == list(range(n))
    everything = torch.cat(per_rank)
    assert everything[:, 1].tolist() == pytest.approx(losses[everything[:, 0].long()].tolist(), rel=1e-5)


def test_validation_37_samples_at_3_1_equals_one_process(tmp_path):
    """The issue's case: 37 validation samples at [3, 1] (28 on rank 0, 9 on rank 1), epoch-level ``sync_dist=True``
    (before the fix: 1.5551 logged for a true 1.5131, the factor 37 / 36 of a truncated mean count)."""
    model = LoggingModel(n_train=16, n_eval=37, batch_size=8, on_step=False)
    records = run(model, str(tmp_path), [3, 1], HeteroDDPStrategy, "validate")
    check_stage(records, "val", losses_of(model, IndexedDataset(37, seed=1)), 37, on_step=False, exactly_once=True)


# (stage, strategy, capacities, training samples, evaluation samples, batch size per device, step-level logging)
CASES = [
    # 53 training samples in global batches of 10: a partial last batch; 41 validation samples of which the last
    # global batch holds one (once evaluated twice).
    ("fit", HeteroDDPStrategy, [3, 1], 53, 41, 5, True),
    # 17 training samples in global batches of 6 (the last holds 5), 36 validation samples that divide.
    ("fit", HeteroDDPStrategy, [5, 2, 1], 17, 36, 2, False),
    # 19 training samples in batches of 6: the last holds one, two ranks run a padding step.
    ("fit", HeteroFSDPStrategy, [5, 2, 1], 19, 37, 2, True),
    # 40 test samples in global batches of 10.
    ("test", HeteroFSDPStrategy, [3, 1], 8, 40, 5, True),
    ("test", HeteroDDPStrategy, [5, 2, 1], 8, 37, 3, True),
    # Two samples for three ranks: one rank can only run a padding step.
    ("validate", HeteroDDPStrategy, [5, 2, 1], 8, 2, 1, True),
    ("predict", HeteroDDPStrategy, [5, 2, 1], 8, 37, 3, False),
    ("predict", HeteroFSDPStrategy, [3, 1], 8, 41, 5, False),
    ("predict", HeteroDDPStrategy, [5, 2, 1], 8, 7, 1, False),
]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "strategy_class", "capacities", "n_train", "n_eval", "batch_size", "on_step"),
                         CASES, ids=[f"{c[0]}-{c[1].__name__[6:-8]}-{'_'.join(map(str, c[2]))}-{c[3]}-{c[4]}"
                                     for c in CASES])
def test_logged_values_equal_one_process(tmp_path, stage, strategy_class, capacities, n_train, n_eval, batch_size,
                                         on_step):
    model = LoggingModel(n_train=n_train, n_eval=n_eval, batch_size=batch_size, on_step=on_step)
    records = run(model, str(tmp_path), capacities, strategy_class, stage)
    eval_losses = losses_of(model, IndexedDataset(n_eval, seed=1))
    if stage == "predict":
        check_predictions(records, eval_losses, n_eval)
        return
    if stage == "fit":
        # Training global batches are one process's (a padding step re-reads a sample of its own global batch).
        check_stage(records, "train", losses_of(model, IndexedDataset(n_train)), n_train, on_step,
                    exactly_once=n_train % (batch_size * len(capacities)) >= len(capacities))
    evaluated = "val" if stage in ("fit", "validate") else "test"
    padding_unavoidable = n_eval < -(-n_eval // (batch_size * len(capacities))) * len(capacities)
    check_stage(records, evaluated, eval_losses, n_eval, on_step, exactly_once=not padding_unavoidable)


class OrderedStream(IterableDataset):
    """A dataset's samples in index order, as a stream."""

    def __init__(self, data: IndexedDataset) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


class StreamLoggingModel(LoggingModel):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(OrderedStream(IndexedDataset(self.n_eval, seed=1)), batch_size=self.batch_size)


@pytest.mark.slow
@pytest.mark.parametrize("stream_mode", ["exact", "shard"])
def test_a_validation_stream_padding_step_counts_nowhere(tmp_path, stream_mode):
    """9 samples in global batches of 4 at [3, 1]: the last holds one, so rank 1 runs a padding step on a re-read
    sample, which must count in no logged value. Shard mode: the stream does not shard itself, so each rank reads
    all 9, rank 0 at 3 a step, rank 1 at 1 a step, and rank 0 pads for 6 steps."""
    model = StreamLoggingModel(n_train=8, n_eval=9, batch_size=2, on_step=True)
    records = run(model, str(tmp_path), [3, 1], HeteroDDPStrategy, "validate", data={"stream_mode": stream_mode})
    losses = losses_of(model, IndexedDataset(9, seed=1))
    if stream_mode == "exact":
        check_stage(records, "val", losses, 9, on_step=True, exactly_once=False)
        return
    truth = reference(losses, list(range(9)) * 2)
    for name in ("mean", "sum", "count"):
        assert epoch_values(records, f"val_{name}_epoch") == pytest.approx([truth[name]] * 2, rel=1e-5), name


@pytest.mark.parametrize("capacities", [[1, 1], [3, 1], [5, 2, 1], [10, 1], [1, 1, 1, 1]])
def test_evaluation_split_sees_every_sample_once_in_equal_batch_counts(capacities):
    world = len(capacities)
    for n in range(1, 40):
        for g in range(world, 13):
            shares = split_batch(g, capacities)
            samplers = [EvaluationBatchSampler(GlobalOrder(n, shuffle=True, seed=n), g, capacities, r, False)
                        for r in range(world)]
            batches = [list(s) for s in samplers]
            steps = -(-n // g)
            assert all(len(b) == steps == len(s) for b, s in zip(batches, samplers))
            real = [i for r, s in enumerate(samplers) for k, b in enumerate(batches[r]) if not s.is_padding(k)
                    for i in b]
            assert sorted(real) == list(range(n)), (capacities, n, g)
            # A rank's run of the order is contiguous and in order; rank 0's comes first (predict's order).
            order = [i for b in GlobalOrder(n, shuffle=True, seed=n).global_batches(g, False) for i in b]
            assert real == order
            for r, s in enumerate(samplers):
                assert all(len(b) <= shares[r] for b in batches[r]), "a batch above the rank's share of G"
                padding = [k for k in range(steps) if s.is_padding(k)]
                assert all(len(batches[r][k]) == 1 for k in padding)
                if n >= steps * world:
                    assert not padding, (capacities, n, g, r)


def test_a_user_batch_sampler_keeps_its_batches_and_marks_padding():
    """A user's batch sampler defines the global batches: each is split as in training, and a rank left without a
    sample of a batch runs a padding step (weight 0)."""
    batches = [[0, 1, 2, 3], [4, 5, 6], [7]]
    samplers = [for_evaluation(HeteroBatchSampler(GlobalOrder(8, shuffle=False, source=batches, batches=True), 4,
                                                  [3, 1], rank, False)) for rank in range(2)]
    assert not any(isinstance(s, EvaluationBatchSampler) for s in samplers)
    assert [s.is_padding(2) for s in samplers] == [False, True]
    assert [[s.is_padding(k) for k in range(2)] for s in samplers] == [[False, False], [False, False]]
