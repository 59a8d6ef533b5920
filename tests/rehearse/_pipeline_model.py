"""A LightningModule a pipelined replica can split (``self(x)`` in ``training_step``, a list of blocks), with its own
loader, for rehearsals of the hybrid layout through a config's ``class_path``."""

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers import IndexedDataset

MODEL_ERROR = "Blocks: the model's own error"


class Blocks(LightningModule):
    """Four blocks of a ``ModuleList`` (the pipeline's split points) on :class:`~tests.helpers.IndexedDataset`;
    ``fail_rank``: the global rank whose training step raises :data:`MODEL_ERROR` at its third step."""

    def __init__(self, width: int = 16, batch_size: int = 4, n: int = 64, fail_rank: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        features, classes = 8, 4  # IndexedDataset's
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(features, width), nn.Tanh()),
                                     nn.Sequential(nn.Linear(width, width), nn.Tanh()),
                                     nn.Sequential(nn.Linear(width, width), nn.Tanh()),
                                     nn.Linear(width, classes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.hparams.fail_rank and batch_idx == 2:
            raise ValueError(MODEL_ERROR)
        x, y, _ = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.hparams.n), batch_size=self.hparams.batch_size)
