"""Mid-epoch resume after a share change: same global order, every sample once, same parameters as one run."""

import glob
import os
import tempfile
from collections import Counter
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_hetero.rebalance as rebalance
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


def _fit(out_dir: str, ckpt_dir: Optional[str] = None, ckpt_path: Optional[str] = None,
         max_steps: int = -1) -> list[dict]:
    """Fit 2 forked CPU ranks; with ``ckpt_dir``, checkpoint at step ``max_steps`` (where the run stops)."""
    os.environ["MASTER_PORT"] = str(free_port())
    torch.manual_seed(0)
    model = TinyModel("adam", batch_size=G // 2, n=N)
    strategy = HeteroDDPStrategy(start_method="fork", print_table=False, timeout=120, capacities="equal",
                                 rebalance=True, rebalance_every=3, rebalance_threshold=0.05)
    callbacks: list[Any] = [Recorder(out_dir)]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=max_steps, save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, max_steps=max_steps,
                      callbacks=callbacks, logger=False, enable_checkpointing=bool(ckpt_dir),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


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
    state = torch.load(ckpt, weights_only=False)["callbacks"]["lightning_hetero.RankState"]["ranks"][0]["shares"]
    assert state["sampler"]["changes"][-1][1] != [1.0, 1.0]

    for r in range(2):
        # The resumed run trains on exactly the batches the uninterrupted run trained on after step STOP_AT.
        assert first[r]["indices"] + resumed[r]["indices"] == full[r]["indices"]
        assert max_rel_diff(resumed[r]["params"][-1], full[r]["params"][-1]) <= 1e-6
    per_epoch = N // G
    both = [first[r]["indices"] + resumed[r]["indices"] for r in range(2)]
    for epoch in range(EPOCHS):
        seen = Counter(i for r in range(2) for batch in both[r][epoch * per_epoch:(epoch + 1) * per_epoch]
                       for i in batch)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
