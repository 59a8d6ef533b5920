"""Restart with nothing lost: one command, run again by ``torchrun --max-restarts`` after a rank dies mid-epoch.

    torchrun --nproc-per-node 2 --max-restarts 1 examples/resume_torchrun.py --out /tmp/run --crash-at 7
    torchrun --nproc-per-node 2 examples/resume_torchrun.py --out /tmp/ref        # uninterrupted, to compare
    torchrun --nproc-per-node 2 examples/resume_torchrun.py --out /tmp/cut --max-steps 7   # stop, save after fit
    torchrun --nproc-per-node 2 examples/resume_torchrun.py --out /tmp/cut                 # ... and go on

Rank 1 raises at step ``--crash-at`` of the first attempt; torchrun stops the other rank and starts both again with
the same arguments. ``HeteroDDPStrategy(resilience={"resume": "auto"})`` then restores the newest checkpoint of the
``ModelCheckpoint`` directory (every 3 steps here): weights, optimizer, shares, sampler position and RNG. At the end
rank 0 writes the final parameters to ``<out>/final.pt``; compare them with the uninterrupted run's. CPU and gloo
here; on GPUs drop ``--cpu``.
"""

import argparse
import os

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero import HeteroDDPStrategy


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(200, 8, generator=g), torch.randint(0, 4, (200,), generator=g))
        return DataLoader(data, batch_size=8, shuffle=True)


class CrashOnce(Callback):
    """Rank 1 dies at ``step`` unless a previous attempt already did (a marker file says so)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError(f"rank 1 killed at step {self.step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop there and `trainer.save_checkpoint`")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model()
    callbacks: list = [ModelCheckpoint(dirpath=os.path.join(args.out, "ckpts"), every_n_train_steps=3, save_top_k=-1)]
    if args.crash_at >= 0:
        callbacks.append(CrashOnce(args.crash_at, os.path.join(args.out, "crashed")))
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=HeteroDDPStrategy(capacities=[3, 1], resilience={"resume": "auto"},
                                   observation={"print_table": False}),
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    if args.max_steps > 0:  # mid-epoch: the strategy writes the true position, so the next run goes on from it
        trainer.save_checkpoint(os.path.join(args.out, "ckpts", "stopped.ckpt"))
    if trainer.global_rank == 0:
        torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    main()
