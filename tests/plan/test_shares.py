"""The share plan keeps one store: whatever changed the shares (profiling, rebalancing, resume), every reader of the
plan (capacities, caps, split, shares) tells what the loaders actually cut."""

import glob
import os
import tempfile
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_hetero.plan.rebalance as rebalance
from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.data.sampler import EvaluationBatchSampler, GlobalOrder, HeteroBatchSampler
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.plan.capacity import parse_capacities
from lightning_hetero.plan.shares import SharePlan
from lightning_hetero.plan.split import split_batch
from tests.helpers import TinyModel, free_port
from tests.resilience.test_resume import _deterministic_gather

CPUS = [DeviceInfo(r, "host", "cpu", "cpu", (0, 0), 2**34, 2) for r in range(2)]


def _training_sampler(plan: SharePlan, n: int, g: int, rank: int = 0) -> HeteroBatchSampler:
    order = GlobalOrder(n, shuffle=False)
    schedule = plan.new_schedule(g, epoch=order.epoch)
    sampler = HeteroBatchSampler(order, g, schedule.capacities, rank=rank, drop_last=True, schedule=schedule)
    plan.use_train_schedule(sampler.schedule)
    return sampler


def _readers_agree(plan: SharePlan, g: int) -> None:
    assert plan.split == tuple(split_batch(g, plan.capacities, plan.caps))
    assert plan.shares == tuple(b / g for b in plan.split)


def test_every_writer_changes_what_every_reader_sees() -> None:
    plan = SharePlan(parse_capacities("equal"), global_batch_size=16)
    plan.resolve(CPUS, torch.float32)
    # Before any loader: the explicit global batch's split (what the FSDP memory plan reads).
    assert plan.capacities == (1.0, 1.0) and plan.source == "equal" and plan.split == (8, 8)
    train = _training_sampler(plan, 160, 16)
    val_order = GlobalOrder(40, shuffle=False)
    val = EvaluationBatchSampler(val_order, 8, plan.capacities, rank=0, drop_last=False,
                                 schedule=plan.new_schedule(8))
    plan.follow(val.schedule)

    # Profiling: measured rates and memory caps.
    plan.adopt([3.0, 1.0], "profile", caps=[11, 16], epoch=0)
    assert (plan.capacities, plan.caps, plan.source) == ((3.0, 1.0), (11, 16), "profile")
    _readers_agree(plan, 16)
    assert plan.split == (11, 5) and [len(b) for b in train][:2] == [11, 11]
    assert val.split_at(0) == [6, 2]  # evaluation follows the rates, not the training memory caps

    # Rebalancing from global batch 3 on: batches before keep their split, the plan reads the new one.
    plan.adopt([1.0, 3.0], "rebalanced", caps=plan.caps, first_batch=3, epoch=0)
    assert (plan.capacities, plan.source) == ((1.0, 3.0), "rebalanced")
    _readers_agree(plan, 16)
    assert [len(b) for b in train][:5] == [11, 11, 11, 4, 4]
    assert train.batch_size == plan.split[0] == 4 and train.capacities == plan.capacities
    assert val.split_at(0) == [2, 6]

    # A resumed job replays the saved schedule through the same writer: same readings.
    saved = train.state_dict()
    resumed = SharePlan(parse_capacities("equal"), global_batch_size=16)
    resumed.resolve(CPUS, torch.float32)
    again = _training_sampler(resumed, 160, 16)
    again.load_state_dict(saved, start_batch=0)
    for first_batch, capacities, caps in saved["changes"]:
        resumed.adopt(capacities, "restored", caps=caps, first_batch=first_batch, epoch=saved["epoch"])
    assert (resumed.capacities, resumed.caps, resumed.split) == (plan.capacities, plan.caps, plan.split)
    assert [len(b) for b in again][:5] == [11, 11, 11, 4, 4]

    # A reloaded training loader starts from the shares in force, caps included.
    reloaded = _training_sampler(plan, 160, 16)
    assert reloaded.split_at(0) == list(plan.split) and plan.caps == (11, 16)


class _Readings(Callback):
    """At every training batch: what the plan says and what this rank's batch holds."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        plan = trainer.strategy.plan
        schedule = plan.schedule
        self.rows.append({"batch": batch_idx, "size": len(batch[0]), "source": plan.source,
                          "capacities": plan.capacities, "split": plan.split,
                          "latest": schedule.latest.first_batch if schedule is not None else None})

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save(self.rows, os.path.join(self.out_dir, f"readings{trainer.global_rank}.pt"))


def _fit(out_dir: str, **kwargs: Any) -> list[list[dict[str, Any]]]:
    os.environ["MASTER_PORT"] = str(free_port())
    ckpt_dir = kwargs.pop("ckpt_dir", None)
    strategy = HeteroDDPStrategy(start_method="fork", observation={"print_table": False}, capacities="equal",
                                 rebalance={"every": 3, "threshold": 0.05}, resilience={"timeout": 120})
    callbacks: list[Any] = [_Readings(out_dir)]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=kwargs["max_steps"], save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, callbacks=callbacks,
                      logger=False, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, max_steps=kwargs.get("max_steps", -1))
    trainer.fit(TinyModel(batch_size=4, n=80), ckpt_path=kwargs.get("ckpt_path"))
    return [torch.load(os.path.join(out_dir, f"readings{r}.pt")) for r in range(2)]


@pytest.mark.slow
def test_plan_after_a_rebalance_and_a_resume_reads_the_split_the_loader_cuts(monkeypatch: Any) -> None:
    monkeypatch.setattr(rebalance, "gather_measurements", _deterministic_gather(rebalance.gather_measurements))
    ckpt_dir = tempfile.mkdtemp()
    first = _fit(tempfile.mkdtemp(), ckpt_dir=ckpt_dir, max_steps=7)
    (ckpt,) = glob.glob(os.path.join(ckpt_dir, "*step=7*.ckpt"))
    resumed = _fit(tempfile.mkdtemp(), ckpt_path=ckpt)
    for r in range(2):
        before, after = first[r], resumed[r]
        assert before[0]["source"] == "equal" and before[0]["split"][r] == before[0]["size"] == 4
        # Rebalanced (rank 1 measured 3x slower): the plan reads the split the loader cuts once it applies.
        last = before[-1]
        assert last["source"] == "rebalanced" and last["latest"] <= last["batch"]
        assert last["capacities"][0] > last["capacities"][1] and last["split"] == (6, 2)
        assert last["split"][r] == last["size"]
        # Resumed: the restored shares are what the plan reads and what the loader cuts from the first batch.
        assert after[0]["source"] == "restored" and after[0]["capacities"] == last["capacities"]
        assert after[0]["split"] == last["split"] and after[0]["split"][r] == after[0]["size"]


def test_the_plan_is_the_one_writer_of_the_least_share_its_store_and_the_training_schedule_read() -> None:
    """With BatchNorm trained unsynced (least share 2) the FSDP memory plan read the store's split (15, 1) before the
    loader while the loader cut [14, 2]: the minimum was written to the loader's schedule only."""
    plan = SharePlan(parse_capacities([10, 1]), global_batch_size=16)
    plan.resolve(CPUS, torch.float32)
    assert plan.split == (15, 1)
    plan.min_share = 2
    assert plan.split == (14, 2)  # before any loader: what the memory plan reads
    train = _training_sampler(plan, 160, 16)
    assert train.schedule.min_share == 2 and plan.split == (14, 2) and [len(b) for b in train][:2] == [14, 14]
    plan.adopt([30.0, 1.0], "rebalanced", caps=None, first_batch=1, epoch=0)
    assert plan.split == (14, 2) and train.split_at(1) == [14, 2]
    # A later training loader (reloaded every epoch) splits with the plan's minimum too.
    again = _training_sampler(plan, 160, 16)
    assert again.schedule.min_share == 2 and again.split_at(0) == [14, 2]
    # An evaluation loader runs no BatchNorm training: its schedule keeps one sample per rank.
    assert plan.new_schedule(16).min_share == 1


def test_the_cost_balanced_cut_keeps_the_least_share() -> None:
    """`balance='tokens'` cut [[1..7], [0]] at [10, 1] with a least share of 2: split_by_cost ignored the minimum."""
    from lightning_hetero.plan.shares import ShareSchedule

    schedule = ShareSchedule(8, [10, 1])
    schedule.set_min_share(2)
    for balance in ("tokens", "padded_tokens"):
        schedule.balance = balance  # type: ignore[assignment]
        runs = schedule.cut(0, [1, 2, 3, 4, 5, 6, 7, 8])
        assert sorted(i for r in runs for i in r) == list(range(8)) and min(len(r) for r in runs) == 2, runs
    # A last global batch too small for 2 each: placed as the count split places it.
    assert [len(r) for r in schedule.cut(1, [1.0, 2.0, 3.0])] == split_batch(3, [10, 1], minimum=2) == [3, 0]


def test_a_pipeline_is_one_replica_whose_least_share_is_one_sample() -> None:
    """Ranks 1, 2 train one pipelined replica: split one by one, a fast rank 0 beside them left the pipeline 2
    samples (one per stage rank) of a fair 1.7, which set the step; as one replica it gets 1, and a stage rank 0."""
    from lightning_hetero.plan.split import split_replicas

    assert split_batch(12, [6, 0.5, 0.5]) == [10, 1, 1]
    assert split_replicas(12, [6, 0.5, 0.5], [[0], [1, 2]]) == [11, 1, 0]
    # A larger fair share is spread over the stage ranks; replicas of one rank split as before.
    assert split_replicas(32, [3, 3, 1, 1], [[0], [1], [2, 3]]) == split_batch(32, [3, 3, 1, 1]) == [12, 12, 4, 4]
    assert split_replicas(7, [1, 1, 1], [[0], [1], [2]]) == split_batch(7, [1, 1, 1])
    with pytest.raises(ValueError, match="`replicas`"):
        split_replicas(12, [1, 1, 1], [[0], [2, 1]])
    with pytest.raises(ValueError, match="`replicas`"):
        split_replicas(12, [1, 1, 1], [[0], [1]])

    cpus = [DeviceInfo(r, "host", "cpu", "cpu", (0, 0), 2**34, 2) for r in range(3)]
    plan = SharePlan(parse_capacities([6, 0.5, 0.5]), global_batch_size=12,
                     replicas_of=lambda devices, capacities: [[0], [1, 2]])
    plan.resolve(cpus, torch.float32)
    assert plan.replicas == ((0,), (1, 2))
    assert plan.split == (11, 1, 0)
    # The layout is chosen on the resolved capacities; one that does not cover every rank once is refused.
    asked = []
    SharePlan(parse_capacities([6, 0.5, 0.5]), 12, lambda d, c: asked.append((len(d), tuple(c))) or [[0], [1, 2]]
              ).resolve(cpus, torch.float32)
    assert asked == [(3, (6.0, 0.5, 0.5))]
    with pytest.raises(ValueError, match="`replicas`"):
        SharePlan(parse_capacities([6, 0.5, 0.5]), 12, lambda d, c: [[0], [2, 1]]).resolve(cpus, torch.float32)  # before any loader: what the lab table reads
    train = _training_sampler(plan, 48, 12)
    assert train.split_at(0) == [11, 1, 0] and [len(b) for b in train][:2] == [11, 11]
    # Evaluation runs the whole model on every rank: its schedule splits by rank.
    assert plan.new_schedule(12).split_at(0) == [10, 1, 1]
    # A cost-balanced cut keeps the least share per replica, and every sample once.
    train.schedule.balance = "tokens"
    runs = train.schedule.cut(0, [float(c) for c in range(1, 13)])
    assert sorted(i for r in runs for i in r) == list(range(12)) and len(runs[1]) + len(runs[2]) >= 1


def test_a_global_batch_needs_one_sample_per_replica_not_per_rank() -> None:
    """4 ranks where ranks 2, 3 form a pipeline are 3 replicas: a global batch of 3 was refused as below the world
    size; it gives each replica one sample (a stage rank none). Below 3 is refused naming the field and the count;
    without pipelines the limit stays the world size."""
    from lightning_hetero.data.sampler import check_training_batch
    from lightning_hetero.plan.shares import ShareSchedule

    cpus = [DeviceInfo(r, "host", "cpu", "cpu", (0, 0), 2**34, 2) for r in range(4)]
    by_rank = SharePlan(parse_capacities("equal"), global_batch_size=3)
    by_rank.resolve(cpus, torch.float32)
    with pytest.raises(ValueError, match=r"`global_batch_size`=3 is smaller than the world size 4"):
        by_rank.new_schedule(3)
    plan = SharePlan(parse_capacities("equal"), global_batch_size=3, replicas_of=lambda d, c: [[0], [1], [2, 3]])
    plan.resolve(cpus, torch.float32)
    assert plan.split == (1, 1, 1, 0)
    train = _training_sampler(plan, 19, 3)
    assert [train.split_at(k, train.global_batch_len(k)) for k in (0, 6)] == [[1, 1, 1, 0], [0, 0, 1, 0]]
    assert [len(b) for b in train] == [1] * 6  # rank 0: six batches of one sample, the last of 1 dropped
    with pytest.raises(ValueError, match=r"`global_batch_size`=2 is smaller than the 3 replicas of the 4 ranks"):
        plan.new_schedule(2)
    with pytest.raises(ValueError, match=r"`global_batch_size`=2 is smaller than the world size 4"):
        ShareSchedule(2, [1, 1, 1, 1])
    # The least share is per replica too (BatchNorm trained unsynced: 2 each of 3 replicas).
    unsynced = SharePlan(parse_capacities("equal"), global_batch_size=6, replicas_of=lambda d, c: [[0], [1], [2, 3]])
    unsynced.resolve(cpus, torch.float32)
    unsynced.min_share = 2
    assert _training_sampler(unsynced, 12, 6).split_at(0) == [2, 2, 1, 1]
    with pytest.raises(ValueError, match=r"`global_batch_size`=5 is smaller than 2 x the 3 replicas"):
        unsynced.use_train_schedule(unsynced.new_schedule(5))
    # Evaluation splits the set by rank (every rank runs the whole model): the rank short of a sample pads.
    order = GlobalOrder(12, shuffle=False)
    evaluation = [EvaluationBatchSampler(order, 3, [1, 1, 1, 1], rank=r, drop_last=False, schedule=plan.new_schedule(3))
                  for r in range(4)]
    batches = [list(s) for s in evaluation]
    assert {len(b) for b in batches} == {4}  # every rank runs the same number of batches
    assert sorted(i for r in range(4) for k, b in enumerate(batches[r]) if not evaluation[r].is_padding(k)
                  for i in b) == list(range(12))
    # A too-large global batch's advice counts replicas.
    small = _training_sampler(plan, 2, 3)
    with pytest.raises(ValueError, match=r"at least one sample per replica \(3\)"):
        check_training_batch(small, "train_dataloader", explicit=True)
