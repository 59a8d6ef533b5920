"""A standalone training script for the launch tests (Lightning's popen launcher re-executes a script, not pytest).

    python tests/strategies/_launch_worker.py OUT_DIR registry      # Trainer(strategy="hetero_ddp"), Lightning launches 2 procs
    python tests/strategies/_launch_worker.py OUT_DIR node          # one "node" of 2; the caller starts both with NODE_RANK set
"""

import os
import sys

import torch
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

import lightning_hetero  # noqa: E402, F401
from tests.helpers import Recorder, TinyModel  # noqa: E402


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    seed_everything(0)
    common = dict(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[Recorder(out_dir)])
    if mode == "registry":
        trainer = Trainer(strategy="hetero_ddp", devices=2, **common)
    else:
        strategy = lightning_hetero.HeteroDDPStrategy(capacities=[3, 1], resilience={"timeout": 120})
        trainer = Trainer(strategy=strategy, devices=1, num_nodes=2, **common)
    trainer.fit(TinyModel(n=40))
    lab = trainer.strategy.lab
    torch.save({**lab.as_dict(), **trainer.strategy.plan.as_dict()}, os.path.join(out_dir, f"lab{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
