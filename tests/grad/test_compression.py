"""Compressed gradient communication: cast, PowerSGD and top-k hooks under capacity weighting (2 CPU ranks, gloo)."""

import copy
import os
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_hetero import CastCompression, HeteroDDPStrategy, PowerSGDCompression, TopKCompression
from lightning_hetero.grad.bucket_state import CommCounter
from lightning_hetero.grad.compress_hooks import (
    CastState,
    FlatBucket,
    HierarchicalState,
    TopKState,
    cast_hook,
    hierarchical_hook,
    topk_hook,
)
from lightning_hetero.grad.compression_config import parse_compression
from lightning_hetero.grad.powersgd_hook import PowerSGDHookState, powersgd_hook
from tests.helpers import Recorder, free_port

CAPACITIES = [3, 1]  # unequal shares: the two ranks' losses carry different weights before the compression hook
GLOBAL_BATCH = 128  # 96 + 32 samples; 15 steps per epoch over the 1797 digits


class Digits(Dataset):
    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        self.x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        self.y = torch.tensor(data.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class DigitsMLP(LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Digits(), batch_size=GLOBAL_BATCH // 2, shuffle=True)


def full_loss(flat: torch.Tensor, hidden: int = 32) -> float:
    """Cross-entropy over all digits of the model whose parameters are ``flat``."""
    model = DigitsMLP(hidden)
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    data = Digits()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model.net(data.x), data.y))


class BytesRecorder(Recorder):
    """Also records the strategy's bytes per optimizer step and the logged ``comm/bytes``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.bytes: list[Optional[int]] = []
        self.logged_bytes: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.bytes.append(trainer.strategy.comm_bytes_last_step)
        self.logged_bytes.append(float(trainer.callback_metrics.get("comm/bytes", float("nan"))))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        record = torch.load(path)
        record.update(bytes=self.bytes, logged_bytes=self.logged_bytes,
                      table=trainer.strategy.lab.columns)
        torch.save(record, path)


def fit_digits(out_dir: str, compression: Any, epochs: int, model: Optional[DigitsMLP] = None,
               ckpt_path: Optional[str] = None, save_every_epoch: bool = False, accelerator: str = "cpu",
               momentum: float = 0.9, **trainer_kwargs: Any) -> list[dict]:
    """Fit the digits MLP on 2 forked CPU ranks; return each rank's record (params after every step, bytes)."""
    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    seed_everything(0)
    model = model if model is not None else DigitsMLP(momentum=momentum)
    strategy = HeteroDDPStrategy(capacities=CAPACITIES, compression=compression, start_method="fork",
                                 observation={"print_table": False}, resilience={"timeout": 120})
    callbacks: list[Any] = [BytesRecorder(out_dir)]
    if save_every_epoch:
        callbacks.append(ModelCheckpoint(dirpath=out_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}"))
    trainer = Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=epochs, callbacks=callbacks,
                      logger=False, enable_checkpointing=save_every_epoch, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def assert_replicas_equal(records: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(records[0]["params"], records[1]["params"])):
        assert torch.equal(a, b), f"replicas differ after step {step}"


def psgd_expected_elements(model: nn.Module, rank: int, min_rate: float = 2.0) -> int:
    """Elements PowerSGD sends per step: (n + m) r per compressed matrix, n m for everything else."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else n * m
    return total


# -- config --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: PowerSGDCompression(rank=0), "PowerSGDCompression.rank"),
        (lambda: PowerSGDCompression(start_iter=1), "PowerSGDCompression.start_iter"),
        (lambda: PowerSGDCompression(min_compression_rate=-1), "PowerSGDCompression.min_compression_rate"),
        (lambda: TopKCompression(ratio=0), "TopKCompression.ratio"),
        (lambda: TopKCompression(ratio=1.5), "TopKCompression.ratio"),
        (lambda: TopKCompression(warmup_steps=-3), "TopKCompression.warmup_steps"),
        (lambda: TopKCompression(ratio=0.5, warmup_steps=5, warmup_ratio=0.1), "TopKCompression.warmup_ratio"),
        (lambda: CastCompression(dtype="fp8"), "CastCompression.dtype"),
        (lambda: CastCompression(group_by="rack"), "CastCompression.group_by"),
        (lambda: TopKCompression(hierarchical="yes"), "TopKCompression.hierarchical"),
        (lambda: TopKCompression(momentum=1.0), "TopKCompression.momentum"),
        (lambda: TopKCompression(momentum=-0.1), "TopKCompression.momentum"),
        (lambda: TopKCompression(momentum_masking=1), "TopKCompression.momentum_masking"),
        (lambda: HeteroDDPStrategy(compression="zip"), "`compression`"),
        (lambda: HeteroDDPStrategy(compression="topk", ddp_comm_hook=lambda s, b: None), "`compression`"),
    ],
)
def test_bad_config_names_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_strings_map_to_configs():
    assert parse_compression("none") is None
    assert parse_compression("bf16") == CastCompression(dtype="bf16")
    assert parse_compression("powersgd") == PowerSGDCompression()
    assert parse_compression("topk") == TopKCompression()
    schedule = TopKCompression(ratio=0.01, warmup_steps=4, warmup_ratio=0.16)
    assert [round(schedule.ratio_at(s), 4) for s in range(6)] == [0.16, 0.08, 0.04, 0.02, 0.01, 0.01]


# -- top-k hook on its own: what is sent plus what is kept is the weighted gradient ------------------------------
FakeBucket = FlatBucket  # the parts of ``dist.GradBucket`` the hooks use


def _topk_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        params = [torch.zeros(40, 25)]
        state = TopKState(TopKCompression(ratio=0.05), None, params, torch.device("cpu"), CommCounter(), "all")
        dgc = TopKState(TopKCompression(ratio=0.05, momentum=0.5), None, params, torch.device("cpu"), CommCounter(),
                        "all")
        g = torch.Generator().manual_seed(rank)
        results, velocities = [], []
        for step in range(3):
            weighted = torch.randn(1000, generator=g) * (1.5 if rank == 0 else 0.5)  # b_r W / G times g_r
            if step == 2 and rank == 1:
                weighted[7] = float("nan")
            residual_before = state.residuals.get(0, torch.zeros(1000)).clone()
            out = topk_hook(state, FakeBucket(weighted.clone(), params)).wait()
            results.append((weighted, residual_before, state.residuals[0].clone(), out.clone(),
                            state.counter.take()))
            velocity_before = dgc.velocities.get(0, torch.zeros(1000)).clone()
            topk_hook(dgc, FakeBucket(weighted.clone(), params)).wait()
            velocities.append((velocity_before, dgc.velocities[0].clone(), dgc.residuals[0].clone()))
        torch.save((results, velocities), os.path.join(out_dir, f"topk{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_topk_residual_plus_sent_is_weighted_gradient_and_nonfinite_keeps_residual(tmp_path):
    mp.start_processes(_topk_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    loaded = [torch.load(tmp_path / f"topk{r}.pt") for r in range(2)]
    got = [results for results, _ in loaded]
    k = 50
    for step in range(2):
        sent = []
        for rank in range(2):
            weighted, before, after, out, counted = got[rank][step]
            acc = weighted + before
            mask = after == 0
            assert int(mask.sum()) == k  # exactly k entries left this rank
            sent_r = torch.where(mask, acc, torch.zeros(()))
            assert torch.equal(after + sent_r, acc)  # residual + sent == weighted gradient (+ carried residual)
            assert acc[mask].abs().min() >= acc[~mask].abs().max()  # the largest magnitudes went
            assert counted == {"all": k * (4 + 4)}  # fp32 values + int32 indices
            sent.append(sent_r)
        # Both ranks receive the same average of what was sent.
        assert torch.equal(got[0][step][3], got[1][step][3])
        assert torch.equal(got[0][step][3] * 2, sent[0] + sent[1])
    # Step 2: rank 1's bucket has a NaN. Its residual is left as it was; the NaN reaches every rank's gradient.
    _, before, after, out, _ = got[1][2]
    assert torch.equal(after, before) and torch.isfinite(after).all()
    for rank in range(2):
        assert torch.isfinite(got[rank][2][2]).all()
        assert not torch.isfinite(got[rank][2][3]).all()
    # Momentum correction: u = 0.5 u + g; the residual accumulates u; the sent entries' velocity is zeroed.
    for rank in range(2):
        velocities = loaded[rank][1]
        for step in range(2):
            u = 0.5 * velocities[step][0] + got[rank][step][0]
            sent = velocities[step][2] == 0
            assert int(sent.sum()) == k
            assert torch.allclose(velocities[step][1], torch.where(sent, torch.zeros(()), u))
    before, after, _ = loaded[1][1][2]  # rank 1's NaN step: the velocity is left as it was
    assert torch.equal(before, after)


def _powersgd_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        params = [torch.zeros(20, 16), torch.zeros(16)]
        state = PowerSGDHookState(PowerSGDCompression(rank=2, start_iter=2), None, params, torch.device("cpu"),
                                  CommCounter(), "all")
        g = torch.Generator().manual_seed(rank)
        results = []
        for step in range(5):
            grad = torch.randn(336, generator=g)
            if step == 3 and rank == 1:
                grad[5] = float("inf")
            out = powersgd_hook(state, FakeBucket(grad, params)).wait().clone()
            ps = state.powersgd
            results.append((out, ps.error_dict[0].clone() if 0 in ps.error_dict else None,
                            ps.q_memory_dict[0].clone() if 0 in ps.q_memory_dict else None))
        torch.save(results, os.path.join(out_dir, f"p{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_powersgd_nonfinite_step_leaves_error_and_warm_start_memory_finite(tmp_path):
    mp.start_processes(_powersgd_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    got = [torch.load(tmp_path / f"p{r}.pt") for r in range(2)]
    for rank in range(2):
        out, error, q = got[rank][3]
        assert not torch.isfinite(out).all()  # the inf of rank 1 reaches both ranks: the optimizer / scaler skips
        assert torch.equal(error, got[rank][2][1])  # the error feedback is what it was before the step
        assert torch.equal(q, got[rank][2][2])  # and so is the warm-start Q
        assert all(torch.isfinite(t).all() for t in got[rank][4])  # the next step is clean again
        assert torch.equal(got[rank][4][0], got[1 - rank][4][0])


def _powersgd_vs_torch_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook as torch_powersgd_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Two matrices of one shape (batched together), others alone, a bias, and 30x8 (compressed at r=2 only).
        params = [torch.zeros(20, 16), torch.zeros(16), torch.zeros(20, 16), torch.zeros(16, 20), torch.zeros(30, 8)]
        numel = sum(p.numel() for p in params)
        results = {}
        for r in (2, 4):
            ours = PowerSGDHookState(PowerSGDCompression(rank=r, start_iter=2), None, params, torch.device("cpu"),
                                     CommCounter(), "all")
            theirs = PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2, random_seed=0)
            g = torch.Generator().manual_seed(rank)
            for step in range(6):
                grad = torch.randn(numel, generator=g)
                a = powersgd_hook(ours, FakeBucket(grad.clone(), params)).wait().clone()
                b = torch_powersgd_hook(theirs, FakeBucket(grad.clone(), params)).wait().clone()
                results[r, step] = (a, b, ours.powersgd.error_dict.get(0), theirs.error_dict.get(0),
                                    ours.counter.take())
        torch.save(results, os.path.join(out_dir, f"v{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_powersgd_hook_computes_what_torchs_hook_does(tmp_path):
    """The batched hook is torch's PowerSGD: same result and error memory every step, at r=2 (both Gram-Schmidt)
    and r=4 (torch: QR, here: Gram-Schmidt), with warm start across steps."""
    mp.start_processes(_powersgd_vs_torch_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    got = [torch.load(tmp_path / f"v{r}.pt") for r in range(2)]
    for rank in range(2):
        for (r, step), (ours, theirs, err_ours, err_theirs, counted) in got[rank].items():
            assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5), (rank, r, step)
            if step >= 2:
                assert torch.allclose(err_ours, err_theirs, rtol=1e-4, atol=1e-5), (rank, r, step)
                compressed = [(20, 16), (20, 16), (16, 20)] + ([(30, 8)] if r == 2 else [])
                elements = sum((n + m) * r for n, m in compressed) + 16 + (0 if r == 2 else 240)
                assert counted == {"all": elements * 4}
            assert torch.equal(ours, got[1 - rank][(r, step)][0])  # both ranks hold the same average
        assert not torch.allclose(got[rank][2, 5][0], got[rank][4, 5][0])  # the rank matters: it did compress


def _hierarchical_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        groups = {0: [0, 1], 1: [0, 1], 2: [2]}  # unequal groups: {0, 1} and {2}; leaders 0 and 2
        made = {tuple(ranks): dist.new_group(ranks) for ranks in ([0, 1], [2])}
        leaders = dist.new_group([0, 2])
        x = torch.arange(12, dtype=torch.float32) * (rank + 1) + rank
        params = [torch.zeros(12)]
        results = {}
        for name in ("topk", "fp16"):
            counter = CommCounter()
            if name == "topk":  # ratio 1, no error feedback: everything is sent, the mean must be exact
                inner, inner_state = topk_hook, TopKState(TopKCompression(ratio=1.0, error_feedback=False), leaders,
                                                          params, torch.device("cpu"), counter, "inter")
            else:
                inner, inner_state = cast_hook, CastState("fp16", leaders, counter, "inter")
            state = HierarchicalState(made[tuple(groups[rank])], groups[rank][0], leaders if rank in (0, 2) else None,
                                      2, 3, inner, inner_state, counter)
            out = hierarchical_hook(state, FakeBucket(x.clone(), params)).wait()
            results[name] = (out, counter.take())
        torch.save((x, results), os.path.join(out_dir, f"h{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_hierarchical_mean_is_right_for_unequal_groups(tmp_path):
    mp.start_processes(_hierarchical_worker, args=(free_port(), str(tmp_path)), nprocs=3, start_method="fork")
    got = [torch.load(tmp_path / f"h{r}.pt") for r in range(3)]
    mean = sum(x for x, _ in got) / 3
    for rank, (_, results) in enumerate(got):
        assert torch.allclose(results["topk"][0], mean, rtol=1e-6), rank
        assert torch.allclose(results["fp16"][0], mean, rtol=1e-3), rank
        assert torch.equal(results["fp16"][0], got[0][1]["fp16"][0])  # every rank gets the leader's broadcast
        inter = {"topk": 12 * (4 + 4), "fp16": 12 * 2}
        for name in inter:
            expected = {"intra": 2 * 12 * 4}
            if rank in (0, 2):
                expected["inter"] = inter[name]
            assert results[name][1] == expected, (rank, name)


# -- training -------------------------------------------------------------------------------------------------------
EPOCHS = 20  # 300 optimizer steps
RESUME_EPOCH = 9  # checkpoint after step 150
FP32_BYTES = (64 * 32 + 32 + 32 * 10 + 10) * 4
TRAIN_SETTINGS = {  # compression, and the optimizer's momentum (0 where the hook owns it)
    "powersgd": (PowerSGDCompression(rank=4, start_iter=10), 0.9),
    "topk": (TopKCompression(ratio=0.1, warmup_steps=50, warmup_ratio=0.5), 0.9),
    # At 5 % every entry leaves every ~20 steps: masking would drop most of the momentum (see TopKCompression).
    "topk-momentum": (TopKCompression(ratio=0.05, warmup_steps=50, warmup_ratio=0.5, momentum=0.9,
                                      momentum_masking=False), 0.0),
}


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory) -> list[dict]:
    records = fit_digits(str(tmp_path_factory.mktemp("none")), "none", epochs=EPOCHS)
    assert records[0]["bytes"] == [FP32_BYTES] * len(records[0]["params"])  # DDP's full-size all-reduce
    return records


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN_SETTINGS))
def test_compressed_training_reaches_uncompressed_loss_and_resumes_exactly(tmp_path, uncompressed, name):
    """300 steps (20 epochs, global batch 128 split 96/32, SGD lr 0.05 momentum 0.9): the final loss over all digits
    is at most 1% above the uncompressed run's; resuming from the checkpoint after step 150 repeats steps 151-300
    bit for bit on every rank."""
    compression, momentum = TRAIN_SETTINGS[name]
    records = fit_digits(str(tmp_path / "full"), compression, epochs=EPOCHS, save_every_epoch=True,
                         momentum=momentum)
    assert_replicas_equal(records)
    assert len(records[0]["params"]) == len(uncompressed[0]["params"]) == 300
    reference = full_loss(uncompressed[0]["params"][-1])
    loss = full_loss(records[0]["params"][-1])
    assert loss <= 1.01 * reference, (name, loss, reference)

    ckpt = str(tmp_path / "full" / f"epoch={RESUME_EPOCH}.ckpt")
    resumed = fit_digits(str(tmp_path / "resumed"), compression, epochs=EPOCHS, ckpt_path=ckpt,
                         momentum=momentum)
    start = (RESUME_EPOCH + 1) * 15
    for rank in range(2):
        assert len(resumed[rank]["params"]) == 300 - start
        for step, params in enumerate(resumed[rank]["params"]):
            assert torch.equal(params, records[rank]["params"][start + step]), f"rank {rank} step {start + step + 1}"


@pytest.mark.slow
@pytest.mark.parametrize(("masking", "optimizer_momentum"), [(False, 0.9), (True, 0.0)])
def test_topk_momentum_correction_sending_everything_is_exact(tmp_path, masking, optimizer_momentum):
    """``ratio=1``: the hook's momentum without masking is SGD's momentum, with masking (every entry is sent every
    step, so its velocity is reset) plain SGD, under unequal capacity weights, to fp32 rounding; replicas equal."""
    reference = fit_digits(str(tmp_path / "ref"), "none", epochs=2, momentum=optimizer_momentum)
    config = TopKCompression(ratio=1.0, momentum=0.9, momentum_masking=masking)
    records = fit_digits(str(tmp_path / "topk"), config, epochs=2, momentum=0.0)
    assert_replicas_equal(records)
    for step in range(30):
        expected = reference[0]["params"][step]
        diff = (records[0]["params"][step] - expected).abs().max() / expected.abs().max()
        assert diff <= 1e-6, (step, float(diff))


def test_topk_momentum_warns_when_the_optimizer_has_momentum_too():
    from lightning_hetero.grad.compression import GradientCompression

    params = [nn.Parameter(torch.zeros(3))]
    hook = GradientCompression(TopKCompression(momentum=0.9), params, 2, torch.device("cpu"))
    with pytest.warns(UserWarning, match="momentum is applied twice"):
        hook.check_optimizers([torch.optim.SGD(params, lr=0.1, momentum=0.9)])
    with pytest.warns(UserWarning, match="Adam"):
        hook.check_optimizers([torch.optim.Adam(params)])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hook.check_optimizers([torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params, betas=(0.0, 0.99))])
        GradientCompression(TopKCompression(), params, 2, torch.device("cpu")).check_optimizers(
            [torch.optim.SGD(params, lr=0.1, momentum=0.9)])


def test_bytes_on_the_wire(tmp_path):
    """top-k 1%: values (fp32) + indices (int32) <= 1/50 of the fp32 gradient; PowerSGD rank r: (n + m) r per matrix
    (full size for the biases) after ``start_iter`` plain steps; logged as ``comm/bytes``."""
    topk = fit_digits(str(tmp_path / "topk"), TopKCompression(ratio=0.01), epochs=1, log_every_n_steps=1)
    for record in topk:
        assert set(record["bytes"]) == {(2410 // 100) * 8}
        assert max(record["bytes"]) <= FP32_BYTES / 50
        assert record["logged_bytes"][-1] == record["bytes"][-1]
        assert record["table"] == (("compression", ("topk(0.01)", "topk(0.01)")),)
    psgd = fit_digits(str(tmp_path / "psgd"), PowerSGDCompression(rank=2, start_iter=5), epochs=1)
    expected = psgd_expected_elements(DigitsMLP(), rank=2) * 4
    assert expected == ((64 + 32) * 2 + 32 + (32 + 10) * 2 + 10) * 4
    for record in psgd:
        assert record["bytes"] == [FP32_BYTES] * 5 + [expected] * 10


@pytest.mark.parametrize("compression", ["fp16", CastCompression(dtype="bf16", hierarchical=True, group_by="class")])
def test_cast_matches_uncompressed_within_dtype_tolerance(tmp_path, uncompressed, compression):
    records = fit_digits(str(tmp_path), compression, epochs=2)
    assert_replicas_equal(records)
    dtype = torch.float16 if compression == "fp16" else torch.bfloat16
    if compression == "fp16":
        assert [set(r["bytes"]) for r in records] == [{2410 * 2}] * 2
    else:  # hierarchical: fp32 sum and broadcast inside the group, bf16 across leaders (rank 0 leads)
        assert [set(r["bytes"]) for r in records] == [{2410 * (4 + 2 + 4)}, {2410 * (4 + 4)}]
        assert records[0]["table"] == (("compression", ("fp32 in group, bf16 across", "fp32 in group")),)
    tolerance = 30 * torch.finfo(dtype).eps  # 30 steps of rounding error of one cast each
    for step in range(30):
        expected = uncompressed[0]["params"][step]
        diff = (records[0]["params"][step] - expected).abs().max() / expected.abs().max()
        assert diff <= tolerance, (step, float(diff))
    assert not torch.equal(records[0]["params"][29], uncompressed[0]["params"][29])  # the cast did happen


def test_composes_with_gradient_accumulation(tmp_path):
    """The hook fires once per optimizer step (on the synchronizing micro-step), so a step sends one top-k set."""
    records = fit_digits(str(tmp_path), TopKCompression(ratio=0.01), epochs=1, accumulate_grad_batches=3)
    assert records[0]["steps"] == 5  # 15 batches
    assert_replicas_equal(records)
    for record in records:
        stepped = record["bytes"][2::3]  # read after batches 3, 6, ...: the batches that ran the optimizer
        assert stepped == [(2410 // 100) * 8] * 5
    params = records[0]["params"]
    assert torch.equal(params[0], params[1]) and not torch.equal(params[1], params[2])  # they move on steps only
    assert torch.equal(params[2], params[3])


@pytest.mark.parametrize(
    ("yaml_value", "expected"),
    [
        ("topk", TopKCompression()),
        ("{class_path: lightning_hetero.PowerSGDCompression, init_args: {rank: 2, hierarchical: true}}",
         PowerSGDCompression(rank=2, hierarchical=True)),
        ("{class_path: lightning_hetero.TopKCompression, init_args: {ratio: 0.05, warmup_steps: 100}}",
         TopKCompression(ratio=0.05, warmup_steps=100)),
    ],
)
def test_lightning_cli_yaml(tmp_path, yaml_value, expected):
    pytest.importorskip("jsonargparse")
    import sys

    from lightning.pytorch.cli import LightningCLI

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    from train_digits import DigitsClassifier, DigitsDataModule

    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n    class_path: lightning_hetero.HeteroDDPStrategy\n"
        f"    init_args:\n      compression: {yaml_value}\n"
    )
    cli = LightningCLI(DigitsClassifier, DigitsDataModule, run=False, args=["--config", str(config)])
    assert cli.trainer.strategy.compression_config == expected


@pytest.mark.gpu(2)
@pytest.mark.parametrize("compression", ["fp16", "powersgd", TopKCompression(ratio=0.01, hierarchical=True),
                                         TopKCompression(ratio=0.01),
                                         TopKCompression(ratio=0.01, warmup_steps=10, momentum=0.9)])
def test_gpu_nccl_hooks_keep_replicas_identical(tmp_path, compression):
    pytest.importorskip("sklearn")
    momentum = 0.0 if isinstance(compression, TopKCompression) and compression.momentum else 0.9
    records = fit_digits(str(tmp_path), compression, epochs=2, accelerator="cuda", momentum=momentum)
    assert_replicas_equal(records)
    assert records[0]["steps"] == 30


class _Bucket(FakeBucket):
    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        super().__init__(torch.zeros(sum(p.numel() for p in params)), params)
        self._index = index

    def index(self) -> int:
        return self._index


def test_bucket_state_follows_parameters_across_layouts():
    """Saved in DDP's rebuilt layout (two buckets), restored into the initial one (one bucket, other order)."""
    from lightning_hetero.grad.bucket_state import BucketStates, elementwise_segments

    params = [torch.zeros(3, 2), torch.zeros(3), torch.zeros(4)]
    saved: dict[int, torch.Tensor] = {}
    states = BucketStates(params, torch.device("cpu"), {"residual": (lambda: saved, elementwise_segments, True)})
    states.observe(_Bucket(0, [params[2], params[1]]))
    states.observe(_Bucket(1, [params[0]]))
    saved[0] = torch.arange(7.0)  # params[2] -> 0..3, params[1] -> 4..6
    saved[1] = torch.arange(10.0, 16.0)  # params[0]
    checkpoint = states.state_dict()

    restored: dict[int, torch.Tensor] = {}
    again = BucketStates(params, torch.device("cpu"), {"residual": (lambda: restored, elementwise_segments, True)})
    again.load_state_dict(checkpoint)
    again.observe(_Bucket(0, [params[0], params[1], params[2]]))
    expected = torch.cat([torch.arange(10.0, 16.0), torch.arange(4.0, 7.0), torch.arange(4.0)])
    assert torch.equal(restored[0], expected)
