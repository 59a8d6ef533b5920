"""A GPT LightningModule on random tokens, for configs that name their classes (``doctor --lab`` rehearsals).

Example (``configs/rehearse_gpt.yaml``)::

    model: {class_path: benchmarks.lm.GPTModule, init_args: {width: 2048, layers: 20, heads: 16}}
    data: {class_path: benchmarks.lm.RandomTokens, init_args: {batch_size: 4}}
"""

from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.models import GPT, GPTConfig


# Values a "fill"-initialised weight repeats (std 0.02, GPT-2's): a few million, drawn once.
FILL_BLOCK = 1 << 22


def fill_(module: nn.Module, seed: int = 0) -> None:
    """Every parameter of ``module`` set without per-element random draws: layer-norm weights 1, biases 0, the rest
    a fixed block of normal values (std 0.02) repeated. Memory-bandwidth fast where ``nn.Linear``'s own init draws
    serially (minutes for billions of parameters); for speed and memory benchmarks, not for training to a result."""
    block = torch.randn(FILL_BLOCK, generator=torch.Generator().manual_seed(seed)) * 0.02
    with torch.no_grad():
        for name, param in module.named_parameters():
            flat = param.view(-1)
            if name.endswith("bias"):
                flat.zero_()
            elif param.dim() == 1:
                flat.fill_(1.0)
            else:
                for start in range(0, flat.numel(), FILL_BLOCK):
                    piece = flat[start:start + FILL_BLOCK]
                    piece.copy_(block[: piece.numel()])


class GPTModule(LightningModule):
    """``init="fill"`` builds the weights on the meta device and fills them with :func:`fill_` (a model of billions
    of parameters in seconds, host memory touched once); ``"random"`` is torch's own initialisation."""

    def __init__(self, vocab: int = 50304, seq: int = 512, width: int = 768, layers: int = 12, heads: int = 12,
                 lr: float = 3e-4, init: Literal["random", "fill"] = "random") -> None:
        super().__init__()
        if init not in ("random", "fill"):
            raise ValueError(f"`init`={init!r} must be 'random' or 'fill'.")
        self.save_hyperparameters()
        cfg = GPTConfig(vocab=vocab, seq=seq, width=width, layers=layers, heads=heads)
        if init == "fill":
            with torch.device("meta"):
                self.gpt = GPT(cfg)
            self.gpt.to_empty(device="cpu")
            fill_(self.gpt)
        else:
            self.gpt = GPT(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        # Through `self(...)`: a sharded root's hooks gather its own parameters (the tied embedding) around forward.
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class UntiedGPTModule(GPTModule):
    """:class:`GPTModule` with an output head of its own in place of the embedding's weight: a tied head would join a
    pipeline's first and last stages, which ``HeteroHybridStrategy`` refuses (``configs/rehearse_hybrid.yaml``)."""

    def __init__(self, vocab: int = 50304, seq: int = 512, width: int = 768, layers: int = 12, heads: int = 12,
                 lr: float = 3e-4, init: Literal["random", "fill"] = "random") -> None:
        super().__init__(vocab, seq, width, layers, heads, lr, init)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gpt.hidden(tokens))


class RandomTokens(LightningDataModule):
    def __init__(self, batch_size: int = 4, seq: int = 512, vocab: int = 50304, samples: int = 512) -> None:
        super().__init__()
        self.batch_size, self.seq, self.vocab, self.samples = batch_size, seq, vocab, samples

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, self.vocab, (self.samples, self.seq + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size, shuffle=False)
