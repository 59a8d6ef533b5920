"""GPU check of the two-level sync across emulated hosts (standalone script: Lightning's spawn launcher pickles
``__main__``). Writes ``result.json`` to ``--out``; tests/gpu/test_gpu_hosts.py asserts on it.

    python tests/gpu/hosts_worker.py --out DIR --compression none-hierarchical   # 2 GPUs on 2 emulated hosts
    python tests/gpu/hosts_worker.py --out DIR --compression auto
    python tests/gpu/hosts_worker.py --out DIR --accelerator cpu                  # dry run of the same logic
"""

import argparse
import copy
import json
import os
import sys
from typing import Any

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

from lightning_hetero import HeteroDDPStrategy, NoCompression  # noqa: E402
from tests.helpers import Recorder, TinyModel, max_rel_diff, reference_run  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")


class LabRecorder(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            lab = trainer.strategy.lab
            with open(os.path.join(self.out, "lab.json"), "w") as f:
                json.dump({"hosts": {k: list(v) for k, v in lab.hosts.items()}, "columns": dict(lab.columns),
                           "table": lab.table(trainer.strategy.plan)}, f)


def run(out: str, compression: str, accelerator: str) -> dict[str, Any]:
    capacities, epochs = [3.0, 1.0], 3
    seed_everything(0)
    model = TinyModel("sgd", batch_size=8, n=96)
    reference = copy.deepcopy(model)
    slow = {"sm_share": 0.25} if accelerator == "gpu" else {"slowdown": 2.0}
    emulate = [{"host": "server", "inter_host_gbit": 25}, {"host": "ws", "inter_host_gbit": 25, **slow}]
    config: Any = NoCompression(hierarchical=True) if compression == "none-hierarchical" else compression
    strategy = HeteroDDPStrategy(capacities=capacities, start_method="spawn", timeout=300, emulate=emulate,
                                 compression=config)
    trainer = Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=epochs, precision="32-true",
                      callbacks=[Recorder(out), LabRecorder(out)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)
    trainer.fit(model)
    records = [torch.load(os.path.join(out, f"rank{r}.pt"), map_location="cpu") for r in range(2)]
    ref_params, _ = reference_run(reference, 2, capacities, epochs)
    steps = min(len(records[0]["params"]), len(records[1]["params"]))
    identical = [bool(torch.equal(records[0]["params"][i], records[1]["params"][i])) for i in range(steps)]
    diffs = [max_rel_diff(records[0]["params"][i], ref_params[i]) for i in range(min(steps, len(ref_params)))]
    with open(os.path.join(out, "lab.json")) as f:
        lab = json.load(f)
    return {"compression": compression, "steps": [len(r["params"]) for r in records],
            "reference_steps": len(ref_params), "replicas_identical_every_step": all(identical),
            "max_rel_diff": max(diffs), "hosts": lab["hosts"], "columns": lab["columns"], "table": lab["table"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compression", default="none-hierarchical", choices=["none-hierarchical", "auto"])
    parser.add_argument("--accelerator", default="gpu")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = run(args.out, args.compression, args.accelerator)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "table"}))
    print(result["table"])


if __name__ == "__main__":
    main()
