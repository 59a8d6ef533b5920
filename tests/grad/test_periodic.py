"""Periodic cross-host sync: exact inside each host every step, hosts combined every H steps (local SGD / DiLoCo)."""

import copy
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_hetero import HeteroDDPStrategy, PeriodicSync
from lightning_hetero.grad.periodic import PeriodicCrossHostSync, parse_periodic_sync
from lightning_hetero.grad.weighting import WeightingState
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.groups import HeteroLab, build_groups
from tests.helpers import Recorder, TinyModel, free_port, max_rel_diff, reference_run

HOSTS = [{"host": "a"}, {"host": "a"}, {"host": "b"}]  # 2 + 1 gloo ranks on two emulated hosts
CAPACITIES = [3.0, 1.0, 2.0]
N = 48  # global batch 12: full batches, so the weights b_r / G are the same every step


class LabRecorder(Recorder):
    """The helpers' recorder plus the lab table's "between hosts" column."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        record = torch.load(path)
        record["between_hosts"] = list(dict(trainer.strategy.lab.columns).get("between hosts", ()))
        torch.save(record, path)


def fit_periodic(model: LightningModule, out_dir: str, periodic: Any, epochs: int, emulate: Any = HOSTS,
                 capacities: Any = CAPACITIES, ckpt_path: Any = None, save_every: int = 0, accumulate: int = 1
                 ) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    world = len(emulate)
    strategy = HeteroDDPStrategy(capacities=capacities, emulate=emulate, periodic_sync=periodic,
                                 start_method="fork", observation={"print_table": False}, resilience={"timeout": 120})
    callbacks: list[Any] = [LabRecorder(out_dir)]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=out_dir, every_n_train_steps=save_every, save_top_k=-1,
                                         filename="{step}"))
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, callbacks=callbacks,
                      logger=False, enable_checkpointing=bool(save_every), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, accumulate_grad_batches=accumulate)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


# -- configuration ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"every": 0}, "PeriodicSync.every"), ({"every": 2.0}, "PeriodicSync.every"), ({"every": True}, "PeriodicSync.every"),
    ({"every": 4, "outer": "adam"}, "PeriodicSync.outer"), ({"every": 4, "outer_lr": 0}, "PeriodicSync.outer_lr"),
    ({"every": 4, "outer_lr": math.nan}, "PeriodicSync.outer_lr"),
    ({"every": 4, "outer_momentum": 1.0}, "PeriodicSync.outer_momentum"),
    ({"every": 4, "warmup_steps": -1}, "PeriodicSync.warmup_steps"),
    ({"every": 4, "overlap": "yes"}, "PeriodicSync.overlap"),
])
def test_bad_periodic_sync_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PeriodicSync(**kwargs)
    with pytest.raises(ValueError, match=field):  # the same check through the strategy, as a dict (YAML)
        HeteroDDPStrategy(periodic_sync=kwargs)


def test_periodic_sync_arguments_are_parsed_and_refused_where_they_clash():
    assert parse_periodic_sync({"every": 8, "outer": "average"}) == PeriodicSync(every=8, outer="average")
    assert parse_periodic_sync(None) is None
    with pytest.raises(ValueError, match="periodic_sync"):
        parse_periodic_sync({"every": 8, "period": 3})
    with pytest.raises(ValueError, match="periodic_sync"):
        parse_periodic_sync(8)
    with pytest.raises(ValueError, match="compression"):
        HeteroDDPStrategy(periodic_sync={"every": 8}, compression="powersgd")
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        HeteroDDPStrategy(periodic_sync={"every": 8}, ddp_comm_hook=lambda state, bucket: bucket)
    HeteroDDPStrategy(periodic_sync=PeriodicSync(every=8), compression="bf16")  # the outer exchange in bf16


def test_one_host_warns_and_stays_inactive():
    devices = tuple(DeviceInfo(r, "a", "cpu", "cpu", (0, 0), 1, 1) for r in range(2))
    lab = HeteroLab(devices=devices)
    periodic = PeriodicCrossHostSync(PeriodicSync(every=4))
    with pytest.warns(UserWarning, match="one host"):
        periodic.setup(lab, None, rank=1)  # type: ignore[arg-type]
    assert periodic.process_group_for_ddp() is None and not periodic.periodic_now
    weighting = WeightingState(2)
    periodic.weigh_step(weighting, [3, 1])
    # The loss factor of the weighting hook's sum, b_r / G, as without periodic sync.
    assert weighting.loss_factor == 0.25 and weighting.process_group is None
    assert periodic.after_optimizer_step() is False
    assert periodic.describe(lab) == ["every step (one host)"] * 2


# -- the outer step against a hand computation (2 gloo processes, no Trainer) ---------------------------------------------
class RecordingPacer:
    """Stands in for the emulated link: records what the outer exchange puts on it."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.settled = 0

    def transfer(self, nbytes: int) -> None:
        self.sent.append(nbytes)

    def settle(self) -> float:
        self.settled += 1
        return 0.0


def _outer_worker(rank: int, port: int, out_dir: str, wire: str, overlap: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    devices = tuple(DeviceInfo(r, h, "cpu", "cpu", (0, 0), 1, 1) for r, h in enumerate("ab"))
    lab = HeteroLab(devices=devices)
    periodic = PeriodicCrossHostSync(PeriodicSync(every=2, outer="nesterov", outer_lr=0.7, outer_momentum=0.9,
                                                  overlap=overlap),
                                     wire_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[wire])
    pacer = RecordingPacer()
    periodic.setup(lab, build_groups(lab), rank, pacer)
    module = nn.Linear(3, 2)
    torch.manual_seed(rank)  # unlike on each rank: attach starts everyone from rank 0's
    nn.init.normal_(module.weight)
    periodic.attach(module, [])
    anchors, after = [], []
    weighting = WeightingState(2)
    for step in range(4):
        periodic.weigh_step(weighting, [9, 3] if step % 2 else [3, 1])  # host a trains on 3/4 of every batch
        assert weighting.loss_factor == 1.0 and weighting.process_group is not None  # b_r / B_host, inside the host
        if step % 2 == 0:
            anchors.append(torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()]))
        with torch.no_grad():  # an "inner step" that differs per host
            for p in module.parameters():
                p.add_(torch.full_like(p, 0.1 * (rank + 1) * (step + 1)))
        before = torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])
        ran = periodic.after_optimizer_step()
        assert ran == (step % 2 == 1)
        after.append((before, torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])))
    periodic.finish()
    after.append((after[-1][1], torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])))
    torch.save({"anchors": anchors, "after": after, "bytes": periodic.wire_bytes_last_outer, "paced": pacer.sent,
                "settled": pacer.settled},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_nesterov_outer_step_matches_hand_computation(tmp_path, wire):
    mp.start_processes(_outer_worker, args=(free_port(), str(tmp_path), wire), nprocs=2, start_method="fork")
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert torch.equal(a["anchors"][0], b["anchors"][0])  # both hosts start from rank 0's parameters
    lr, m, buf = 0.7, 0.9, None
    anchor = a["anchors"][0]
    for step in (1, 3):  # outer steps
        theta_a, theta_b = a["after"][step][0], b["after"][step][0]
        delta = 0.75 * (anchor - theta_a) + 0.25 * (anchor - theta_b)  # S_a / S = 12 / 16
        buf = delta if buf is None else m * buf + delta
        anchor = anchor - lr * (delta + m * buf)
        tolerance = 1e-6 if wire == "fp32" else 3e-2 * float(delta.abs().max())  # bf16: 8 bits of mantissa
        assert float((a["after"][step][1] - anchor).abs().max()) <= tolerance, step
        assert torch.equal(a["after"][step][1], b["after"][step][1])  # the hosts meet bit for bit
    assert a["bytes"] == 8 * (4 if wire == "fp32" else 2)  # 8 parameters went over the link once
    assert a["paced"] == b["paced"] == [a["bytes"]] * 2 and a["settled"] == 2  # the link paces each outer step only
    assert float((a["after"][1][1] - a["after"][1][0]).abs().max()) > 0.05  # the outer step moved something
    assert torch.equal(a["after"][4][1], a["after"][3][1])  # nothing in flight at the end


@pytest.mark.slow
def test_overlapped_exchange_lands_one_step_later_on_top_of_local_progress(tmp_path):
    """overlap=True: the exchange started after step 2 is applied after step 3, keeping step 3's local progress;
    the one started after step 4 is applied by ``finish``."""
    mp.start_processes(_outer_worker, args=(free_port(), str(tmp_path), "fp32", True), nprocs=2, start_method="fork")
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    lr, m = 0.7, 0.9
    anchor = a["anchors"][0]
    for record in (a, b):
        assert torch.equal(record["after"][1][1], record["after"][1][0])  # sent, not yet applied
    sent = (a["after"][1][0], b["after"][1][0])
    delta1 = 0.75 * (anchor - sent[0]) + 0.25 * (anchor - sent[1])
    anchor1 = anchor - lr * (delta1 + m * delta1)
    for record, own_sent in zip((a, b), sent):
        expected = anchor1 + (record["after"][2][0] - own_sent)  # the outer update plus step 3's own progress
        assert float((record["after"][2][1] - expected).abs().max()) <= 1e-6
    assert not torch.equal(a["after"][2][1], b["after"][2][1])  # the hosts keep their own progress
    delta2 = 0.75 * (anchor1 - a["after"][3][0]) + 0.25 * (anchor1 - b["after"][3][0])
    anchor2 = anchor1 - lr * (delta2 + m * (m * delta1 + delta2))
    assert torch.equal(a["after"][3][1], a["after"][3][0])  # in flight until finish()
    for record in (a, b):
        assert float((record["after"][4][1] - anchor2).abs().max()) <= 1e-6
    assert torch.equal(a["after"][4][1], b["after"][4][1])  # nothing trained since the send: the hosts meet


# -- in training (3 gloo ranks: 2 on host a, 1 on host b) ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_step_average_equals_exact_sync(tmp_path, accumulate):
    """H = 1 with plain averaging and SGD (momentum is linear, weights constant): the same parameters as one process
    on the global batch, within the equivalence tolerance; replicas bit-identical after every step. With gradient
    accumulation the host's weight and the period's samples count every micro-batch."""
    seed_everything(0)
    model = TinyModel("sgd", n=N)
    reference_model, floor_model = copy.deepcopy(model), copy.deepcopy(model)
    epochs = 5
    records = fit_periodic(model, str(tmp_path), PeriodicSync(every=1, outer="average"), epochs, accumulate=accumulate)
    ref_params, _ = reference_run(reference_model, 3, CAPACITIES, epochs, accumulate=accumulate)
    floor_params, _ = reference_run(floor_model, 3, CAPACITIES, epochs, shuffle_within=True, accumulate=accumulate)
    assert {r["steps"] for r in records} == {20 // accumulate} and len(ref_params) == 20
    assert records[0]["between_hosts"] == ["Δ fp32 every 1: average", "via host leader", "Δ fp32 every 1: average"]
    for step in range(len(ref_params)):
        for r in (1, 2):
            assert torch.equal(records[r]["params"][step], records[0]["params"][step]), (r, step)
    diff = max(max_rel_diff(records[0]["params"][s], ref_params[s]) for s in range(len(ref_params)))
    floor = max(max_rel_diff(floor_params[s], ref_params[s]) for s in range(len(ref_params)))
    assert diff <= max(1e-6, 2 * floor), (diff, floor)


@pytest.mark.slow
def test_hosts_drift_apart_and_meet_at_each_outer_step(tmp_path):
    """Inside a host replicas are bit-identical every step; the hosts differ between outer steps and are identical
    right after each; the warm-up steps are exact sync."""
    seed_everything(0)
    model = TinyModel("adam", n=N)
    reference_model = copy.deepcopy(model)
    warmup, every = 2, 4
    records = fit_periodic(model, str(tmp_path), PeriodicSync(every=every, warmup_steps=warmup), 3)
    ref_params, _ = reference_run(reference_model, 3, CAPACITIES, 3)
    params = [r["params"] for r in records]
    assert len(params[0]) == 12
    for step in range(12):
        assert torch.equal(params[1][step], params[0][step]), step  # same host
        synced = step + 1 <= warmup or (step + 1 - warmup) % every == 0
        assert torch.equal(params[2][step], params[0][step]) == synced, step
        if step + 1 <= warmup:
            assert max_rel_diff(params[0][step], ref_params[step]) <= 1e-6, step
    # The periodic run really trained: far from the start, not far from exact sync.
    assert max_rel_diff(params[0][-1], ref_params[-1]) < 0.2


@pytest.mark.slow
@pytest.mark.parametrize(("overlap", "at"), [(False, 7), (True, 9)], ids=["mid-period", "overlap-in-flight"])
def test_resume_mid_period_repeats_the_uninterrupted_run(tmp_path, overlap, at):
    """A checkpoint in the middle of a period (host b's parameters and momentum differ from rank 0's), or with an
    overlapped exchange in flight, resumes bit for bit on every rank: host b's model and inner optimizer, the anchor,
    the outer momentum and the exchange in flight are restored."""
    periodic = PeriodicSync(every=4, outer="nesterov", warmup_steps=1, overlap=overlap)  # outer steps at 5, 9, 13
    seed_everything(0)
    model = TinyModel("sgd", n=N)
    resumed_model = copy.deepcopy(model)
    full = fit_periodic(model, str(tmp_path / "full"), periodic, 4, save_every=at)
    ckpt = tmp_path / "full" / f"step={at}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["lightning_hetero"]["ranks"]
    assert "module" in saved[2]["periodic"] and "module" not in saved[0]["periodic"]  # only host b's are extra
    assert ("in_flight" in saved[0]["periodic"]) == overlap
    assert not torch.equal(full[2]["params"][at - 1], full[0]["params"][at - 1])  # the hosts differ there
    resumed = fit_periodic(resumed_model, str(tmp_path / "resumed"), periodic, 4, ckpt_path=str(ckpt))
    for rank in range(3):
        assert len(resumed[rank]["params"]) == len(full[rank]["params"]) - at == 16 - at
        for step, params in enumerate(resumed[rank]["params"]):
            assert torch.equal(params, full[rank]["params"][at + step]), (rank, at + step)


@pytest.mark.slow
def test_one_host_is_exact_sync(tmp_path):
    """With one host the option does nothing: every step is the exact sync."""
    seed_everything(0)
    model = TinyModel("adam", n=N)
    reference_model = copy.deepcopy(model)
    records = fit_periodic(model, str(tmp_path), PeriodicSync(every=4), 2, emulate=[{"host": "a"}] * 2,
                           capacities=[3.0, 1.0])
    ref_params, _ = reference_run(reference_model, 2, [3.0, 1.0], 2)
    assert records[0]["between_hosts"] == ["every step (one host)"] * 2
    assert max(max_rel_diff(records[0]["params"][s], ref_params[s]) for s in range(len(ref_params))) <= 1e-6


# -- convergence (short, CI) --------------------------------------------------------------------------------------------
class TeacherDataset(Dataset):
    """Labels from a fixed random linear teacher: learnable, so a held-out loss means something."""

    def __init__(self, n: int, seed: int, features: int = 8, classes: int = 4) -> None:
        teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        self.y = (self.x @ teacher).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class TeacherModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TeacherDataset(self.hparams.n, seed=0), batch_size=self.hparams.batch_size, shuffle=True)


def held_out_loss(model: TinyModel) -> float:
    data = TeacherDataset(512, seed=99)
    with torch.no_grad():
        return float(model.loss((data.x, data.y, None)))


@pytest.mark.slow
def test_every_8_steps_converges_near_exact_sync(tmp_path):
    """2 hosts x 1 rank, 48 steps: local SGD every 8 steps ends within 5 % of exact sync's held-out loss (and far
    below the untrained loss)."""
    hosts = [{"host": "a"}, {"host": "b"}]
    losses = {}
    for name, periodic in (("exact", None), ("every8", PeriodicSync(every=8, outer="average"))):
        seed_everything(0)
        model = TeacherModel("sgd", n=384, batch_size=8, lr=0.2)
        start = held_out_loss(model)
        fit_periodic(model, str(tmp_path / name), periodic, 2, emulate=hosts, capacities=[3.0, 1.0])
        losses[name] = held_out_loss(model)  # rank 0's parameters, just after the last outer step (step 48)
    assert losses["exact"] < 0.5 * start, losses
    assert abs(losses["every8"] - losses["exact"]) <= 0.05 * losses["exact"], losses


@pytest.mark.parametrize("entry", ["{class_path: lightning_hetero.PeriodicSync, init_args: {every: 8, outer: average}}",
                                   "{every: 8, outer: average}"], ids=["class_path", "dict"])
def test_periodic_sync_from_yaml(entry):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=HeteroDDPStrategy)
    config = parser.parse_string("strategy:\n  class_path: lightning_hetero.HeteroDDPStrategy\n  init_args:\n"
                                 f"    periodic_sync: {entry}\n")
    strategy = parser.instantiate_classes(config).strategy
    assert strategy.periodic.config == PeriodicSync(every=8, outer="average")
    assert "every: 8" in parser.dump(config)  # round trip


def test_batchnorm_sync_is_refused_only_while_periodic_sync_is_active():
    strategy = HeteroDDPStrategy(periodic_sync={"every": 4})
    assert strategy.periodic is not None and not strategy.periodic.active
    assert strategy.batchnorm_sync_refusal() is None
    strategy.periodic.active = True  # two hosts or more, as `setup` finds them
    assert "periodic_sync" in (strategy.batchnorm_sync_refusal() or "")


@pytest.mark.slow
def test_one_host_syncs_batchnorm_exactly_with_periodic_sync_set(tmp_path):
    """One host: periodic sync stays inactive, every step is an exact sync over all ranks, BatchNorm's too."""
    from tests.grad.test_batchnorm import TOLERANCE, fit_against_one_process

    params, buffers = fit_against_one_process(tmp_path, HeteroDDPStrategy, [3, 1], sync=True,
                                              strategy_kwargs={"periodic_sync": {"every": 2}})
    assert params <= TOLERANCE and buffers <= TOLERANCE
