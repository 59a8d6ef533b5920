"""A training script for the popen-launcher fault test (Lightning re-executes a script, not pytest).

    python tests/resilience/_fault_worker.py OUT_DIR FAULT FAULT_RANK TIMEOUT [START_METHOD]  # Trainer(devices=2), popen default
"""

import os
import sys

import torch
from lightning.pytorch import Trainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

from lightning_hetero import HeteroDDPStrategy  # noqa: E402
from tests.resilience.test_faults import FaultyModel  # noqa: E402


def main() -> None:
    out_dir, fault, fault_rank, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    start_method = sys.argv[5] if len(sys.argv) > 5 else "popen"
    with open(os.path.join(out_dir, f"rank.{os.getpid()}.pid"), "w"):
        pass
    torch.set_num_threads(1)
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                      strategy=HeteroDDPStrategy(capacities="equal", resilience={"timeout": timeout},
                                                 observation={"print_table": False}, start_method=start_method),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(FaultyModel(fault, fault_rank, out_dir))


if __name__ == "__main__":
    main()
