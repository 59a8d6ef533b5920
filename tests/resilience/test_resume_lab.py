"""Resume on a changed lab: other world sizes (3 -> 1, 3 -> 2, 3 -> 4, 2 -> 3), other cards, and checkpoints shared with Lightning's DDPStrategy.

The global batch keeps its size, the epoch goes on at the same global batch with a split planned for the ranks that
are there, and every sample is seen once per epoch. Without compression the parameters equal one process trained on
the same global batches; with top-k compression the error-feedback residuals of the saved ranks are folded into the
new ones (their sum, in units of the mean gradient, is kept).
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
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_hetero import HeteroDDPStrategy, TopKCompression
from tests.helpers import IndexedDataset, Recorder, TinyModel, flat_params, free_port, max_rel_diff, reference_run

pytestmark = pytest.mark.slow

B, EPOCHS = 4, 2  # loader batch size; the first run's global batch is B x its world size


def _run(strategy: Any, world: int, n: int, out_dir: str, ckpt_dir: Optional[str] = None, stop: int = -1,
         ckpt_path: Optional[str] = None, extra: tuple = (), every: Optional[int] = None) -> list[dict]:
    """Fit ``world`` forked CPU ranks on a fresh ``TinyModel`` (seed 0); checkpoint at step ``stop`` (or every
    ``every`` steps) and stop there."""
    os.environ["MASTER_PORT"] = str(free_port())
    torch.manual_seed(0)
    model = TinyModel(batch_size=B, n=n)
    callbacks: list[Any] = [Recorder(out_dir), *extra]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every or stop,
                                         save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=EPOCHS, max_steps=stop,
                      callbacks=callbacks, logger=False, enable_checkpointing=bool(ckpt_dir),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def _hetero(start_method: str = "fork", **kwargs: Any) -> HeteroDDPStrategy:
    return HeteroDDPStrategy(start_method=start_method, observation={"print_table": False},
                             resilience={"timeout": 120}, **kwargs)


def _global_batches(records: list[dict]) -> list[list[int]]:
    """Per step, the samples of all ranks together."""
    return [sorted(i for rec in records for i in rec["indices"][k]) for k in range(len(records[0]["indices"]))]


def _assert_each_sample_once(batches: list[list[int]], n: int, per_epoch: int) -> None:
    assert len(batches) == EPOCHS * per_epoch
    for epoch in range(EPOCHS):
        seen = Counter(i for b in batches[epoch * per_epoch:(epoch + 1) * per_epoch] for i in b)
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}


N3, G3, STOP3 = 72, 3 * B, 4  # 6 global batches of 12 per epoch; stop mid-epoch 0


@pytest.fixture(scope="module")
def three_rank_checkpoint() -> tuple[str, list[dict]]:
    ckpt_dir = tempfile.mkdtemp()
    first = _run(_hetero(capacities=[3, 2, 1]), 3, N3, tempfile.mkdtemp(), ckpt_dir=ckpt_dir, stop=STOP3)
    (path,) = glob.glob(os.path.join(ckpt_dir, f"*step={STOP3}*.ckpt"))
    return path, first


@pytest.mark.parametrize("capacities, split", [([1, 3], [3, 9]), ([1, 1, 2, 2], [2, 2, 4, 4]), ([1], [12])])
def test_three_ranks_resume_on_one_two_or_four(three_rank_checkpoint: tuple[str, list[dict]], capacities: list,
                                           split: list) -> None:
    path, first = three_rank_checkpoint
    world = len(capacities)
    # One device in a fresh process: a process forked from this one after it computed with intra-op threads can stall.
    strategy = _hetero(capacities=capacities, start_method="spawn" if world == 1 else "fork")
    resumed = _run(strategy, world, N3, tempfile.mkdtemp(), ckpt_path=path)
    # The global batch keeps its 12 samples (not world x 4), split by the new capacities.
    assert [len(i) for i in first[0]["indices"]] == [6] * STOP3
    assert [{len(i) for i in resumed[r]["indices"]} for r in range(world)] == [{b} for b in split]
    batches = _global_batches(first) + _global_batches(resumed)
    _assert_each_sample_once(batches, N3, N3 // G3)
    torch.manual_seed(0)
    params, reference = reference_run(TinyModel(batch_size=B, n=N3), 3, [1, 1, 1], EPOCHS)
    assert batches == [sorted(b) for b in reference]  # the same global batches, in the same order
    assert max_rel_diff(resumed[0]["params"][-1], params[-1]) <= 1e-6
    assert all(torch.equal(resumed[0]["params"][-1], resumed[r]["params"][-1]) for r in range(world))


class _ResidualSum(Callback):
    """Before the first resumed step: the sum over ranks of the restored (not yet laid out) top-k residuals."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        pending = trainer.strategy.compression.state.buckets._pending["residual"]
        total = torch.cat([pending[p].reshape(-1) for p in sorted(pending)]) if pending else torch.zeros(0)
        sizes = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, (sorted(pending), total))
        if trainer.global_rank == 0:
            torch.save(sizes, os.path.join(self.out_dir, "residuals.pt"))


def test_two_ranks_resume_on_three_folds_residuals() -> None:
    n, stop = 48, 3  # 6 global batches of 8 per epoch
    topk = TopKCompression(ratio=0.25)
    ckpt_dir, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    first = _run(_hetero(capacities="equal", compression=topk), 2, n, tempfile.mkdtemp(), ckpt_dir=ckpt_dir,
                 stop=stop)
    (path,) = glob.glob(os.path.join(ckpt_dir, f"*step={stop}*.ckpt"))
    resumed = _run(_hetero(capacities="equal", compression=topk), 3, n, out, ckpt_path=path,
                   extra=(_ResidualSum(out),))
    _assert_each_sample_once(_global_batches(first) + _global_batches(resumed[:3]), n, n // 8)
    assert sorted(len(i) for i in (r["indices"][0] for r in resumed)) == [2, 3, 3]

    saved = torch.load(path, weights_only=False)["lightning_hetero"]["ranks"]
    old = [s["compression"]["buckets"]["residual"] for s in saved]
    params = sorted(old[0])
    old_sum = sum(torch.cat([o[p].reshape(-1) for p in params]) for o in old)
    assert old_sum.abs().sum() > 0
    new = torch.load(os.path.join(out, "residuals.pt"))
    new_sum = sum(total for keys, total in new if keys)
    # Saved with 2 compressing ranks, resumed on 3: each residual is 1/n of what is owed to the mean.
    assert torch.allclose(new_sum, old_sum * 3 / 2, rtol=1e-6, atol=1e-7)
    assert [bool(keys) for keys, _ in new] == [True, True, False]  # survivors keep theirs; rank 2 starts empty


def test_start_from_plain_ddp_checkpoint() -> None:
    """A `DDPStrategy` checkpoint at an epoch end: the next epoch runs on the hetero split, every sample once.
    Mid-epoch (DDP's sample order is not in its checkpoint): the epoch goes on at the same global batch index."""
    n, per_epoch = 48, 6
    ckpt_dir = tempfile.mkdtemp()
    _run(DDPStrategy(start_method="fork"), 2, n, tempfile.mkdtemp(), ckpt_dir=ckpt_dir, stop=per_epoch, every=3)
    mid = _run(_hetero(capacities=[3, 1]), 2, n, tempfile.mkdtemp(),
               ckpt_path=os.path.join(ckpt_dir, "epoch=0-step=3.ckpt"))
    batches = _global_batches(mid)
    assert len(batches) == 3 + per_epoch and {len(b) for b in batches} == {8}
    assert sorted(i for b in batches[3:] for i in b) == list(range(n))
    path = os.path.join(ckpt_dir, f"epoch=0-step={per_epoch}.ckpt")
    resumed = _run(_hetero(capacities=[3, 1]), 2, n, tempfile.mkdtemp(), ckpt_path=path)
    batches = _global_batches(resumed)
    assert len(batches) == per_epoch and {len(i) for i in resumed[0]["indices"]} == {6}
    assert sorted(i for b in batches for i in b) == list(range(n))
    saved = torch.load(path, weights_only=False)["state_dict"]
    model = TinyModel(batch_size=B, n=n)
    model.load_state_dict(saved)
    assert not torch.equal(resumed[0]["params"][0], flat_params(model))  # trained on from the loaded weights


def test_hetero_checkpoint_loads_into_one_device_and_plain_ddp(three_rank_checkpoint: tuple[str, list[dict]]) -> None:
    path, first = three_rank_checkpoint
    # Evaluation on one device: the strategy's callback state is ignored, the weights are those saved.
    model = TinyModel(batch_size=B, n=N3)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.validate(model, DataLoader(IndexedDataset(N3), batch_size=8), ckpt_path=path, verbose=False)
    assert torch.equal(flat_params(model), first[0]["params"][-1])
    loaded = TinyModel.load_from_checkpoint(path)
    assert torch.equal(flat_params(loaded), first[0]["params"][-1])
    # Fine-tuning with Lightning's DDPStrategy on 2 ranks from the 3-rank checkpoint.
    out = _run(DDPStrategy(start_method="fork"), 2, N3, tempfile.mkdtemp(), ckpt_path=path)
    assert out[0]["steps"] > STOP3 and torch.equal(out[0]["params"][-1], out[1]["params"][-1])


def test_other_cards_same_world_size_replan_the_shares() -> None:
    """The cards behind the ranks changed (swapped here): the saved split is not kept, this lab's is planned."""
    n, stop = 48, 3
    caps = {"box B": 3, "*": 1}
    ckpt_dir = tempfile.mkdtemp()
    first = _run(_hetero(capacities=caps, emulate=[None, {"name": "box B"}]), 2, n, tempfile.mkdtemp(),
                 ckpt_dir=ckpt_dir, stop=stop)
    (path,) = glob.glob(os.path.join(ckpt_dir, "*.ckpt"))
    resumed = _run(_hetero(capacities=caps, emulate=[{"name": "box B"}, None]), 2, n, tempfile.mkdtemp(),
                   ckpt_path=path)
    assert [len(first[r]["indices"][0]) for r in range(2)] == [2, 6]
    assert [len(resumed[r]["indices"][0]) for r in range(2)] == [6, 2]
    _assert_each_sample_once(_global_batches(first) + _global_batches(resumed), n, n // 8)


def test_another_explicit_global_batch_is_refused(three_rank_checkpoint: tuple[str, list[dict]]) -> None:
    path, _ = three_rank_checkpoint
    with pytest.raises(Exception, match="global batch of 12"):
        _run(_hetero(capacities="equal", global_batch_size=8), 2, N3, tempfile.mkdtemp(), ckpt_path=path)
