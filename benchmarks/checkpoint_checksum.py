"""What the checkpoint checksums cost: seconds per GB to save with and without them, and to verify at load.

    python benchmarks/checkpoint_checksum.py --gb 1 --repeats 3 --out benchmarks/results/checkpoint_checksum.json

A checkpoint of ``--gb`` GB of float32 tensors (64 MB each) is saved by Lightning's ``TorchCheckpointIO`` and by
``AtomicCheckpointIO`` (SHA-256 while writing, the checksum file, fsync, renames) in ``--dir``; then the file is
verified (``file_checksum``: a read pass, the page cache warm as right after a save) and loaded by ``torch.load``.
The fastest of ``--repeats`` runs per measurement.
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from typing import Callable

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_hetero.resilience.checkpoint import AtomicCheckpointIO, file_checksum


def _fastest(repeats: int, run: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    chunk = 16 << 20  # float32 elements: 64 MB per tensor
    n = max(1, round(args.gb * (1 << 30) / (4 * chunk)))
    checkpoint = {"state_dict": {f"w{i}": torch.randn(chunk) for i in range(n)}, "epoch": 0, "global_step": 1}
    directory = tempfile.mkdtemp(dir=args.dir)
    try:
        plain, atomic = os.path.join(directory, "plain.ckpt"), os.path.join(directory, "atomic.ckpt")
        save_plain = _fastest(args.repeats, lambda: TorchCheckpointIO().save_checkpoint(checkpoint, plain))
        save_atomic = _fastest(args.repeats, lambda: AtomicCheckpointIO().save_checkpoint(checkpoint, atomic))
        gb = os.path.getsize(atomic) / 1e9
        verify = _fastest(args.repeats, lambda: file_checksum(atomic))
        load = _fastest(args.repeats, lambda: torch.load(atomic, map_location="cpu"))
        data = bytes(256 << 20)
        sha_in_memory = _fastest(args.repeats, lambda: hashlib.sha256(data).digest()) * (1e9 / len(data))
    finally:
        shutil.rmtree(directory)
    results = {
        "file_gb": round(gb, 3),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "seconds_per_gb": {
            "save_lightning_torch_io": save_plain / gb,
            "save_atomic_with_checksum": save_atomic / gb,
            "checksum_overhead_on_save": (save_atomic - save_plain) / gb,
            "verify_sha256_read_pass": verify / gb,
            "torch_load": load / gb,
            "sha256_in_memory": sha_in_memory,
        },
    }
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
