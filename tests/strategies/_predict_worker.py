"""A predict run whose writers read every prediction, for the predict tests (a standalone script for the popen
launcher, which re-executes a script, not pytest; the same function runs in-process for spawn and fork).

    python tests/strategies/_predict_worker.py OUT_DIR ddp|fsdp SIZES CAPACITIES   # e.g. 3,1 and 3,1

Each rank saves ``rank<r>.pt``: every call of a per-batch writer (loader, step, batch indices, the predicted samples),
what an epoch writer received, and what ``trainer.predict`` returned (popen: each process returns its own).
"""

import os
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy  # noqa: E402
from tests.helpers import IndexedDataset, TinyModel  # noqa: E402


class InOrder(IterableDataset):
    """A plain stream: the samples of a map-style set in order, no sharding of its own."""

    def __init__(self, n: int) -> None:
        self.data = IndexedDataset(n, seed=1)

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))


class PredictModel(TinyModel):
    """Predicts ``[sample index, output]`` per sample of one or several predict loaders (batch size 1), map-style or
    streamed."""

    def __init__(self, sizes: list[int], stream: bool = False) -> None:
        super().__init__(batch_size=1)
        self.sizes = list(sizes)
        self.stream = stream

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x, _, index = batch
        return torch.stack([index.float(), self.net(x)[:, 0]], dim=1)

    def predict_dataloader(self) -> Any:
        loaders = [DataLoader(InOrder(n) if self.stream else IndexedDataset(n, seed=1), batch_size=1)
                   for n in self.sizes]
        return loaders[0] if len(loaders) == 1 else loaders


def _samples(prediction: torch.Tensor) -> list[int]:
    return prediction[:, 0].long().tolist()  # a `None` prediction fails here, as a user's writer would


class BatchWriter(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.calls: list[tuple[int, int, list[int], list[int]]] = []

    def write_on_batch_end(self, trainer: Trainer, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        self.calls.append((dataloader_idx, batch_idx, list(batch_indices), _samples(prediction)))


class EpochWriter(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="epoch")
        self.received: dict[str, Any] = {}

    def write_on_epoch_end(self, trainer: Trainer, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        per_loader = predictions if len(pl_module.sizes) > 1 else [predictions]
        self.received = {"predictions": [[_samples(p) for p in loader] for loader in per_loader],
                         "batch_indices": [[list(i) for i in loader] for loader in batch_indices]}


class Save(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_predict_end(self, trainer: Trainer, pl_module: Any) -> None:
        batch, epoch = (next(c for c in trainer.callbacks if isinstance(c, kind))
                        for kind in (BatchWriter, EpochWriter))
        torch.save({"batch": batch.calls, "epoch": epoch.received},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def run(out_dir: str, strategy: str, sizes: list[int], capacities: list[float], start_method: str,
        stream: bool = False) -> Any:
    """``trainer.predict`` over ``len(capacities)`` CPU ranks; what it returned (rank 0's under spawn and fork)."""
    kind = HeteroDDPStrategy if strategy == "ddp" else HeteroFSDPStrategy
    trainer = Trainer(accelerator="cpu", devices=len(capacities), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[BatchWriter(), EpochWriter(), Save(out_dir)],
                      strategy=kind(start_method=start_method, capacities=capacities,
                                    observation={"print_table": False}, resilience={"timeout": 120}))
    returned = trainer.predict(PredictModel(sizes, stream))
    if returned is not None:
        per_loader = returned if len(sizes) > 1 else [returned]
        torch.save([[_samples(p) for p in loader] for loader in per_loader],
                   os.path.join(out_dir, f"returned{trainer.global_rank}.pt"))
    return returned


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], _ints(sys.argv[3]), _ints(sys.argv[4]), "popen")
