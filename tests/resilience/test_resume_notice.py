"""After an exact mid-epoch resume Lightning's "unreliable results" warning is wrong: it is silenced for that run
only, by its message."""

import glob
import os
import tempfile
import warnings
from typing import Any

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities.warnings import PossibleUserWarning

import lightning_hetero.plan.rebalance as rebalance
from lightning_hetero.observe.notices import (
    INEXACT_RESUME,
    restore_inexact_resume_warning,
    silence_inexact_resume_warning,
)
from tests.resilience.test_resume import _deterministic_gather, _fit


class _WarningsAtEpochStart(Callback):
    """Records the warnings raised between ``on_train_start`` and the first ``on_train_epoch_start`` (where the
    training loop resets and Lightning warns about a mid-epoch resume) into ``warned{rank}.txt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self._catcher, self._seen = out_dir, None, None

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        self._catcher = warnings.catch_warnings(record=True)  # the filters in place (the strategy's) still apply
        self._seen = self._catcher.__enter__()

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        if self._catcher is None:
            return
        self._catcher.__exit__(None, None, None)
        with open(os.path.join(self.out_dir, f"warned{trainer.global_rank}.txt"), "w") as f:
            f.write("\n".join(str(w.message) for w in self._seen))
        self._catcher = None


def test_silencing_is_narrow_and_undone():
    def warned(*messages: str) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            for message in messages:
                warnings.warn_explicit(message, PossibleUserWarning, "training_epoch_loop.py", 1)
        return [str(w.message) for w in seen]

    resume = INEXACT_RESUME + " and your dataloader is not resumable."
    silence_inexact_resume_warning()
    try:
        assert warned(resume, "another warning") == ["another warning"]
    finally:
        restore_inexact_resume_warning()
    assert warned(resume) == [resume]


@pytest.mark.slow
def test_exact_mid_epoch_resume_does_not_warn_of_unreliable_results(monkeypatch):
    monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
    ckpt_dir, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    _fit(tempfile.mkdtemp(), ckpt_dir=ckpt_dir, max_steps=7)
    (ckpt,) = glob.glob(os.path.join(ckpt_dir, "*step=7*.ckpt"))
    _fit(tempfile.mkdtemp(), ckpt_path=ckpt, extra=(_WarningsAtEpochStart(out),))
    for r in range(2):
        warned = open(os.path.join(out, f"warned{r}.txt")).read()
        assert "resuming from a checkpoint that ended before the epoch ended" not in warned, warned
