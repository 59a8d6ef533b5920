"""HeteroMonitor's per-stage breakdown on 3 GPUs (standalone: Lightning's popen launcher re-executes this script).

    python tests/gpu/stage_monitor_worker.py --out DIR [--schedule gpipe|1f1b] [--overlap] [--steps 30]

``HeteroHybridStrategy`` with rank 0 data-parallel and ranks 1 and 2 a 2-stage pipeline of a matmul-bound model;
rank 2 (stage 1) runs under a green context with a quarter of the SMs. Rank 0 writes the last logged window's
per-rank fields (``hetero_monitor.jsonl``) and each rank's stage buffers' bytes (``expected_bytes``: the stages'
gradients and presence flags it exchanges) to ``DIR/result.json`` and prints them as a table last.
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_worker import _Indices  # noqa: E402  (sets the NCCL environment, TF32 off)
import torch  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_hetero import HeteroHybridStrategy  # noqa: E402
from lightning_hetero.observe.monitor import SIDECAR  # noqa: E402

FIELDS = ("stage_span", "stage_compute", "sendrecv", "bubble", "compute", "wait", "comm", "exchange", "cycle")


class PipelinedMatmul(LightningModule):
    """Matmul-bound, with the forward a pipeline can split (``self(x)`` on the batch): 8 square layers."""

    def __init__(self, width: int = 4096, depth: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(depth)))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # Inputs from the sample indices (a seeded function of them): the loader stays light.
        x = torch.sin(batch.float()[:, None] + torch.arange(self.width, device=batch.device, dtype=torch.float32))
        return self(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    parser.add_argument("--overlap", action="store_true", help="overlap_stage_exchange=True")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=512, help="per-rank batch of the loader")
    args = parser.parse_args()
    seed_everything(0)
    strategy = HeteroHybridStrategy(pipelines=[[1, 2]], split_points=["net.4"], schedule=args.schedule,
                                    micro_batches=4, capacities=[2, 1, 1], overlap_stage_exchange=args.overlap,
                                    emulate=[None, None, {"sm_share": 0.25}], observation={"monitor": True},
                                    resilience={"timeout": 300})
    trainer = Trainer(accelerator="gpu", devices=3, strategy=strategy, max_steps=args.steps, log_every_n_steps=10,
                      logger=CSVLogger(args.out), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(PipelinedMatmul(), train_dataloaders=DataLoader(_Indices(args.batch * 3 * (args.steps + 1)),
                                                                batch_size=args.batch))
    if trainer.global_rank != 0:
        return
    (path,) = glob.glob(os.path.join(args.out, "**", SIDECAR), recursive=True)
    with open(path) as f:
        window = [json.loads(line) for line in f][-1]
    sync, params = strategy.stage_sync, dict(trainer.lightning_module.named_parameters())
    stages = [sum(params[n].numel() * params[n].element_size() + params[n].element_size() for n in names)
              for names in sync.partition]
    result = {"schedule": args.schedule, "overlap": sync.overlap, "pipelines": window["pipelines"],
              "steps": window["steps"], "device": torch.cuda.get_device_name(0), **{k: window[k] for k in FIELDS},
              "comm_bytes": window["comm_bytes"], "expected_bytes": [sum(stages), stages[0], stages[1]]}
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"stage breakdown, {args.schedule}, overlap {sync.overlap}, last window ({window['steps']} steps), ms per "
          "step (MB: exchanged per step, expected); rank 2 = stage 1 at 1/4 of the SMs")
    print("rank  " + "  ".join(f"{k:>13}" for k in FIELDS) + "  exchange MB  expected MB")
    for r in range(3):
        print(f"{r:<4}  " + "  ".join(f"{1000 * result[k][r]:>13.2f}" for k in FIELDS)
              + f"  {result['comm_bytes'][r] / 1e6:>11.4f}  {result['expected_bytes'][r] / 1e6:>11.4f}")


if __name__ == "__main__":
    main()
