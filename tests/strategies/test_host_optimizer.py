"""The host step of offloaded parameters (fused CPU AdamW, overlapped with the backward): the plain step's math."""

import os
import time
from dataclasses import asdict
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.lm import GPTModule
from lightning_hetero import HeteroFSDPStrategy
from lightning_hetero.grad.host_optimizer import fused_unsupported, install_host_step
from lightning_hetero.plan.memory import HostStepConfig, MemoryPolicy
from tests.helpers import flat_params, free_port, max_rel_diff

TOLERANCE = 1e-6  # fp32 reordering: the fused kernel sums in another order than torch's per-parameter loop
# The learning rate's factor at each step: a step that used another step's rate lands far from the plain run.
LR_FACTORS = (1.0, 0.1, 3.0, 0.5)
# Adam's eps: at torch's 1e-8 the normalisation of near-zero gradients amplifies the fused kernel's reordering to
# ~2e-5 of the weights after one step in this model (torch's own AdamW(fused=True) against its loop does the same).
EPS = 1e-5


class TinyGPT(GPTModule):
    """Three blocks, AdamW with two param groups (no decay on 1-D parameters), optionally a per-step schedule."""

    def __init__(self, schedule: bool = False) -> None:
        super().__init__(vocab=64, seq=16, width=32, layers=3, heads=2, lr=3e-3)
        self.schedule = schedule
        self.host_waits = 0  # steps whose backward waited for the overlapped updates

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-3}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=EPS)
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: LR_FACTORS[step % len(LR_FACTORS)])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, 64, (48, 17), generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(tokens), batch_size=4)

    def on_fit_start(self) -> None:
        # The embedding's backward comes after every offloaded block's: there it waits (up to 10 s) until the worker
        # has stepped them, so that the test sees the overlap happen whatever the machine's load.
        def wait_for_worker(module: Any, grad_output: Any) -> None:
            hosts = self.trainer.strategy.host_steps
            deadline = time.monotonic() + 10
            while hosts and hosts[0].overlap and time.monotonic() < deadline and \
                    hosts[0].stats.blocks_overlapped < len(hosts[0].units):
                time.sleep(0.001)
            self.host_waits += bool(hosts)

        self.gpt.tok.register_full_backward_pre_hook(wait_for_worker)


class StepRecorder(Callback):
    """Per rank: the parameters after every step and the host step's record of it."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.params, self.host = out_dir, [], []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.params.append(flat_params(pl_module))
        self.host.append([asdict(h.stats) | {"overlap": h.overlap} for h in trainer.strategy.host_steps])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save({"params": self.params, "host": self.host, "steps": trainer.global_step},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _fit(out_dir: str, host_step: str, schedule: bool = False, max_steps: int = 6, ckpt_path: Optional[str] = None,
         save_every: Optional[int] = None, **trainer_kwargs: Any) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    seed_everything(0)
    model = TinyGPT(schedule)
    policy = MemoryPolicy(rules={"rank:1": "offload:2", "*": "keep"}, host_step=host_step, measure=False)
    strategy = HeteroFSDPStrategy(start_method="fork", memory=policy, capacities=[3, 1], global_batch_size=8,
                                  observation={"print_table": False}, resilience={"timeout": 120})
    callbacks: list[Callback] = [StepRecorder(out_dir)]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=save_every,
                                         save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, callbacks=callbacks,
                      logger=False, enable_checkpointing=bool(save_every), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def _same_params(a: list[dict], b: list[dict], steps: Optional[range] = None) -> None:
    for step in steps or range(len(a[0]["params"])):
        assert torch.equal(a[0]["params"][step], a[1]["params"][step])
        assert max_rel_diff(a[0]["params"][step], b[0]["params"][step]) <= TOLERANCE, step


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [False, True], ids=["constant-lr", "lr-schedule"])
def test_overlapped_host_step_equals_plain_adamw(tmp_path, schedule):
    """Rank 1 offloads 2 of 3 blocks: each is stepped by the worker during the backward (once, with the step's LR),
    the resident blocks by the user's AdamW; the parameters equal the plain AdamW's after every step."""
    plain = _fit(str(tmp_path / "plain"), "plain", schedule)
    overlapped = _fit(str(tmp_path / "overlap"), "overlap", schedule)
    _same_params(overlapped, plain)
    assert plain[1]["host"] == [[]] * 6  # the plain path installs nothing
    assert overlapped[0]["host"] == [[]] * 6  # rank 0 keeps every block on its device
    records = [step[0] for step in overlapped[1]["host"]]
    assert [r["steps"] for r in records] == list(range(1, 7))
    assert all(r["overlap"] and r["blocks_overlapped"] == r["blocks"] == 2 for r in records)
    assert all(r["parameters"] == records[0]["parameters"] > 0 for r in records)
    # This rank's shards of the two blocks (about half of them), not the whole tensors.
    block = sum(p.numel() for p in TinyGPT().gpt.blocks[0].parameters())
    assert block * 0.9 < records[0]["parameters"] < block * 1.1


@pytest.mark.slow
def test_under_accumulation_the_overlap_runs_on_the_stepping_micro_step_only_and_equals_plain_adamw(tmp_path):
    """``accumulate_grad_batches=2``: 6 micro-steps, 3 optimizer steps. The wrapped step (and its worker) runs on
    every second micro-step only, overlapping both offloaded blocks there; the parameters equal the plain AdamW's."""
    plain = _fit(str(tmp_path / "plain"), "plain", max_steps=3, accumulate_grad_batches=2)
    overlapped = _fit(str(tmp_path / "overlap"), "overlap", max_steps=3, accumulate_grad_batches=2)
    assert len(overlapped[0]["params"]) == 6
    _same_params(overlapped, plain)
    records = [step[0] for step in overlapped[1]["host"]]  # after each micro-step: the last optimizer step's record
    assert [r["steps"] for r in records] == [0, 1, 1, 2, 2, 3]
    stepped = records[1::2]
    assert all(r["overlap"] and r["blocks_overlapped"] == r["blocks"] == 2 and r["polls"] > 0 for r in stepped)


@pytest.mark.slow
def test_with_gradient_clipping_the_host_step_runs_after_the_backward_and_equals_plain_adamw(tmp_path):
    plain = _fit(str(tmp_path / "plain"), "plain", gradient_clip_val=0.05)
    fused = _fit(str(tmp_path / "overlap"), "overlap", gradient_clip_val=0.05)
    unclipped = _fit(str(tmp_path / "unclipped"), "plain")
    _same_params(fused, plain)
    assert max_rel_diff(unclipped[0]["params"][-1], plain[0]["params"][-1]) > 1e-4  # the clipping mattered
    records = [step[0] for step in fused[1]["host"]]
    assert all(not r["overlap"] and r["blocks"] == 2 and r["blocks_overlapped"] == 0 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [("overlap", "overlap"), ("overlap", "plain"), ("plain", "overlap")])
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path, first, then):
    """Fit 3 steps and save; resume to step 6 (with the LR schedule): the parameters of the uninterrupted run.
    The checkpoint's optimizer state is the same either way, so one written by one path loads into the other."""
    whole = _fit(str(tmp_path / "whole"), "plain", schedule=True)
    _fit(str(tmp_path / "first"), first, schedule=True, max_steps=3, save_every=3)
    (ckpt,) = os.listdir(tmp_path / "first" / "ckpt")
    resumed = _fit(str(tmp_path / "then"), then, schedule=True, ckpt_path=str(tmp_path / "first" / "ckpt" / ckpt))
    assert len(resumed[0]["params"]) == 3
    for step in range(3):
        assert max_rel_diff(resumed[0]["params"][step], whole[0]["params"][step + 3]) <= TOLERANCE, step


def test_optimizers_without_a_fused_cpu_step_stay_plain_with_a_note():
    model = torch.nn.Linear(3, 3)
    assert "SGD has no fused CPU step" in fused_unsupported(torch.optim.SGD(model.parameters(), lr=0.1))
    assert fused_unsupported(torch.optim.AdamW(model.parameters())) is None
    host, note = install_host_step(torch.optim.AdamW(model.parameters()), model, HostStepConfig("plain"), [])
    assert host is None and note == "host step: plain (the optimizer's own)"


@pytest.mark.parametrize(("fields", "message"), [
    ({"host_step": "fast"}, "`memory.host_step`='fast' must be one of 'overlap', 'fused', 'plain'"),
    ({"host_threads": 0}, "`memory.host_threads`=0 must be None or a positive integer"),
])
def test_bad_host_step_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        MemoryPolicy(**fields)
