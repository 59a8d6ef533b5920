"""Pipelined validation's logged values (``pipelined_evaluation=True``, lightning_hetero/strategies/stage_evaluation.py)
as one device or each rank's own share gives them, for the ways a LightningModule logs: unsynced values, ``log_dict``,
and values logged before the step's forward. Fits of 3 forked CPU ranks: rank 0 data-parallel, ranks 1 and 2 a
2-stage pipeline."""

import math
import os

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn

from tests.helpers import IndexedDataset
from tests.strategies.test_hybrid import PipelineValidated, fit, hybrid

WORLD, PIPELINES, CAPACITIES = 3, [[1, 2]], [2, 1, 1]


class Metrics(Callback):
    """Per rank: ``callback_metrics`` after every validation and training epoch, and the validation indices of the
    last validation run, saved as ``metrics{rank}.pt``."""

    def __init__(self, out_dir):
        self.out_dir, self.validations, self.epochs, self.indices = out_dir, [], [], []

    def on_validation_epoch_start(self, trainer, pl_module):
        self.indices = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.indices.append([int(i) for i in batch[2]])

    def on_validation_end(self, trainer, pl_module):
        self.validations.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def teardown(self, trainer, pl_module, stage):
        torch.save({"validations": self.validations, "epochs": self.epochs, "indices": self.indices},
                   os.path.join(self.out_dir, f"metrics{trainer.global_rank}.pt"))


def metrics(out_dir):
    return [torch.load(os.path.join(out_dir, f"metrics{r}.pt")) for r in range(WORLD)]


class Unsynced(PipelineValidated):
    """Logs its losses unsynced (Lightning's default ``sync_dist=False``), its validation loss beside a synced one."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_own", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_own", loss)
        self.log("val_loss", loss, sync_dist=True)


@pytest.mark.slow
def test_an_unsynced_value_is_the_replicas_on_every_stage_rank(tmp_path):
    """An unsynced value (``self.log(name, value)``) is each rank's own mean; a stage rank's own share is its
    replica's: every stage rank's epoch value is the loss over the pipeline's samples, not 0 / 0 (NaN, which made
    ``EarlyStopping(monitor=...)`` stop the fit after its first validation), and the synced mean stays one device's;
    in training likewise (each stage rank logs the replica's epoch mean)."""
    seed_everything(0)
    model = Unsynced(val_n=23, optimizer="sgd", n=24)
    epochs = 2
    records = fit(model, str(tmp_path), WORLD, hybrid(PIPELINES, CAPACITIES, pipelined_evaluation=True), epochs,
                  callbacks=[Metrics(str(tmp_path)), EarlyStopping(monitor="val_own", patience=5)],
                  default_root_dir=str(tmp_path))
    steps_per_epoch = 2  # 24 samples, a global batch of 12
    assert [r["steps"] for r in records] == [epochs * steps_per_epoch] * WORLD
    logged = metrics(str(tmp_path))
    dataset, probe = IndexedDataset(23, seed=1), PipelineValidated(val_n=23)
    probe.load_state_dict(records[0]["final"], strict=False)  # the model the last validation ran

    def loss_over(ranks):
        indices = torch.tensor(sorted({i for r in ranks for batch in logged[r]["indices"] for i in batch}))
        with torch.no_grad():
            return float(probe.loss((dataset.x[indices], dataset.y[indices], indices)))

    expected = {0: loss_over([0]), 1: loss_over(PIPELINES[0]), 2: loss_over(PIPELINES[0])}
    everything = loss_over(range(WORLD))
    for r in range(WORLD):
        train_own = [epoch["train_own"] for epoch in logged[r]["epochs"]]
        assert len(train_own) == epochs and all(math.isfinite(v) for v in train_own), (r, train_own)
        if r == PIPELINES[0][0]:
            assert train_own == [epoch["train_own"] for epoch in logged[PIPELINES[0][1]]["epochs"]]
        last = logged[r]["validations"][-1]
        assert abs(last["val_own"] - expected[r]) <= 1e-5 * max(1.0, abs(expected[r])), (r, last, expected)
        assert abs(last["val_loss"] - everything) <= 1e-5 * max(1.0, abs(everything)), (r, last, everything)


class LoggedAnyWay(PipelineValidated):
    """Logs each value twice (``self.log`` and ``self.log_dict``), and the mean label before the step's forward."""

    def training_step(self, batch, batch_idx):
        self.log("train_y", batch[1].float().mean(), sync_dist=True, on_step=False, on_epoch=True)
        loss = super().training_step(batch, batch_idx)  # the forward
        self.log("train_epoch_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        self.log_dict({"train_epoch_loss_dict": loss}, sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_y", y.float().mean(), sync_dist=True)
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.log_dict({"val_loss_dict": loss}, sync_dist=True)


@pytest.mark.slow
def test_values_logged_by_log_dict_or_before_the_forward_are_one_devices(tmp_path):
    """A pipeline's ``log_dict`` values are weighted by the replica's joined batch as its ``self.log`` values are (its
    explicit ``batch_size=None`` had Lightning weigh them by the last stage's own slice), and a value logged before
    the step's forward counts once (the stage-0 input's capture logged it a second time), in training and in the
    pipelined validation: every rank's epoch means are one device's."""
    seed_everything(0)
    n, val_n = 24, 23
    fit(LoggedAnyWay(val_n=val_n, optimizer="sgd", n=n), str(tmp_path), WORLD,
        hybrid(PIPELINES, CAPACITIES, pipelined_evaluation=True), 1, callbacks=[Metrics(str(tmp_path))],
        default_root_dir=str(tmp_path))
    train_y = float(IndexedDataset(n).y.float().mean())
    val_y = float(IndexedDataset(val_n, seed=1).y.float().mean())
    for r, record in enumerate(metrics(str(tmp_path))):
        epoch = record["epochs"][-1]
        assert abs(epoch["train_y"] - train_y) <= 1e-6, (r, epoch, train_y)
        assert abs(epoch["val_y"] - val_y) <= 1e-6, (r, epoch, val_y)
        train_loss = epoch["train_epoch_loss"]
        assert abs(epoch["train_epoch_loss_dict"] - train_loss) <= 1e-6 * abs(train_loss), (r, epoch)
        assert abs(epoch["val_loss_dict"] - epoch["val_loss"]) <= 1e-6 * abs(epoch["val_loss"]), (r, epoch)
