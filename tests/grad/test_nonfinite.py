"""A non-finite loss on one rank: stopped before the update (naming rank and step), or skipped on every rank with
replicas identical, also under the shared loss scaler of ``precision_policy``; 2-process CPU fits (gloo, fork)."""

import os
from typing import Any

import pytest
import torch

from lightning_hetero.grad.nonfinite import NonFiniteCheck, NonFiniteError, gradients_finite, validate_nonfinite
from tests.helpers import TinyModel, fit_distributed

BAD_BATCH = 2  # the batch (and optimizer step) of epoch 0 whose loss is NaN on rank 1


class NaNOnRank1(TinyModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if self.global_rank == 1 and batch_idx == BAD_BATCH and self.current_epoch == 0:
            loss = loss * float("nan")
        return loss

    def on_train_end(self) -> None:
        check = next((c for c in self.trainer.callbacks if isinstance(c, NonFiniteCheck)), None)
        with open(os.path.join(self.trainer.default_root_dir, f"nonfinite{self.global_rank}.txt"), "w") as f:
            f.write("\n".join(check.messages) if check is not None else "no check")


def test_gradients_finite_and_mode_validation():
    assert gradients_finite([torch.ones(3), torch.tensor([3e38, -3e38])])  # large but finite: no overflow
    assert not gradients_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not gradients_finite([torch.tensor([float("-inf")])])
    assert gradients_finite([])
    with pytest.raises(ValueError, match=r"`nonfinite`='halt' is not one of \('stop', 'skip', 'ignore'\)"):
        validate_nonfinite("halt")


@pytest.mark.slow
def test_stop_names_the_rank_and_step_before_the_weights_change(tmp_path):
    with pytest.raises(Exception) as raised:
        fit_distributed(NaNOnRank1(n=64), str(tmp_path), 2, {"capacities": "equal", "resilience": {"nonfinite": "stop"}},
                        max_epochs=1)
    text = str(raised.value)
    assert "NonFiniteError" in text or isinstance(raised.value, NonFiniteError), text
    assert f"non-finite loss on rank 1 (host " in text and f"at step {BAD_BATCH}" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, {"*": "16-mixed"}])
def test_skip_keeps_replicas_identical_and_the_weights_finite(tmp_path, policy):
    """The bad step leaves the weights as they were, on both ranks; training goes on (with the loss scaler of
    ``precision_policy`` too, which skips the step itself)."""
    kwargs = {"capacities": "equal", "resilience": {"nonfinite": "skip"}}
    if policy is not None:
        kwargs["precision_policy"] = policy
    records = fit_distributed(NaNOnRank1(n=64), str(tmp_path), 2, kwargs, max_epochs=1, default_root_dir=tmp_path)
    for r in (0, 1):  # every rank reached the same verdict, once
        said = open(os.path.join(tmp_path, f"nonfinite{r}.txt")).read().splitlines()
        assert len(said) == 1, said
        assert "non-finite loss on rank 1 (host " in said[0] and f"at step {BAD_BATCH}; the step was skipped" in said[0]
        assert ("by the loss scaler" if policy else "by nonfinite='skip'") in said[0]
    p0, p1 = records[0]["params"], records[1]["params"]
    assert len(p0) == len(p1) == 8
    for a, b in zip(p0, p1):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    assert torch.equal(p0[BAD_BATCH], p0[BAD_BATCH - 1])  # the skipped step moved nothing
    assert not torch.equal(p0[BAD_BATCH + 1], p0[BAD_BATCH])  # the next one did


@pytest.mark.slow
def test_ignore_is_plain_ddp_and_the_default(tmp_path):
    records = fit_distributed(NaNOnRank1(n=64), str(tmp_path), 2, {"capacities": "equal"},
                              max_epochs=1, default_root_dir=tmp_path)
    assert open(os.path.join(tmp_path, "nonfinite0.txt")).read() == "no check"  # no callback, no cost
    assert not bool(torch.isfinite(records[0]["params"][-1]).all())  # what the check is there for
