"""Shared pieces for the CPU tests: a tiny model, an indexed dataset, fork-launched fits and a one-process reference.

Multi-process fits use Lightning's fork launcher (fast, in-process). Each rank records, after every optimizer step,
its flattened parameters and the dataset indices it trained on; the test then compares ranks with each other and
with one process trained on the same global batches.
"""

import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler


@contextmanager
def one_process_fit() -> Iterator[None]:
    """A fit in the test process itself, undone afterwards: the launcher leaves LOCAL_RANK, MASTER_PORT ... and
    Lightning a thread count and a process group behind, which later tests would get back."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)


class IndexedDataset(Dataset):
    """Random regression-like classification data that also returns each sample's index."""

    def __init__(self, n: int, features: int = 8, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class TinyModel(LightningModule):
    def __init__(self, optimizer: str = "sgd", features: int = 8, classes: int = 4, batch_size: int = 4,
                 n: int = 53, lr: float = 0.1, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        hidden = [nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])  # dropout draws from the global RNG
        self.net = nn.Sequential(nn.Linear(features, 16), *hidden, nn.Linear(16, classes))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr / 10)
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr / 10, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.hparams.n), batch_size=self.hparams.batch_size, shuffle=True)


def flat_params(module: nn.Module) -> torch.Tensor:
    # Host copies: the test process that loads them must not initialise CUDA (later fork launches would fail).
    # Sharded parameters are gathered whole (a collective: every rank records).
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).cpu()
                      for p in module.parameters()])


class Recorder(Callback):
    """Saves, per rank, the parameters after every optimizer step and the indices of every batch."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.params: list[torch.Tensor] = []
        self.indices: list[list[int]] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.params.append(flat_params(pl_module))
        self.indices.append([int(i) for i in batch[2]])
        if "train_loss" in trainer.callback_metrics:
            self.logged.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        buffers = {name: b.detach().cpu().clone() for name, b in pl_module.named_buffers()}
        torch.save({"params": self.params, "indices": self.indices, "logged": self.logged,
                    "steps": trainer.global_step, "buffers": buffers},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_distributed(model: LightningModule, out_dir: str, world: int, strategy_kwargs: Optional[dict] = None,
                    max_epochs: int = 3, strategy_class: type = HeteroDDPStrategy, accelerator: str = "cpu",
                    devices: Optional[int] = None, **trainer_kwargs: Any) -> list[dict]:
    """Fit ``model`` over ``world`` forked processes (CPU; ``accelerator="gpu"`` for CUDA, ``devices`` as Lightning
    counts them when several ranks share one GPU); return each rank's record."""
    os.environ["MASTER_PORT"] = str(free_port())
    options: dict = {"observation": {"print_table": False}, "resilience": {"timeout": 120}}
    for key, value in (strategy_kwargs or {}).items():  # a group given here adds to the defaults above
        options[key] = {**options[key], **value} if isinstance(value, dict) and key in options else value
    strategy = strategy_class(start_method="fork", **options)
    trainer = Trainer(accelerator=accelerator, devices=devices or world, strategy=strategy, max_epochs=max_epochs,
                      callbacks=[Recorder(out_dir)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      **trainer_kwargs)
    trainer.fit(model)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def reference_run(model: TinyModel, world: int, capacities: Sequence[float], epochs: int, seed: int = 0,
                  shuffle_within: bool = False, equal_rank_weights: bool = False, accumulate: int = 1,
                  after_backward: Optional[Callable[[TinyModel], None]] = None
                  ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """One process trained on the same global batches; returns params after each step and the global batches.

    ``shuffle_within`` reorders samples inside each global batch: the run-to-run floor of summation order.
    ``equal_rank_weights`` averages the ranks' slice losses equally, as plain DDP would (the wrong answer).
    ``accumulate`` steps the optimizer every that many global batches (and at the end of an epoch), with each
    batch's loss divided by it, as Lightning's ``accumulate_grad_batches`` does. ``after_backward(model)`` runs after
    each backward, as an ``on_after_backward`` hook does.
    """
    dataset = IndexedDataset(model.hparams.n)
    g = model.hparams.batch_size * world
    order = GlobalOrder(len(dataset), shuffle=True, seed=seed)
    sampler = HeteroBatchSampler(order, g, capacities, rank=0, drop_last=False)
    optimizer = model.configure_optimizers()
    params, batches = [], []
    for epoch in range(epochs):
        order.set_epoch(epoch)
        epoch_batches = sampler.global_batches()
        for k, batch in enumerate(epoch_batches):
            batches.append(batch)
            idx = torch.tensor(batch)
            if shuffle_within:
                idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(len(batches)))]
            if equal_rank_weights:
                slices = [torch.tensor(sampler.rank_slice(k, batch, r))
                          for r in range(world)]
                loss = sum(model.loss((dataset.x[i], dataset.y[i], i)) for i in slices if len(i)) / world
            else:
                loss = model.loss((dataset.x[idx], dataset.y[idx], idx))
            (loss / accumulate).backward()
            if after_backward is not None:
                after_backward(model)
            if steps_optimizer(k, len(epoch_batches), accumulate):
                optimizer.step()
                optimizer.zero_grad()
            params.append(flat_params(model))
    return params, batches


def steps_optimizer(k: int, epoch_batches: int, accumulate: int) -> bool:
    """Whether Lightning steps the optimizer after batch ``k`` of an epoch of ``epoch_batches``: at the end of every
    ``accumulate_grad_batches`` window and of the epoch."""
    return (k + 1) % accumulate == 0 or k + 1 == epoch_batches


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().max() / b.abs().max()).item())


def retry_timing(attempts: int, attempt: Callable[[int], Any]) -> Any:
    """``attempt(i)`` until one passes, ``attempts`` times at most: for timing bands that a loaded host's noise can
    leave for one run (the 2-core CI machine runs the ranks of a fit beside the test's own process). A measurement
    that stays outside its band fails; every failed attempt's message is printed (``pytest -s`` shows them)."""
    for i in range(attempts):
        try:
            return attempt(i)
        except AssertionError as failed:
            if i == attempts - 1:
                raise
            print(f"timing attempt {i + 1} of {attempts} outside its band, measuring again: {failed}")
