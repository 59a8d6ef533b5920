"""Check that emulated hosts change NCCL's transport: P2P / NVLink inside an emulated host, NET between hosts.

Runs one all-reduce per layout with ``NCCL_DEBUG=INFO`` in fresh processes whose emulation profile names a host
(:mod:`lightning_hetero.lab.emulation` sets ``LIGHTNING_HETERO_HOST`` and ``NCCL_HOSTID`` before the process group), then
reads NCCL's channel lines (``... 0[0] -> 1[1] via P2P/CUMEM`` or ``via NET/Socket/0``) and checks each connection
against the layout: same emulated host → not NET; different hosts → NET. With 2 GPUs it runs "one host" (both
ranks on one host) and "two hosts"; with 4 or more also "2+2".

    python benchmarks/check_nccl_hosts.py        # exit status 0 when every layout uses the expected transport
"""

import json
import os
import re
import subprocess
import sys
from typing import Any

import torch

# "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", "... 0[1b000] -> 1[2c000] [send] via NET/Socket/0" (NCCL versions differ)
_CHANNEL = re.compile(r"Channel \d+/\d+ : (\d+)\[[0-9a-fA-Fx]+\] -> (\d+)\[[0-9a-fA-Fx]+\] (?:\[\w+\] )?via (\S+)")


def child(hosts: list[str]) -> None:
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    specs = parse_emulate([{"host": h, "link": "ethernet"} for h in hosts])
    start_emulation(specs, rank, world, describe_device(device, rank), device)
    dist.init_process_group("nccl", device_id=device)
    x = torch.ones(8 << 20, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert x[0].item() == world
    print(f"RESULT rank={rank} host={describe_device(device, rank).host} NCCL_HOSTID={os.environ['NCCL_HOSTID']}",
          flush=True)
    dist.destroy_process_group()


def run_layout(hosts: list[str], port: int) -> dict[str, Any]:
    procs, world = [], len(hosts)
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_DEBUG": "INFO",
               "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,NET", "NCCL_NVLS_ENABLE": "0"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", json.dumps(hosts)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
    connections: dict[tuple[int, int], set[str]] = {}
    for out in outputs:
        for a, b, via in _CHANNEL.findall(out):
            connections.setdefault((int(a), int(b)), set()).add(via)
    problems = []
    for (a, b), vias in sorted(connections.items()):
        net = any(v.startswith("NET") for v in vias)
        if net != (hosts[a] != hosts[b]):
            problems.append(f"{a}->{b} via {sorted(vias)} but hosts {hosts[a]!r}, {hosts[b]!r}")
    if not connections:
        problems.append("no NCCL channel lines found (NCCL_DEBUG output changed?)")
    if any(p.returncode != 0 for p in procs):
        problems.append(f"exit codes {[p.returncode for p in procs]}")
    return {"hosts": hosts, "connections": {f"{a}->{b}": sorted(v) for (a, b), v in sorted(connections.items())},
            "results": [line for out in outputs for line in out.splitlines() if line.startswith("RESULT")],
            "ok": not problems, "problems": problems,
            "tail": [out[-1500:] for out in outputs] if problems else []}


def main() -> int:
    count = torch.cuda.device_count()
    if count < 2:
        print("needs 2 CUDA devices")
        return 2
    layouts = [["a", "a"], ["a", "b"]] + ([["a", "a", "b", "b"]] if count >= 4 else [])
    reports = [run_layout(h, 29700 + i) for i, h in enumerate(layouts)]
    for r in reports:
        print(f"hosts {r['hosts']}: {'OK' if r['ok'] else 'FAIL'} {r['connections']} {r['problems']}")
        for t in r["tail"]:
            print(t)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "check_nccl_hosts.json"), "w") as f:
            json.dump(reports, f, indent=1)
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
