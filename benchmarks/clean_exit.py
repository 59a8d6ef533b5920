"""Does a finished job exit 0? Runs the same short CPU job N times per configuration and prints the exit codes.

    python benchmarks/clean_exit.py --runs 50                         # every configuration below, 50 runs each
    python benchmarks/clean_exit.py --runs 20 --configs hetero-ddp:torchrun,hetero-fsdp:torchrun

A configuration is ``strategy:launcher``. Strategies: ``hetero-ddp``, ``hetero-fsdp`` (both with sharded or file
checkpoints every 4 steps), ``lightning-ddp`` (Lightning's own ``DDPStrategy``, for comparison: this package cannot
change how it exits). Launchers: ``torchrun`` (``torchrun --nproc-per-node 2``) and ``lightning`` (``python script``
with ``devices=2``: Lightning's own subprocess launcher). Each job: 2 CPU ranks on gloo, a tiny MLP, 16 steps; it
counts as clean when every process exits 0 and nothing says ``terminate called``. The runs of one configuration are
consecutive (one job at a time: the host's cores are shared).
"""

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("hetero-ddp:torchrun", "hetero-fsdp:torchrun", "hetero-ddp:lightning", "hetero-fsdp:lightning",
           "lightning-ddp:torchrun")


def job(strategy_name: str, out_dir: str) -> None:
    """One training job (a rank, or under Lightning's launcher the launching rank 0)."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 4, (128,), generator=g))
            return DataLoader(data, batch_size=8)

    quiet = {"observation": {"print_table": False}}
    strategy = {"hetero-ddp": lambda: HeteroDDPStrategy(capacities=[3, 1], **quiet),
                "hetero-fsdp": lambda: HeteroFSDPStrategy(capacities=[3, 1], **quiet),
                "lightning-ddp": lambda: DDPStrategy()}[strategy_name]()
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)), strategy=strategy,
                      max_steps=16, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=out_dir, every_n_train_steps=4, save_top_k=-1)])
    trainer.fit(Model())
    if trainer.global_rank == 0:
        print(f"finished at step {trainer.global_step}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(config: str, timeout: float) -> tuple[int, bool, float]:
    """(exit code, whether the output says ``terminate called``, seconds) of one job."""
    strategy_name, launcher = config.split(":")
    with tempfile.TemporaryDirectory() as out_dir:
        me = [os.path.abspath(__file__), "--job", strategy_name, "--out", out_dir]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), *me]
        else:
            cmd = [sys.executable, *me]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, False, time.monotonic() - start
        text = proc.stdout + proc.stderr
        finished = "finished at step 16" in text
        code = proc.returncode if finished or proc.returncode != 0 else 1
        return code, "terminate called" in text, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="jobs per configuration (default 50)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated strategy:launcher pairs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job, args.out)
        return
    rows = []
    for config in args.configs.split(","):
        codes: collections.Counter = collections.Counter()
        aborts, seconds = 0, 0.0
        for i in range(args.runs):
            code, aborted, took = run_once(config, args.timeout)
            codes[code] += 1
            aborts += aborted
            seconds += took
            print(f"{config} run {i + 1}/{args.runs}: exit {code}{' (terminate called)' if aborted else ''}",
                  flush=True)
        rows.append((config, args.runs, codes[0], dict(codes), aborts, seconds / args.runs))
    print(f"\n| configuration | runs | exit 0 | exit codes | 'terminate called' | s per job |")
    print("|---|---|---|---|---|---|")
    for config, runs, clean, codes, aborts, mean in rows:
        listed = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items()))
        print(f"| {config} | {runs} | {clean} | {listed} | {aborts} | {mean:.1f} |")
    # Lightning's own strategy is there for comparison: only this package's configurations decide the exit code.
    ours = [row for row in rows if not row[0].startswith("lightning-")]
    sys.exit(0 if all(clean == runs for _, runs, clean, *_ in ours) else 1)


if __name__ == "__main__":
    main()
