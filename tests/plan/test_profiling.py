"""Profiled capacities: the equal-time split, memory caps, bit-identical model after profiling, measured shares on
CPU ranks made slower by a known factor, and the profiling cost on the digits example."""

import os
import sys
import tempfile
import time
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.plan.split import split_batch
from lightning_hetero.plan.profiling import (
    RankProfile,
    balanced_capacities,
    combine,
    preserved,
    profile_sizes,
    time_rank,
    training_loss,
)
from tests.helpers import IndexedDataset, TinyModel, free_port, retry_timing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))


def test_balanced_capacities_equalise_predicted_step_time() -> None:
    # rank 0: 2 ms fixed + 1 ms/sample; rank 1: 2 ms fixed + 3 ms/sample (sizes 8 and 16, exact times)
    p0 = RankProfile(sizes=(8, 16), seconds=(0.010, 0.018))
    p1 = RankProfile(sizes=(8, 16), seconds=(0.026, 0.050))
    caps = balanced_capacities([p0, p1], 64)
    b0 = 64 * caps[0] / sum(caps)
    b1 = 64 - b0
    assert 0.002 + 0.001 * b0 == pytest.approx(0.002 + 0.003 * b1, rel=1e-9)  # equal predicted step times
    assert b0 == pytest.approx(48.0)
    # A flat curve (latency-bound or noise) falls back to time proportional to samples: rate at the equal share.
    flat = RankProfile(sizes=(8, 16), seconds=(0.010, 0.0101))
    assert balanced_capacities([flat, flat], 32) == pytest.approx([16 / 0.0101] * 2)


def test_memory_caps_from_two_sizes_and_clear_errors() -> None:
    # 1 MB fixed + 0.5 MB/sample; 11 MB usable -> 20 samples; explicit limit lower wins.
    mb = 2**20
    p = RankProfile(sizes=(4, 8), seconds=(0.01, 0.02), peak_bytes=(3 * mb, 5 * mb), usable_bytes=11 * mb)
    assert p.memory_cap() == 20
    assert p.memory_cap(max_batch=7) == 7
    cpu = RankProfile(sizes=(4, 8), seconds=(0.01, 0.02))
    assert cpu.memory_cap() is None
    result = combine([p, cpu], 24)
    assert result.caps == (20, 24)  # the unmeasured rank may take the whole batch
    assert split_batch(24, result.capacities, result.caps)[0] <= 20
    tiny = RankProfile(sizes=(4, 8), seconds=(0.01, 0.02), peak_bytes=(3 * mb, 5 * mb), usable_bytes=mb // 2)
    with pytest.raises(ValueError, match="rank 0 cannot hold one training sample"):
        combine([tiny, cpu], 24)
    with pytest.raises(ValueError, match="does not fit"):
        split_batch(64, [1, 1], [20, 30])
    for kwargs, name in [({"profiling": {"memory_headroom": 1.5}}, "memory_headroom"),
                         ({"profiling": {"steps": 0}}, "steps"),
                         ({"profiling": {"max_batch_per_rank": 0}}, "max_batch_per_rank"),
                         ({"rebalance": {"every": 0}}, "every"), ({"rebalance": {"threshold": -0.1}}, "threshold"),
                         ({"rebalance": {"smoothing": 0.0}}, "smoothing")]:
        with pytest.raises(ValueError, match=name):
            HeteroDDPStrategy(**kwargs)


class _BNModel(LightningModule):
    """BatchNorm (buffers change in forward), dropout (consumes RNG), a logged loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> dict:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)  # silenced during profiling (no trainer here: would only warn)
        return {"loss": loss}


def test_profiling_leaves_model_bit_identical() -> None:
    torch.manual_seed(0)
    model = _BNModel()
    model.eval()  # profiling runs in train mode and must put the modes back
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    model.net[0].weight.grad = torch.full_like(model.net[0].weight, 0.25)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grad_obj = model.net[0].weight.grad
    rng = torch.get_rng_state()
    with preserved(model):
        model.train()
        profile = time_rank(model, {8: (x[:8], y[:8]), 16: (x, y)}, training_loss(model), torch.device("cpu"))
        model.net[0].weight.data.add_(1.0)  # even an in-place write is undone
    assert profile is not None and profile.sizes == (8, 16) and all(t > 0 for t in profile.seconds)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.net[0].weight.grad is grad_obj and torch.equal(grad_obj, torch.full_like(grad_obj, 0.25))
    assert model.net[1].weight.grad is None
    assert not model.training and not model.net[1].training
    assert torch.equal(torch.get_rng_state(), rng)


def _remember_params(module: LightningModule) -> None:
    module._probe_params = [p.detach().clone() for p in module.parameters()]


class SlowModel(TinyModel):
    """Sleeps ``per_sample`` seconds per sample in forward, ``factor`` times longer on rank 1."""

    def __init__(self, per_sample: float = 0.002, factor: float = 3.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def loss(self, batch: Any) -> torch.Tensor:
        scale = self.hparams.factor if self.global_rank == 1 else 1.0
        time.sleep(self.hparams.per_sample * scale * len(batch[0]))
        return super().loss(batch)

    def configure_optimizers(self) -> Any:
        _remember_params(self)
        return super().configure_optimizers()


class _Probe(Callback):
    """Parameters once DDP has synchronised them (optimizers are set up after the wrap) and after profiling (train
    start), per rank. RNG restoration is checked in the single-process test: the loader's iterator draws a seed."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        same = all(torch.equal(a, b) for a, b in zip(pl_module._probe_params, pl_module.parameters()))
        same = same and all(p.grad is None for p in pl_module.parameters())
        strategy = trainer.strategy
        profile = strategy.share_controller.profile
        torch.save({"same_params": same,
                    "capacities": list(profile.capacities), "cost_s": profile.cost_s,
                    "split": list(strategy.plan.split), "table": strategy.lab.table(strategy.plan),
                    "first_split": strategy.hetero.train_batch_sampler.split_at(0)},
                   os.path.join(self.out_dir, f"probe{trainer.global_rank}.pt"))
        trainer.should_stop = True


def _fit(model: LightningModule, out_dir: str, **strategy_kwargs: Any) -> list[dict]:
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = HeteroDDPStrategy(start_method="fork", observation={"print_table": False}, resilience={"timeout": 120},
                                 **strategy_kwargs)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, callbacks=[_Probe(out_dir)],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return [torch.load(os.path.join(out_dir, f"probe{r}.pt")) for r in range(2)]


# The profiled fits below time sleeps, and a loaded host's late wake-ups come on top: 3 of 10 fits missed (one rank
# measured 4.5x slower, not 3x) with two busy loops beside a load average of 7-10 on 2 cores, none of 50 at load 2-9.
# A fit outside the band is run again.


def test_profiled_shares_match_known_slowdown() -> None:
    def attempt(i: int) -> None:
        out = tempfile.mkdtemp()
        probes = _fit(SlowModel(per_sample=0.003, factor=3.0, batch_size=12, n=96), out, capacities="profile")
        assert probes[0]["capacities"] == probes[1]["capacities"]
        assert all(p["same_params"] for p in probes)
        assert "samples/s" in probes[0]["table"] and "mem cap" in probes[0]["table"]
        c0, c1 = probes[0]["capacities"]
        assert c0 / c1 == pytest.approx(3.0, rel=0.10), probes[0]["capacities"]
        assert probes[0]["split"] == [18, 6]  # 24 samples at 3:1
        assert probes[0]["first_split"] == [18, 6]  # applied from the very first batch

    retry_timing(3, attempt)


def test_profiling_cost_on_digits_example() -> None:
    from train_digits import DigitsClassifier, DigitsDataModule

    class Digits(DigitsClassifier):  # the example's model and data, without the validation loop
        validation_step = None  # type: ignore[assignment]

        def train_dataloader(self) -> Any:
            dm = DigitsDataModule(batch_size=32)
            dm.setup("fit")
            return dm.train_dataloader()

        def configure_optimizers(self) -> Any:
            _remember_params(self)
            return super().configure_optimizers()

    out = tempfile.mkdtemp()
    probes = _fit(Digits(), out, capacities="auto", profiling={"max_batch_per_rank": 48})
    cost = max(p["cost_s"] for p in probes)
    print(f"\nprofiling cost on the digits MLP: {cost:.3f} s; samples/s {probes[0]['capacities']}")
    assert 0 < cost <= 3.0
    assert all(p["same_params"] for p in probes)
    assert "48" in probes[0]["table"]  # the explicit cap shows in the "mem cap" column


def test_identical_cards_pool_their_timing():
    """Ranks of one class that measured within 25% share their mean; a really slower one keeps its own timing."""
    from lightning_hetero.plan.profiling import RankProfile, combine

    fast, noisy = RankProfile((8, 16), (0.0010, 0.0020)), RankProfile((8, 16), (0.0012, 0.0024))
    slow = RankProfile((8, 16), (0.004, 0.008))
    pooled = combine([fast, noisy, slow], 64, classes=["H200", "H200", "T4"])
    assert pooled.capacities[0] == pooled.capacities[1]
    assert abs(pooled.capacities[0] / pooled.capacities[2] - (0.008 / 0.0022)) < 1e-6
    assert combine([fast, noisy, slow], 64).capacities[0] > combine([fast, noisy, slow], 64).capacities[1]
    co_tenant = combine([fast, slow], 64, classes=["H200", "H200"])  # 4x apart: not noise
    assert abs(co_tenant.capacities[0] / co_tenant.capacities[1] - 4.0) < 1e-6


def test_pooling_compares_ranks_timed_at_different_sizes():
    """After refinement two ranks of one class were timed at 12 and 11 samples: pooled on their fitted models."""
    from lightning_hetero.plan.profiling import RankProfile, combine

    a = RankProfile((8, 12), (0.008, 0.012))  # 1 ms per sample
    b = RankProfile((8, 11), (0.0082, 0.0113))  # 1.03 ms per sample: noise
    pooled = combine([a, b], 23, classes=["H200", "H200"])
    assert pooled.capacities[0] == pooled.capacities[1]


class _SlowWithValidation(SlowModel):
    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(IndexedDataset(48, seed=1), batch_size=12)

    def on_validation_epoch_end(self) -> None:
        sampler = self.trainer.val_dataloaders.batch_sampler
        torch.save(sampler.split_at(0), os.path.join(self.out_dir, f"val_split{self.global_rank}.pt"))


def test_validation_loader_follows_profiled_shares() -> None:
    """The sanity check builds the validation loader before profiling; its next pass uses the profiled split."""

    def attempt(i: int) -> None:
        out = tempfile.mkdtemp()
        model = _SlowWithValidation(per_sample=0.003, factor=3.0, batch_size=12, n=48)
        model.out_dir = out
        os.environ["MASTER_PORT"] = str(free_port())
        strategy = HeteroDDPStrategy(start_method="fork", observation={"print_table": False},
                                     resilience={"timeout": 120}, capacities="profile")
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, limit_train_batches=1,
                          num_sanity_val_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(model)
        assert torch.load(os.path.join(out, "val_split0.pt")) == [18, 6]

    retry_timing(3, attempt)


def test_usable_memory_is_bounded_by_the_allocator_cap(monkeypatch):
    """An emulated 24 GiB card on an 80 GiB GPU (a per-process memory fraction) may fill what its cap leaves, not
    what the device has free: the profiled memory caps of a 40 GiB and a 24 GiB card must differ."""
    from lightning_hetero.plan.profiling import usable_bytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * gib)
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction["value"],
                        raising=False)
    device = torch.device("cuda", 0)
    assert usable_bytes(device, 0.1) == 70 * gib + 2 * gib - 8 * gib  # uncapped: the device's free memory
    fraction["value"] = 24 / 80
    # capped at 24 GiB: 24 - 6 reserved + 2 cached, less 10 % of 24
    assert usable_bytes(device, 0.1) == pytest.approx(24 * gib - 6 * gib + 2 * gib - 0.1 * 24 * gib, abs=1)


def test_profile_sizes_never_go_below_the_least_batch() -> None:
    """G = 6 on 2 ranks timed a 1-sample batch (half an equal share), which a BatchNorm layer cannot train on."""
    assert profile_sizes(6, 2) == (1, 3)
    assert profile_sizes(6, 2, minimum=2) == (2, 3)
    assert profile_sizes(2, 2, minimum=2) == (2, 2)
