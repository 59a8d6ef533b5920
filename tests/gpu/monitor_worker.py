"""HeteroMonitor on 2 GPUs (standalone: Lightning's popen launcher re-executes this script in the second rank).

    python tests/gpu/monitor_worker.py --out DIR

Rank 1 runs under a green context with a quarter of the SMs. Trains a matmul-bound model with equal shares, then with
profiled shares, and writes each run's wait fractions (from the monitor's ``hetero_monitor.jsonl``) to
``DIR/result.json``.
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_worker import MatmulNet, _Indices  # noqa: E402  (sets the NCCL environment, TF32 off)
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_hetero import HeteroDDPStrategy  # noqa: E402
from lightning_hetero.observe.monitor import SIDECAR  # noqa: E402


def monitored(out: str, capacities: str, steps: int = 30, batch: int = 2048) -> dict:
    seed_everything(0)
    strategy = HeteroDDPStrategy(capacities=capacities, emulate=[None, {"sm_share": 0.25}],
                                 observation={"monitor": True}, resilience={"timeout": 300})
    trainer = Trainer(accelerator="gpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                      log_every_n_steps=10, logger=CSVLogger(os.path.join(out, capacities)),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    trainer.fit(MatmulNet(), train_dataloaders=DataLoader(_Indices(batch * 2 * (steps + 1)), batch_size=batch))
    if trainer.global_rank != 0:
        return {}
    (path,) = glob.glob(os.path.join(out, capacities, "**", SIDECAR), recursive=True)
    with open(path) as f:
        windows = [json.loads(line) for line in f][1:]  # the first window holds warm-up steps
    steps_n = sum(w["steps"] for w in windows)
    per_step = {k: [sum(w[k][r] * w["steps"] for w in windows) / steps_n for r in range(2)]
                for k in ("compute", "wait", "data", "comm", "cycle")}
    return {"per_step_s": per_step, "wait_fraction": [per_step["wait"][r] / per_step["cycle"][r] for r in range(2)],
            "shares": windows[-1]["shares"], "ideal_fraction": windows[-1]["ideal_fraction"],
            "nvml": windows[-1]["nvml"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"equal": monitored(args.out, "equal"), "profile": monitored(args.out, "profile")}
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
