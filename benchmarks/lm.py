"""A GPT LightningModule on random tokens, for configs that name their classes (``doctor --lab`` rehearsals).

Example (``configs/rehearse_gpt.yaml``)::

    model: {class_path: benchmarks.lm.GPTModule, init_args: {width: 2048, layers: 20, heads: 16}}
    data: {class_path: benchmarks.lm.RandomTokens, init_args: {batch_size: 4}}
"""

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.models import GPT, GPTConfig


class GPTModule(LightningModule):
    def __init__(self, vocab: int = 50304, seq: int = 512, width: int = 768, layers: int = 12, heads: int = 12,
                 lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = GPT(GPTConfig(vocab=vocab, seq=seq, width=width, layers=layers, heads=heads))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        # Through `self(...)`: a sharded root's hooks gather its own parameters (the tied embedding) around forward.
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class RandomTokens(LightningDataModule):
    def __init__(self, batch_size: int = 4, seq: int = 512, vocab: int = 50304, samples: int = 512) -> None:
        super().__init__()
        self.batch_size, self.seq, self.vocab, self.samples = batch_size, seq, vocab, samples

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, self.vocab, (self.samples, self.seq + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size, shuffle=False)
