"""Train an MLP on scikit-learn's handwritten digits with HeteroDDPStrategy, through LightningCLI.

    python examples/train_digits.py                                   # demo: picks a config for this machine
    python examples/train_digits.py fit --config configs/cpu_smoke.yaml
    python examples/train_digits.py fit --config configs/lab_a100_3090.yaml

With no arguments the demo trains on whatever is here: every visible GPU with capacities measured on the model
("auto"), or, without GPUs, CPU processes (gloo) that emulate a mixed lab.
"""

import logging
import os
import sys
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_hetero  # noqa: F401  (registers "hetero_ddp")
from lightning_hetero.observe.errors import run_main

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs")


class DigitsDataModule(LightningDataModule):
    """scikit-learn's 8×8 digits (1797 images, shipped with the package): 1500 to train, the rest to validate."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0, train_size: int = 1500) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        # A fixed permutation, identical on every rank.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
        x, y = x[order], y[order]
        n = self.hparams.train_size
        self.train_set = TensorDataset(x[:n], y[:n])
        self.val_set = TensorDataset(x[n:], y[n:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


class DigitsClassifier(LightningModule):
    """A two-layer MLP; the accuracy metric syncs over ranks like any torchmetrics metric."""

    def __init__(self, hidden: int = 128, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.val_accuracy = MulticlassAccuracy(num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.val_accuracy(logits, y)
        self.log("val_acc", self.val_accuracy, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def default_config() -> str:
    """The demo's config for this machine: all GPUs when there are any, else CPU processes emulating a lab."""
    name = "gpu_auto.yaml" if torch.cuda.is_available() else "cpu_lab.yaml"
    return os.path.normpath(os.path.join(CONFIGS, name))


class _NoTips(logging.Filter):
    """Drops Lightning's "💡 Tip:" lines (its cloud services: litlogger, litmodels)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_what_does_not_apply() -> None:
    """Leave out of the output what does not apply to this example; every other warning still shows."""
    # 1500 8x8 images in memory: a batch is an index into two tensors (microseconds); a loader worker would hand each
    # batch over through a queue (about a millisecond) and take a core from the ranks, so the example keeps none.
    warnings.filterwarnings("ignore", message=r".*does not have many workers", category=PossibleUserWarning)
    # The example logs to CSV, which needs nothing installed (`python -m lightning_hetero report` reads the monitor's
    # own file), so Lightning's advice to install TensorBoard does not apply.
    warnings.filterwarnings("ignore", message=r".*`tensorboardX` has been removed as a dependency")
    # Lightning's own use of a torch API that torch 2.13 deprecates, printed once per rank: nothing to change here.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    # Lightning's rank-0 notices go through the logger of its `rank_zero` module (pytorch's or fabric's).
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_NoTips())


def main(args: Optional[list[str]] = None) -> LightningCLI:
    quiet_what_does_not_apply()
    if args is None and len(sys.argv) == 1:
        args = ["fit", "--config", default_config()]
    cli = LightningCLI(DigitsClassifier, DigitsDataModule, args=args, save_config_kwargs={"overwrite": True})
    trainer = cli.trainer
    if trainer.global_rank == 0 and trainer.state.fn == "fit":
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")
    return cli


if __name__ == "__main__":
    run_main(main, "train_digits.py")  # a bad argument: one line, not a traceback per rank
