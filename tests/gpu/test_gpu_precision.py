"""Per-rank precision on 2 GPUs (NCCL): rank 1 forced onto the fp16 path, rank 0 in bf16, one shared loss scale.

As a test (skipped without 2 CUDA devices)::

    python -m pytest -q -s tests/gpu/test_gpu_precision.py

Standalone (prints a table last, writes ``precision.json`` under ``--out``, default ``$OUT`` or ./out)::

    python tests/gpu/test_gpu_precision.py --out DIR [--accelerator cpu]   # cpu: a gloo dry run of the same code

The launcher starts 2 worker processes with ``LOCAL_RANK`` / ``WORLD_SIZE`` set, so Lightning treats them as
externally launched and each worker runs three fits in a row on the same process group:

- ``mixed``: ``precision_policy="auto"``, rank 1 reports compute capability 7.0 (``LIGHTNING_HETERO_CAPABILITY``),
  so rank 0 trains in bf16 and rank 1 in fp16, both with the job's GradScaler;
- ``bf16``: the same policy without the override (both ranks bf16, no scaler), the reference;
- ``fp32``: no policy, for scale.

Every step, every rank's parameters and loss scale are gathered and compared bit for bit.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

try:  # the standalone run does not need pytest
    import pytest

    pytestmark = pytest.mark.gpu(2)
except ImportError:
    pass

RUNS = ("mixed", "bf16", "fp32")
LOSS_TOLERANCE = 0.02  # |final loss mixed - all-bf16| <= 2% of the all-bf16 loss (bf16 noise dominates)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- worker side ------------------------------------------------------------------------------------------------------
def _worker(out: str, accelerator: str) -> None:
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from lightning_hetero import HeteroDDPStrategy
    from lightning_hetero.lab.devices import CAPABILITY_OVERRIDE_ENV

    class Teacher(Dataset):
        """Labels from a fixed random teacher network: a task the student can fit, so the loss keeps falling."""

        def __init__(self, n: int = 8192, features: int = 256, classes: int = 16) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, features, generator=g)
            w1, w2 = torch.randn(features, 512, generator=g), torch.randn(512, classes, generator=g)
            self.y = (torch.tanh(self.x @ w1 / features**0.5) @ w2).argmax(1)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.x[i], self.y[i]

    class Student(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                                     nn.Linear(1024, 16))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Teacher(), batch_size=64, shuffle=True)

    class Compare(Callback):
        """Gathers every rank's parameters and loss scale after each step and compares them exactly."""

        def __init__(self) -> None:
            self.identical: list[bool] = []
            self.scales: list[list[float]] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flat)
            self.identical.append(all(torch.equal(gathered[0], g) for g in gathered[1:]))
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            scale = [float(scaler.get_scale()) if scaler is not None else 0.0]
            scales: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(scales, scale)
            self.scales.append([s[0] for s in scales])
            self.losses.append(float(trainer.callback_metrics["train_loss"]))

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for run in RUNS:
        # What the emulator does for an emulated pre-Ampere card: rank 1 reports cc 7.0. (The CPU dry run gives
        # rank 0 an Ampere-class capability so that "auto" picks bf16 there as it does on a real GPU.)
        os.environ.pop(CAPABILITY_OVERRIDE_ENV, None)
        if run == "mixed" and rank == 1:
            os.environ[CAPABILITY_OVERRIDE_ENV] = "7.0"
        elif accelerator == "cpu" and run != "fp32":
            os.environ[CAPABILITY_OVERRIDE_ENV] = "9.0"
        seed_everything(0)
        model = Student()
        compare = Compare()
        strategy = HeteroDDPStrategy(capacities=[3, 1], timeout=300, print_table=(run == "mixed"),
                                     precision_policy=None if run == "fp32" else "auto")
        trainer = Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=3, logger=False,
                          callbacks=[compare], enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
        start = time.perf_counter()
        trainer.fit(model)
        seconds = time.perf_counter() - start
        data = Teacher()
        with torch.no_grad():  # final loss of the trained weights on the whole set, in fp32: the same yardstick
            net = model.net.float().to(model.device)
            final = float(nn.functional.cross_entropy(net(data.x.to(model.device)), data.y.to(model.device)))
        results[run] = {
            "precision": [None] * 2, "steps": len(compare.identical), "replicas_identical_every_step":
            all(compare.identical), "first_mismatch": next((i for i, ok in enumerate(compare.identical) if not ok),
                                                           None),
            "scales_equal_every_step": all(len(set(s)) == 1 for s in compare.scales),
            "scale_first_last": [compare.scales[0][0], compare.scales[-1][0]], "loss_first": compare.losses[0],
            "loss_last10": sum(compare.losses[-10:]) / 10, "final_loss": final, "fit_s": seconds,
            "table": strategy.lab.table(strategy.plan),
        }
        precisions: list[Any] = [None] * 2
        dist.all_gather_object(precisions, str(trainer.precision))
        results[run]["precision"] = precisions
    if rank == 0:
        with open(os.path.join(out, "precision.json"), "w") as f:
            json.dump(results, f, indent=1)


# -- launcher side ----------------------------------------------------------------------------------------------------
def launch(out: str, accelerator: str = "gpu") -> dict[str, Any]:
    """Start 2 worker processes (NCCL on GPUs, gloo on CPUs), wait, and return the JSON rank 0 wrote."""
    os.makedirs(out, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("LIGHTNING_HETERO_CAPABILITY", None)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--accelerator", accelerator]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("worker failed:\n" + "\n".join(log[-6000:] for log in logs))
    with open(os.path.join(out, "precision.json")) as f:
        results = json.load(f)
    results["log_rank0"] = logs[0][-4000:]
    return results


def summary(results: dict[str, Any]) -> str:
    lines = [f"{'run':<6} {'precision r0/r1':<24} {'steps':>5} {'identical':>9} {'scale first->last':>20} "
             f"{'loss first':>10} {'last10':>8} {'final':>8} {'fit s':>6}"]
    for run in RUNS:
        r = results[run]
        scale = "-" if r["scale_first_last"][0] == 0 else f"{r['scale_first_last'][0]:g}->{r['scale_first_last'][1]:g}"
        lines.append(f"{run:<6} {'/'.join(r['precision']):<24} {r['steps']:>5} {str(r['replicas_identical_every_step']):>9} "
                     f"{scale:>20} {r['loss_first']:>10.4f} {r['loss_last10']:>8.4f} {r['final_loss']:>8.4f} "
                     f"{r['fit_s']:>6.1f}")
    rel = abs(results["mixed"]["final_loss"] - results["bf16"]["final_loss"]) / results["bf16"]["final_loss"]
    lines.append(f"final loss mixed vs all-bf16: rel diff {rel:.4f} (tolerance {LOSS_TOLERANCE})")
    return "\n".join(lines)


def check(results: dict[str, Any]) -> None:
    mixed, bf16 = results["mixed"], results["bf16"]
    assert mixed["precision"] == ["bf16-mixed", "16-mixed"], mixed["precision"]
    assert bf16["precision"] == ["bf16-mixed", "bf16-mixed"], bf16["precision"]
    assert "16-mixed+scaler" in mixed["table"]
    for run in RUNS:
        assert results[run]["steps"] > 50
        assert results[run]["replicas_identical_every_step"], (run, results[run]["first_mismatch"])
        assert results[run]["scales_equal_every_step"], run
    assert mixed["scale_first_last"][0] == 2.0**16  # the shared scaler was in use on every rank
    assert bf16["scale_first_last"] == [0.0, 0.0]  # no fp16 rank: no scaler anywhere
    assert mixed["final_loss"] < 0.8 * mixed["loss_first"]  # it trained
    rel = abs(mixed["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
    assert rel <= LOSS_TOLERANCE, rel


def test_fp16_rank_beside_bf16_rank_keeps_replicas_identical(tmp_path: Any) -> None:
    start = time.perf_counter()
    results = launch(str(tmp_path))
    print("\n" + summary(results) + f"\nwall {time.perf_counter() - start:.1f} s")
    check(results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.out, args.accelerator)
    else:
        t0 = time.perf_counter()
        res = launch(args.out, args.accelerator)
        ok = "ok"
        try:
            check(res)
        except AssertionError as e:
            ok = f"FAILED: {e!r}"
        print(res["log_rank0"][-1500:])
        print(summary(res) + f"\nwall {time.perf_counter() - t0:.1f} s; checks: {ok}")
        sys.exit(0 if ok == "ok" else 1)
