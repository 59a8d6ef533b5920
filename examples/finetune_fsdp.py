"""Fine-tune a small transformer on scikit-learn's digits with HeteroFSDPStrategy (sharded), through LightningCLI.

    python examples/finetune_fsdp.py fit --config configs/fsdp_cpu.yaml          # two CPU ranks, one short on memory
    python examples/finetune_fsdp.py fit --config configs/fsdp_lab.yaml          # an A100 beside two RTX 3090s

Each 8×8 image is read as 8 tokens of 8 pixels. ``init_from`` starts from a full checkpoint (a ``.ckpt`` file, e.g.
one exported from a sharded run with ``lightning_hetero.resilience.sharded.export_full_checkpoint``): fine-tuning.
"""

import os
import sys
import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import DigitsDataModule

import lightning_hetero  # noqa: F401  (registers "hetero_fsdp")
from lightning_hetero.observe.errors import run_main


class Block(nn.Module):
    """A pre-norm transformer block: the unit the strategy shards (one all-gather each) and may checkpoint."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class DigitsTransformer(LightningModule):
    def __init__(self, width: int = 64, depth: int = 4, heads: int = 4, lr: float = 1e-3,
                 init_from: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(1, 8, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        if init_from:
            self.load_state_dict(torch.load(init_from, map_location="cpu", weights_only=False)["state_dict"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(-1, 8, 8)) + self.position
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class EpochProgress(Callback):
    """One line per epoch on rank 0 (the configs turn the progress bar off): its time and logged metrics."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.started = time.perf_counter()
        if trainer.global_rank == 0 and trainer.current_epoch == 0:
            print(f"training {trainer.max_epochs} epoch(s) of {trainer.num_training_batches} steps on "
                  f"{trainer.world_size} rank(s)...", flush=True)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank == 0:
            metrics = ", ".join(f"{k} {float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items()))
            print(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} "
                  f"({time.perf_counter() - self.started:.1f} s): {metrics}", flush=True)


def main(args: Optional[list[str]] = None) -> LightningCLI:
    cli = LightningCLI(DigitsTransformer, DigitsDataModule, args=args, save_config_kwargs={"overwrite": True},
                       trainer_defaults={"callbacks": [EpochProgress()]})
    trainer = cli.trainer
    if trainer.global_rank == 0 and trainer.state.fn == "fit":
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")
    return cli


if __name__ == "__main__":
    run_main(main, "finetune_fsdp.py")  # a bad argument: one line, not a traceback per rank
