"""What the weighting comm hook costs against DDP's built-in all-reduce (2 GPUs, GPT-2 small, plain torch loop).

Three DDP setups train the same model on identical batches, each for ``--steps`` timed steps after a warm-up:
``builtin`` (no hook: DDP's C++ all-reduce), ``torch-python`` (torch's ``default_hooks.allreduce_hook``) and
``weighted`` (``lightning_hetero.weighted_allreduce_hook`` as ``HeteroDDPStrategy`` uses it: each step counts its
split, the loss is multiplied by the hook's ``loss_factor`` and the hook sums; an equal split here). Prints ms/step
and the ratio to ``builtin``; writes ``hook_overhead.json`` under ``--out``.

    python benchmarks/hook_overhead.py --out "$OUT"
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import GPT, GPTConfig  # noqa: E402

from lightning_hetero.grad.weighting import WeightingState, weighted_allreduce_hook  # noqa: E402

SETUPS = ("builtin", "torch-python", "weighted")


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    cfg = GPTConfig.gpt2_small(seq=args.seq)
    results = {}
    for setup in SETUPS:
        torch.manual_seed(0)
        model = DistributedDataParallel(GPT(cfg).cuda(rank), device_ids=[rank])
        state = None
        if setup == "torch-python":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif setup == "weighted":
            state = WeightingState(world)
            model.register_comm_hook(state, weighted_allreduce_hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), device=rank)
        times = []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            if state is not None:
                # As the strategy does each batch: count the split, weight the loss; the hook then sums.
                state.add_step(args.batch, args.batch * world)
                loss = loss * state.loss_factor
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        times.sort()
        results[setup] = {"median_ms": 1e3 * times[len(times) // 2], "min_ms": 1e3 * times[0]}
        del model, optimizer
        torch.cuda.empty_cache()
    if rank == 0:
        base = results["builtin"]["median_ms"]
        print(f"{'setup':14}{'median ms':>11}{'min ms':>9}{'x builtin':>11}")
        for setup, r in results.items():
            print(f"{setup:14}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}{r['median_ms'] / base:>11.3f}")
        with open(os.path.join(args.out, "hook_overhead.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "world": world, "batch": args.batch,
                       "seq": args.seq, "emulated": False, "results": results}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(2, port, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
