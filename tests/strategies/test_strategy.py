"""Strategy surface: bad input, registry names, weighted step logging, loaders for every stage."""

import copy
import math
import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

from lightning_hetero import HeteroDDPStrategy
from tests.helpers import IndexedDataset, TinyModel, fit_distributed, free_port, one_process_fit


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"capacities": [1, -1]}, "capacities"),
        ({"capacities": [1, 0]}, "capacities"),
        ({"capacities": [1, math.nan]}, "capacities"),
        ({"capacities": []}, "capacities"),
        ({"capacities": "fastest"}, "capacities"),
        ({"capacities": {}}, "capacities"),
        ({"capacities": {"A100": 0}}, "capacities"),
        ({"capacities": 3}, "capacities"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"resilience": {"timeout": -5}}, "timeout"),
        ({"ddp_kwargs": {"device_ids": [0]}}, "ddp_kwargs"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HeteroDDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacities": [1, 1, 1]}, "capacities.*3 weights but the job has 2 ranks"),
        ({"capacities": {"A100": 3.0, "3090": 1.0}}, r"capacities.*match neither rank 0 \(device name 'cpu'"),
        ({"capacities": [1, 1], "global_batch_size": 1}, "global_batch_size.*smaller than the world size"),
    ],
)
def test_bad_setup_fails_on_every_rank_without_hanging(tmp_path, kwargs, message):
    with pytest.raises(Exception, match=message):
        fit_distributed(TinyModel(), str(tmp_path), 2, kwargs, max_epochs=1)


def test_registry_names():
    for name in ("hetero_ddp", "hetero_ddp_spawn", "hetero_ddp_fork", "hetero_ddp_notebook"):
        assert name in StrategyRegistry
    trainer = Trainer(strategy="hetero_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, HeteroDDPStrategy)
    assert trainer.strategy._start_method == "popen"


class _RankValueModel(TinyModel):
    def training_step(self, batch, batch_idx):
        self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


class _Metrics(Callback):
    def __init__(self, out_dir):
        self.out_dir, self.values = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["rank_value"]))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.values, os.path.join(self.out_dir, f"values{trainer.global_rank}.pt"))


def test_step_logging_is_weighted_by_local_batch(tmp_path):
    """rank 0 logs 0, rank 1 logs 1; with a 6/2 split of each 8-sample batch the weighted mean is 0.25, not 0.5."""
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_Metrics(str(tmp_path))],
        strategy=HeteroDDPStrategy(capacities=[3, 1], start_method="fork", observation={"print_table": False}),
    )
    trainer.fit(_RankValueModel(n=48))
    values = torch.load(os.path.join(tmp_path, "values0.pt"))
    assert values == [0.25] * 6


class _EvalModel(TinyModel):
    def val_dataloader(self):
        return DataLoader(IndexedDataset(37, seed=1), batch_size=4)

    def validation_step(self, batch, batch_idx):
        self.seen.extend(int(i) for i in batch[2])
        super().validation_step(batch, batch_idx)

    def on_validation_epoch_start(self):
        self.seen = []

    def on_validation_epoch_end(self):
        torch.save(self.seen, os.path.join(self.out_dir, f"val{self.global_rank}.pt"))


def test_validation_loader_is_split_without_duplicates(tmp_path):
    model = _EvalModel(n=16)
    model.out_dir = str(tmp_path)
    fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=1)
    seen = [torch.load(os.path.join(tmp_path, f"val{r}.pt")) for r in range(2)]
    # 37 samples, global batch 8 split 6 + 2: rank 0 evaluates 3/4 of them, and together every sample once
    # (the last global batch of 5 splits 4 + 1).
    assert len(seen[0]) == 6 * 4 + 4 and len(seen[1]) == 2 * 4 + 1
    assert sorted(seen[0] + seen[1]) == list(range(37))


def test_global_batch_size_override(tmp_path):
    seed_everything(0)
    records = fit_distributed(TinyModel(n=40), str(tmp_path), 2, {"capacities": [3, 1], "global_batch_size": 20},
                              max_epochs=1)
    assert [len(b) for b in records[0]["indices"]] == [15, 15]
    assert [len(b) for b in records[1]["indices"]] == [5, 5]


def test_strategy_pickles_for_the_spawn_launcher():
    """`start_method="spawn"` pickles the strategy with every option set."""
    import pickle

    from lightning_hetero import PowerSGDCompression

    strategy = HeteroDDPStrategy(capacities={"A100": 3, "*": 1}, rebalance=True, emulate=[None, {"slowdown": 2}],
                                 compression=PowerSGDCompression(rank=2), precision_policy="auto",
                                 start_method="spawn")
    clone = pickle.loads(pickle.dumps(strategy))
    assert clone.plan.spec == strategy.plan.spec and clone.core.options == strategy.core.options


class _SpawnModel(TinyModel):
    def val_dataloader(self):
        return DataLoader(IndexedDataset(20, seed=1), batch_size=4)


@pytest.mark.slow
def test_spawn_launcher_fits(tmp_path):
    seed_everything(0)
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                      strategy=HeteroDDPStrategy(capacities="profile", start_method="spawn",
                                                 observation={"print_table": False}, resilience={"timeout": 120}))
    trainer.fit(_SpawnModel(n=32))
    # The spawn launcher hands the main process the state and metrics (not the step counter).
    assert trainer.state.finished and "val_loss" in trainer.callback_metrics


class _CollectivesPerStep(Callback):
    """Counts ``torch.distributed.all_reduce`` / ``barrier`` calls from one training batch's start to the next's,
    keeps each step's loss next to the value Lightning logged for it, and the class of the model that trained."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, self.marks, self.pairs, self.trained = 0, [], [], set()
        for name in ("all_reduce", "barrier"):
            original = getattr(torch.distributed, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(torch.distributed, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.marks.append(self.calls)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.pairs.append((float(outputs["loss"]), float(trainer.callback_metrics["train_loss"])))
        self.trained.add(type(trainer.strategy.model))  # Lightning's DDP unwraps the model at teardown


def test_one_device_steps_issue_no_collective(monkeypatch):
    """One device: no DDP wrapper, and `self.log(..., sync_dist=True)` is the rank's own value with no collective
    (a reduction over one rank is an identity; the 1-rank process group would all-reduce it every step)."""
    from lightning_hetero import Observation

    counter = _CollectivesPerStep(monkeypatch)
    with one_process_fit():
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[counter],
                          strategy=HeteroDDPStrategy(capacities="equal", observation=Observation(print_table=False)))
        trainer.fit(TinyModel(n=40))
        assert torch.distributed.is_initialized()  # the 1-rank group exists: Lightning would sync through it
    assert counter.trained == {TinyModel}
    assert len(counter.marks) == 6 and counter.calls == counter.marks[0]  # none from the first step on
    assert [logged for _, logged in counter.pairs] == [loss for loss, _ in counter.pairs]
