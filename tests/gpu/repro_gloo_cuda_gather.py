"""torch's bug behind the SIGSEGV at the end of a sharded fit on ranks sharing a GPU, alone (no Lightning, no project
code): gloo's *coalesced* all-gather takes CUDA tensors without a CUDA path and hands their device pointers to its
host-side copy, so the gloo worker thread dies of SIGSEGV while the caller waits in ``Work::wait``
(pytorch/pytorch#152645, open).

DTensor's ``full_tensor()`` reaches it: ``_c10d_functional.all_gather_into_tensor`` calls
``ProcessGroup.allgather_into_tensor_coalesced``, which gloo sends to ``allgather_coalesced`` (host tensors only).
``dist.all_gather_into_tensor`` (``_allgather_base``, FSDP2's own all-gather during training) has a CUDA path (pinned
host copies) and works. The workaround in the product (``strategies/fsdp.py``, ``_full_tensor``): on a mesh of gloo
groups the shards are gathered as CPU copies, on a CPU mesh over the same groups.

Each case is a fresh pair of processes on one GPU (gloo), so a crash ends that case only:

    python tests/gpu/repro_gloo_cuda_gather.py                  # one GPU, < 60 s; a table last
    python tests/gpu/repro_gloo_cuda_gather.py --device cpu     # the same cases on host tensors (all pass)

Expected on torch 2.11 with a GPU: ``c10d_allgather`` ok, ``funcol_allgather`` and ``dtensor_full_tensor`` SIGSEGV,
``dtensor_cpu_copies`` (the workaround) ok. The exit status is 0 when every case ends as expected.
"""

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

CASES = {
    "c10d_allgather": "dist.all_gather_into_tensor on the device (gloo's _allgather_base)",
    "funcol_allgather": "functional all_gather_tensor on the device (gloo's allgather_coalesced)",
    "dtensor_full_tensor": "DTensor.full_tensor(), Shard(0) on a device mesh over the gloo group",
    "dtensor_cpu_copies": "the workaround: the shard as a CPU copy on a CPU mesh over the same group",
}
CRASHES_ON_CUDA = {"funcol_allgather", "dtensor_full_tensor"}


def _rank(case: str, device_type: str) -> None:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    shard = torch.full((4, 3), float(rank), device=device)
    expected = torch.cat([torch.full((4, 3), float(r)) for r in range(world)])
    if case == "c10d_allgather":
        whole = torch.empty(4 * world, 3, device=device)
        dist.all_gather_into_tensor(whole, shard)
    elif case == "funcol_allgather":
        whole = funcol.all_gather_tensor(shard, 0, dist.group.WORLD).wait()
    else:
        on_cpu = case == "dtensor_cpu_copies"
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu" if on_cpu else device_type)
        local = shard.cpu() if on_cpu else shard
        whole = DTensor.from_local(local, mesh, [Shard(0)]).full_tensor()
    if device_type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(whole.cpu(), expected), whole
    dist.barrier()
    dist.destroy_process_group()
    print(f"[rank {rank}] {case}: ok", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case: str, device_type: str) -> list[subprocess.Popen]:
    """Both ranks of ``case``, started."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-case", case, "--device",
                              device_type], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for r in range(2)]


def finish(procs: list[subprocess.Popen], deadline: float) -> tuple[list[Optional[int]], str]:
    """The ranks' return codes (-11: SIGSEGV; None: still waiting at ``deadline``, or 2 s after the other rank
    failed: it waits in the collective; then killed) and rank 0's last lines."""
    failed_at = None
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > 2:
            break
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
    text = procs[0].communicate()[0]
    for p in procs[1:]:
        p.communicate()
    return codes, "\n".join(text.strip().splitlines()[-3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--timeout", type=float, default=50.0, help="seconds for all the cases")
    parser.add_argument("--rank-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_case:
        _rank(args.rank_case, args.device)
        return 0
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else ""))
    # The cases side by side, each its own pair of processes (8 on the GPU), so the whole run stays short.
    started = {case: launch(case, args.device) for case in CASES}
    deadline = time.time() + args.timeout
    rows, as_expected = [], True
    for case, what in CASES.items():
        codes, tail = finish(started[case], deadline)
        crashed = -11 in codes
        ok = all(c == 0 for c in codes)
        expected_crash = args.device == "cuda" and case in CRASHES_ON_CUDA
        as_expected &= crashed if expected_crash else ok
        outcome = "SIGSEGV" if crashed else "ok" if ok else f"failed {codes}"
        rows.append(f"{case:20s} {outcome:16s} {'SIGSEGV' if expected_crash else 'ok':9s} {what}")
        if not ok and not crashed:
            rows.append("    " + tail.replace("\n", "\n    "))
    print(f"{'case':20s} {'outcome':16s} {'expected':9s} what")
    print("\n".join(rows))
    print("every case as expected" if as_expected else "NOT as expected (see above)")
    return 0 if as_expected else 1


if __name__ == "__main__":
    sys.exit(main())
