"""Mid-epoch resume after a share change: same global order, every sample once, same parameters as one run.

The model has dropout, so the per-rank random generators must be restored too. Also: ``resume="auto"`` after a
crash, and a checkpoint saved after ``fit`` stopped at ``max_steps`` inside an epoch.
"""

import glob
import os
import tempfile
from collections import Counter
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_hetero.plan.rebalance as rebalance
from lightning_hetero import HeteroDDPStrategy
from tests.helpers import Recorder, TinyModel, free_port, max_rel_diff

N, G, EPOCHS = 80, 8, 2  # 10 steps per epoch


def _deterministic_gather(real: Any) -> Any:
    """Measurements as if rank 1 took 3x as long per sample: the decisions are the same in every run."""

    def gather(values: list, device: torch.device) -> list:
        samples, _, yielded = values
        cost = 0.001 if dist.get_rank() == 0 else 0.003
        return real([samples, samples * cost, yielded], device)

    return gather


class _Crash(Callback):
    """Every rank fails at the start of batch ``step`` (a job killed mid-epoch)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("killed")


class _SaveAtEnd(Callback):
    """``trainer.save_checkpoint`` once training stopped (what a script does after ``fit`` returns)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)


def _fit(out_dir: str, ckpt_dir: Optional[str] = None, ckpt_path: Optional[str] = None,
         max_steps: int = -1, every: Optional[int] = None, resume: Optional[str] = None,
         extra: tuple = ()) -> list[dict]:
    """Fit 2 forked CPU ranks; with ``ckpt_dir``, checkpoint every ``every`` steps (default: at ``max_steps``)."""
    os.environ["MASTER_PORT"] = str(free_port())
    torch.manual_seed(0)
    model = TinyModel("adam", batch_size=G // 2, n=N, dropout=0.3)
    strategy = HeteroDDPStrategy(start_method="fork", observation={"print_table": False}, capacities="equal",
                                 rebalance={"every": 3, "threshold": 0.05},
                                 resilience={"timeout": 120, "resume": resume})
    callbacks: list[Any] = [Recorder(out_dir), *extra]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every or max_steps, save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, max_steps=max_steps,
                      callbacks=callbacks, logger=False, enable_checkpointing=bool(ckpt_dir),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def _assert_each_sample_once(both: list[list[list[int]]]) -> None:
    per_epoch = N // G
    for epoch in range(EPOCHS):
        seen = Counter(i for r in range(2) for batch in both[r][epoch * per_epoch:(epoch + 1) * per_epoch]
                       for i in batch)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}


@pytest.fixture(scope="module")
def uninterrupted() -> list[dict]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
        return _fit(tempfile.mkdtemp())


# 7: mid-epoch 0, after the rebalance; 10: after the epoch's last batch (Lightning goes on with epoch 1).
@pytest.mark.parametrize("STOP_AT", [7, 10])
def test_resume_equals_uninterrupted(uninterrupted: list[dict], STOP_AT: int, monkeypatch: Any) -> None:
    monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
    full = uninterrupted
    ckpt_dir = tempfile.mkdtemp()
    first = _fit(tempfile.mkdtemp(), ckpt_dir=ckpt_dir, max_steps=STOP_AT)
    (ckpt,) = glob.glob(os.path.join(ckpt_dir, f"*step={STOP_AT}*.ckpt"))
    resumed = _fit(tempfile.mkdtemp(), ckpt_path=ckpt)

    # The rebalance happened before the interruption (split 4/4 -> 6/2) and is carried over.
    assert [len(i) for i in full[1]["indices"]][:3] == [4, 4, 4]
    assert [len(i) for i in full[1]["indices"]][-1] == 2
    state = torch.load(ckpt, weights_only=False)["lightning_hetero"]["ranks"][0]["shares"]
    assert state["sampler"]["changes"][-1][1] != [1.0, 1.0]

    for r in range(2):
        # The resumed run trains on exactly the batches the uninterrupted run trained on after step STOP_AT.
        assert first[r]["indices"] + resumed[r]["indices"] == full[r]["indices"]
        assert max_rel_diff(resumed[r]["params"][-1], full[r]["params"][-1]) <= 1e-6
    _assert_each_sample_once([first[r]["indices"] + resumed[r]["indices"] for r in range(2)])


@pytest.mark.slow
def test_auto_resume_after_crash(uninterrupted: list[dict], monkeypatch: Any) -> None:
    """The same command run again after a crash at step 8 goes on from the newest checkpoint (step 6) by itself."""
    monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
    ckpt_dir = tempfile.mkdtemp()
    with pytest.raises(Exception, match="killed"):
        _fit(tempfile.mkdtemp(), ckpt_dir=ckpt_dir, every=3, resume="auto", extra=(_Crash(8),))
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=3.ckpt", "epoch=0-step=3.ckpt.sha256", "epoch=0-step=6.ckpt",
                                            "epoch=0-step=6.ckpt.sha256"]  # no temporary files
    resumed = _fit(tempfile.mkdtemp(), ckpt_dir=ckpt_dir, every=3, resume="auto")
    for r in range(2):
        assert resumed[r]["indices"] == uninterrupted[r]["indices"][6:]
        assert max_rel_diff(resumed[r]["params"][-1], uninterrupted[r]["params"][-1]) <= 1e-6


@pytest.mark.slow
def test_auto_resume_from_a_copied_folder_goes_by_recorded_steps(uninterrupted: list[dict], monkeypatch: Any) -> None:
    """Checkpoints at steps 3..15 copied as `cp -r` does (the times are the copy's), step 3's the newest time: the
    re-run goes on from step 15, where the checkpoints say training stood."""
    import shutil
    import time

    monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
    saved, copy = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "copy")
    with pytest.raises(Exception, match="killed"):
        _fit(tempfile.mkdtemp(), ckpt_dir=saved, every=3, extra=(_Crash(16),))
    shutil.copytree(saved, copy, copy_function=shutil.copy)
    now = time.time()
    for name in os.listdir(copy):
        step = int(name.split("step=")[1].split(".")[0])
        os.utime(os.path.join(copy, name), (now - step, now - step))  # step 3 written last
    resumed = _fit(tempfile.mkdtemp(), ckpt_dir=copy, every=3, resume="auto")
    for r in range(2):
        assert resumed[r]["indices"] == uninterrupted[r]["indices"][15:]
        assert max_rel_diff(resumed[r]["params"][-1], uninterrupted[r]["params"][-1]) <= 1e-6


@pytest.mark.slow
def test_checkpoint_after_max_steps_goes_on_mid_epoch(uninterrupted: list[dict], monkeypatch: Any) -> None:
    """Lightning records the epoch a `max_steps` stop interrupted as finished; the strategy reopens it."""
    monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
    path = os.path.join(tempfile.mkdtemp(), "end.ckpt")
    first = _fit(tempfile.mkdtemp(), max_steps=7, extra=(_SaveAtEnd(path),))
    assert torch.load(path, weights_only=False)["epoch"] == 0  # Lightning alone writes 1 (the next epoch)
    resumed = _fit(tempfile.mkdtemp(), ckpt_path=path)
    for r in range(2):
        assert first[r]["indices"] + resumed[r]["indices"] == uninterrupted[r]["indices"]
        assert max_rel_diff(resumed[r]["params"][-1], uninterrupted[r]["params"][-1]) <= 1e-6
    _assert_each_sample_once([first[r]["indices"] + resumed[r]["indices"] for r in range(2)])
