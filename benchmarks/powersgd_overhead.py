"""Time of PowerSGD's own work per step: torch's ``powerSGD_hook`` against this package's ``powersgd_hook``.

The gradients of a GPT (benchmarks/models.py) are cut into DDP-like buckets of ``--bucket-mb`` (in reverse
parameter order, as DDP fills them) and both hooks compress them in one process (world size 1: the all-reduces are
no-ops, so what is timed is the hook's compression work and its launch overhead). ``--profile`` prints the
torch.profiler table of one step of each. Usage::

    python benchmarks/powersgd_overhead.py --device cpu --size small     # a CPU check, seconds
    python benchmarks/powersgd_overhead.py --device cuda                 # one GPU, the 98M GPT
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compression_bench import SIZES  # noqa: E402
from benchmarks.models import GPT, GPTConfig  # noqa: E402
from lightning_hetero.grad.bucket_state import CommCounter  # noqa: E402
from lightning_hetero.grad.compression_config import PowerSGDCompression  # noqa: E402
from lightning_hetero.grad.powersgd_hook import PowerSGDHookState, powersgd_hook  # noqa


class Bucket:
    """The parts of ``dist.GradBucket`` the hooks use, over a flat buffer of some parameters' gradients."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool) -> None:
        self.params, self.idx, self.last = params, index, last
        self.buf = torch.empty(sum(p.numel() for p in params), device=params[0].device)

    def fill(self, generator: torch.Generator) -> None:
        self.buf.normal_(generator=generator)

    def buffer(self) -> torch.Tensor:
        return self.buf

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self.params:
            out.append(self.buf[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def index(self) -> int:
        return self.idx

    def is_last(self) -> bool:
        return self.last

    def parameters(self) -> list[torch.Tensor]:
        return self.params


def buckets_of(params: list[torch.Tensor], cap_bytes: int) -> list[Bucket]:
    groups, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return [Bucket(i, g, i == len(groups) - 1) for i, g in enumerate(groups)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--size", choices=list(SIZES), default="gpt")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix approximation rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per hook (after 3 warm-up steps)")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's table of one step of each")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a shared machine, more threads mostly measure contention)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    params = [p.detach().to(device) for p in GPT(GPTConfig(**SIZES[args.size])).parameters()]
    buckets = buckets_of(params, int(args.bucket_mb * 2**20))
    config = PowerSGDCompression(rank=args.rank, start_iter=2)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(hook, state, generator: torch.Generator) -> float:
        for bucket in buckets:
            bucket.fill(generator)  # outside the timed region
        sync()
        start = time.perf_counter()
        futures = [hook(state, bucket) for bucket in buckets]
        for fut in futures:
            fut.wait()
        sync()
        return time.perf_counter() - start

    hooks = {
        "torch powerSGD_hook": (powerSGD_hook, lambda: PowerSGDState(None, matrix_approximation_rank=args.rank,
                                                                      start_powerSGD_iter=2)),
        "lightning_hetero powersgd_hook": (powersgd_hook, lambda: PowerSGDHookState(
            config, None, params, device, CommCounter(), "all")),
    }
    states = {name: make_state() for name, (_, make_state) in hooks.items()}
    generators = {name: torch.Generator(device=device).manual_seed(0) for name in hooks}
    for name, (hook, _) in hooks.items():
        for _ in range(3):  # 2 plain all-reduce steps, then the first compressed step (allocations, random Q)
            step(hook, states[name], generators[name])
    times: dict[str, list[float]] = {name: [] for name in hooks}
    for _ in range(args.steps):  # interleaved: a busy machine slows both alike
        for name, (hook, _) in hooks.items():
            times[name].append(step(hook, states[name], generators[name]))
    results = {}
    for name, values in times.items():
        values.sort()
        results[name] = {"median_ms": values[len(values) // 2] * 1e3, "min_ms": values[0] * 1e3}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        for name, (hook, _) in hooks.items():
            with profile(activities=activities) as prof:
                step(hook, states[name], generators[name])
            sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
            print(f"\n== {name} ==\n" + prof.key_averages().table(sort_by=sort, row_limit=15))
    summary = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "size": args.size,
               "parameters": sum(p.numel() for p in params), "buckets": len(buckets), "rank": args.rank,
               "threads": torch.get_num_threads(),
               "torch": torch.__version__, "results": results}
    print(json.dumps(summary, indent=1))
    with open(os.path.join(args.out, f"powersgd_overhead_{args.device}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
