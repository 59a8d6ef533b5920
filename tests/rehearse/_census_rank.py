"""One rank of ``tests/rehearse/test_rehearse_memory.py``: ``lightning_hetero.rehearse.rank`` as the doctor runs it,
with a census of the CPU tensor bytes alive at two points of step ``CENSUS_STEP`` (its start, and after backward
before the optimizer step), written beside the rank's result as ``OUT.census``.

    python tests/rehearse/_census_rank.py JOB_JSON   # with the environment of launch.rank_environment(job)
"""

import gc
import json
import sys
from typing import Any

import torch

from lightning_hetero.rehearse import rank as rank_module
from lightning_hetero.rehearse.job import RankJob

CENSUS_STEP = 2


def live_tensor_bytes() -> int:
    """The bytes of every CPU storage a Python tensor keeps alive, each storage counted once (a DTensor's local shard
    is a tensor of its own; the wrapper holds no storage)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj).__name__ == "DTensor" or not isinstance(obj, torch.Tensor):
            continue
        if obj.is_meta or obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


def main() -> None:
    job = RankJob(**json.loads(sys.argv[1]))
    census: dict[str, int] = {}
    probe = rank_module._probe

    def probe_with_census(*args: Any) -> Any:
        timing = probe(*args)

        class Census(type(timing)):  # type: ignore[misc]
            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                super().on_train_batch_start(trainer, module, batch, batch_idx)
                if trainer.global_step == CENSUS_STEP:
                    census["step_start"] = live_tensor_bytes()

            def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
                if trainer.global_step == CENSUS_STEP:
                    census["before_optimizer_step"] = live_tensor_bytes()

        counted = Census()
        counted.__dict__.update(timing.__dict__)
        return counted

    rank_module._probe = probe_with_census
    result = rank_module.run_rank(job)
    with open(job.out + ".census", "w") as f:
        json.dump({"ok": result.ok, "error": result.error, "split": result.split, **census}, f)


if __name__ == "__main__":
    main()
