"""A user's own LightningCLI script, as ``doctor --lab --script`` rehearses it: the script names its model class, so
its config has no ``class_path`` for the model. ``fail: true`` makes the model's training step raise its own error."""

from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI

from tests.helpers import TinyModel

MODEL_ERROR = "MyModel: the model's own error"


class MyModel(TinyModel):
    def __init__(self, batch_size: int = 4, n: int = 53, fail: bool = False) -> None:
        super().__init__(batch_size=batch_size, n=n)
        self.fail = fail

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail:
            raise ValueError(MODEL_ERROR)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The hyperparameters are this class's (TinyModel's `optimizer` is not among them).
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    LightningCLI(MyModel)
