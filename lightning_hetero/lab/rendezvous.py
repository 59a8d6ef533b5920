"""The job's rendezvous: every rank joins rank 0's store before the process group exists, or the missing are named.

A rank (a host) that never joins would otherwise show as an anonymous "1/2 clients joined" after the store's timeout.
Here every rank announces itself (host, pid) in the store; after ``timeout`` seconds the ranks that are missing, and
their nodes, are named on every rank that did join.

Example::

    >>> store = rendezvous("10.0.0.1", 29500, rank=1, world_size=2, timeout=60)
    >>> torch.distributed.init_process_group("gloo", store=store, rank=1, world_size=2)
"""

import json
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

_JOIN = "lightning_hetero/join"


def rendezvous(address: str, port: int, rank: int, world_size: int, timeout: float, ranks_per_node: int = 1
               ) -> dist.TCPStore:
    """The job's store (served by rank 0), once every rank has joined it; else a ``RuntimeError`` naming who is missing.

    Pass it to ``init_process_group(store=...)``.
    """
    host = socket.gethostname()
    # Under torchrun the agent already serves the store on this port; a restarted job starts a fresh namespace.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    join = f"{_JOIN}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(address, port, world_size=world_size, is_master=rank == 0 and not agent,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as err:  # DistNetworkError / DistStoreError / TimeoutError, depending on how it failed
        if rank == 0:
            raise RuntimeError(f"rank 0 ({host}) could not serve the job's store on {address}:{port}: {err}") from err
        raise RuntimeError(
            f"rank {rank} ({host}) could not reach rank 0's store at {address}:{port} within {timeout:g} s: rank 0 "
            f"(node 0, {address}) has not started, has died or is unreachable. ({err})"
        ) from err
    store.set(f"{join}/{rank}", json.dumps({"host": host, "pid": os.getpid()}))
    keys = [f"{join}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    missing = list(range(world_size))
    try:
        while True:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            if not missing:
                return store
            if store.check([f"{join}/failed"]):  # rank 0 gave up: the same message everywhere
                raise RuntimeError(f"rank {rank} ({host}): " + store.get(f"{join}/failed").decode())
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        joined = {r: json.loads(store.get(keys[r]))["host"] for r in range(world_size) if r not in missing}
    except dist.DistError as err:  # rank 0 (the store) gave up or died first
        raise RuntimeError(
            f"rank {rank} ({host}): rank 0's store at {address}:{port} closed while ranks {missing} had not joined. "
            f"({err})") from err
    nodes = sorted({r // max(1, ranks_per_node) for r in missing})
    message = (
        f"rank(s) {missing} (node(s) {nodes}) did not join the job within {timeout:g} s; joined: "
        + ", ".join(f"rank {r} on {h}" for r, h in joined.items())
        + ". Start the missing node(s) with the same MASTER_ADDR/MASTER_PORT, or check that they can reach "
        f"{address}:{port}."
    )
    if rank == 0:  # the others read it before this process (and the store) goes
        store.set(f"{join}/failed", message)
        time.sleep(0.5)
    raise RuntimeError(f"rank {rank} ({host}): {message}")
