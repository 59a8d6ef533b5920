"""One rank of a link measurement (``benchmarks/rehearse_real.py``): the lab's link class set as the emulator sets it
(NCCL's transport settings), then all-gathers and reduce-scatters of two sizes timed, so that a collective's time is
``latency + bytes / bandwidth`` from measurements on this machine.

    python benchmarks/link_rank.py RANK WORLD PORT LINK OUT_JSON   # one process per rank, rank r on GPU r
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hetero.lab.emulation_env import link_env  # noqa: E402

# Whole-tensor sizes (bytes) timed: a small one for the latency, a large one (a 1.1B GPT's block in bf16 is ~100 MB)
# for the bandwidth.
SIZES = (1 << 20, 128 << 20)
REPEATS = 10


def main() -> None:
    rank, world, port, link, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(link_env(link))  # type: ignore[arg-type]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    seconds = {}
    dtype = torch.bfloat16 if cuda else torch.float32
    for size in SIZES:
        whole = torch.empty(size // dtype.itemsize, dtype=dtype, device=device)
        shard = torch.empty(whole.numel() // world, dtype=dtype, device=device)
        for name, collective in (("all_gather", lambda: dist.all_gather_into_tensor(whole[:shard.numel() * world],
                                                                                    shard)),
                                 ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard,
                                                                                       whole[:shard.numel() * world]))):
            try:
                collective()  # warm-up: connections, buffers
            except RuntimeError:  # gloo has no reduce-scatter: CPU runs time the all-gather only
                continue
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(REPEATS):
                collective()
            if cuda:
                torch.cuda.synchronize()
            seconds[f"{name}:{size}"] = (time.perf_counter() - started) / REPEATS
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "world": world, "link": link, "seconds": seconds, "sizes": SIZES}, f)


if __name__ == "__main__":
    main()
