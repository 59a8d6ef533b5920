"""A strategy's own precision plugin that clips by the whole model's norm: the given plugin's behaviour and state,
the given plugin untouched, and (one CPU process, fp16 with a loss scaler) the norm clipped after unscaling."""

import pickle

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_hetero.grad.clipping import WholeNormClipping, clipping_by_whole_norm
from tests.helpers import TinyModel, one_process_fit


class Calls:
    """A clip that records its calls (picklable: a module-level class)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[torch.Tensor], float]] = []

    def __call__(self, params: list[torch.Tensor], max_norm: float) -> None:
        self.calls.append((params, max_norm))


def _stepped(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    return optimizer


def test_the_plugin_is_a_copy_that_clips_by_norm_through_the_clip_and_leaves_the_given_one_alone() -> None:
    given, clip = MixedPrecision("bf16-mixed", "cpu"), Calls()
    own = clipping_by_whole_norm(given, clip)
    assert own is not given and isinstance(own, MixedPrecision) and isinstance(own, WholeNormClipping)
    # Lightning keys the plugin's checkpoint state by the class's qualified name; messages name the class.
    assert type(own).__qualname__ == type(own).__name__ == "MixedPrecision"
    assert own.precision == "bf16-mixed" and own.device == "cpu" and own.scaler is given.scaler
    assert "clip_grad_by_norm" not in vars(given)
    assert given.clip_grad_by_norm.__func__ is MixedPrecision.clip_grad_by_norm

    model = torch.nn.Linear(3, 2)
    optimizer = _stepped(model)
    own.clip_gradients(optimizer, 0.5, GradClipAlgorithmType.NORM)
    assert [(list(map(id, params)), max_norm) for params, max_norm in clip.calls] == [
        ([id(p) for p in model.parameters()], 0.5)]
    # By value it is per element: the class's own clipping.
    own.clip_gradients(optimizer, 1e-3, GradClipAlgorithmType.VALUE)
    assert len(clip.calls) == 1 and all(p.grad.abs().max() <= 1e-3 for p in model.parameters())


def test_a_copy_of_a_copy_is_made_from_the_given_class_and_pickles() -> None:
    first, second = Calls(), Calls()
    own = clipping_by_whole_norm(Precision(), first)
    again = clipping_by_whole_norm(own, second)
    assert type(again) is type(own) and type(own).given_class is Precision and again.whole_norm_clip is second
    assert own.whole_norm_clip is first
    loaded = pickle.loads(pickle.dumps(again))
    assert type(loaded) is type(again) and isinstance(loaded.whole_norm_clip, Calls)


class GradNorms(Callback):
    """The gradients' norm where Lightning's hooks see them before the optimizer step (after unscaling)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(float(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]).norm()))


def test_with_a_loss_scaler_the_clip_sees_unscaled_gradients() -> None:
    """fp16 with a GradScaler: Lightning unscales before clipping, and the copy keeps that order."""
    seen: list[float] = []

    def clip(params: list[torch.Tensor], max_norm: float) -> None:
        seen.append(float(torch.cat([p.grad.reshape(-1) for p in params]).norm()))
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    given, norms = MixedPrecision("16-mixed", "cpu"), GradNorms()
    with one_process_fit():
        trainer = Trainer(accelerator="cpu", devices=1, plugins=[clipping_by_whole_norm(given, clip)],
                          gradient_clip_val=0.05, max_steps=3, callbacks=[norms], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(TinyModel())
    assert given.scaler.get_scale() > 1000  # a real loss scale: a scaled norm would be far larger
    assert len(seen) == 3 and seen == pytest.approx(norms.norms, rel=1e-6)
    assert "clip_grad_by_norm" not in vars(given)
