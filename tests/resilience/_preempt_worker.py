"""A training script for the pre-emption tests: the test signals it from outside (the launcher's parent, torchrun).

    python tests/resilience/_preempt_worker.py OUT_DIR fork        # 2 forked ranks, the script's process is their parent
    python tests/resilience/_preempt_worker.py OUT_DIR popen       # the script's process is rank 0, it starts rank 1
    torchrun --nproc-per-node 2 tests/resilience/_preempt_worker.py OUT_DIR torchrun

Every process writes ``<pid>.pid``, each rank ``rank<r>`` (its pid); rank 0 writes ``started`` once step 3 is done
and ``final.pt`` (the parameters) when training ends. Checkpoints go to ``OUT_DIR/ckpts`` (``resume="auto"``): run it
again to go on.
"""

import atexit
import os
import sys
import time

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

from lightning_hetero import HeteroDDPStrategy, Observation, Resilience  # noqa: E402
from tests.helpers import TinyModel, flat_params  # noqa: E402


class Pace(Callback):
    """A steady 0.1 s per step (the signal lands mid-training), and rank 0's "started" mark after step 3."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, *args: object) -> None:
        open(os.path.join(self.out_dir, f"{os.getpid()}.pid"), "w").close()
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        time.sleep(0.1)

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == 3 and trainer.global_rank == 0:
            open(os.path.join(self.out_dir, "started"), "w").close()


def _note_exit(out_dir: str) -> None:
    # Written whole, then renamed: the test may read while this process is still writing.
    path = os.path.join(out_dir, f"{os.getpid()}.exit")
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(path + ".tmp", path)


def main() -> None:
    out_dir, launcher = sys.argv[1], sys.argv[2]
    # When each process reaches interpreter exit (the test reports where the time after a signal goes).
    atexit.register(_note_exit, out_dir)
    open(os.path.join(out_dir, f"{os.getpid()}.pid"), "w").close()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyModel("adam", batch_size=4, n=96, dropout=0.3)  # 12 steps per epoch, 2 epochs
    strategy = HeteroDDPStrategy(capacities=[3, 1], resilience=Resilience(timeout=60, resume="auto"),
                                 observation=Observation(print_table=False),
                                 start_method="fork" if launcher == "fork" else "popen")
    devices = int(os.environ["LOCAL_WORLD_SIZE"]) if launcher == "torchrun" else 2
    trainer = Trainer(accelerator="cpu", devices=devices, max_epochs=2,
                      strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=[Pace(out_dir), ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpts"),
                                                                every_n_train_steps=100)])
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(flat_params(model), os.path.join(out_dir, "final.pt"))


if __name__ == "__main__":
    main()
