"""``python -m lightning_hetero doctor``: what this machine offers a mixed-GPU job, and what to set.

Checks, locally and without starting a job: versions, each visible device with its published rate and bf16
support, suggested capacities, peer-to-peer access between GPU pairs (flaky on some consumer cards: then NCCL
needs ``NCCL_P2P_DISABLE=1``), and the NCCL settings in the environment.
"""

import json
import os
from typing import Any

import torch

from lightning_hetero.devices import describe_device, has_bf16_hardware, peak_tflops


def diagnose() -> dict[str, Any]:
    """A JSON-able report of this machine."""
    import lightning

    report: dict[str, Any] = {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "devices": [],
        "peer_access": [],
        "advice": [],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "LIGHTNING_HETERO_", "TORCH_NCCL"))},
    }
    count = torch.cuda.device_count()
    devices = [describe_device(torch.device("cuda", i), i) for i in range(count)] or [
        describe_device(torch.device("cpu"), 0)
    ]
    for d in devices:
        dtype = torch.bfloat16 if has_bf16_hardware(d) else torch.float16
        report["devices"].append(
            {
                **d.as_dict(),
                "bf16_hardware": has_bf16_hardware(d),
                "suggested_precision": "bf16-mixed" if has_bf16_hardware(d) else ("16-mixed" if d.type == "cuda" else "32-true"),
                "peak_tflops": peak_tflops(d, dtype),
            }
        )
    rates = [entry["peak_tflops"] for entry in report["devices"]]
    if count > 1 and all(rates):
        low = min(rates)
        report["suggested_capacities"] = [round(r / low, 2) for r in rates]
        if max(rates) / low > 1.2:
            report["advice"].append(
                "devices differ by {:.1f}x in published rate: capacities='auto' (profiled) is recommended".format(
                    max(rates) / low
                )
            )
    for i in range(count):
        for j in range(i + 1, count):
            ok = torch.cuda.can_device_access_peer(i, j)
            report["peer_access"].append({"pair": [i, j], "p2p": ok})
            if not ok and "NCCL_P2P_DISABLE" not in os.environ:
                report["advice"].append(
                    f"GPUs {i} and {j} have no peer-to-peer access: NCCL falls back to host memory; if jobs hang at "
                    "the first all-reduce, set NCCL_P2P_DISABLE=1"
                )
    if count == 0:
        report["advice"].append("no GPU: training runs as CPU processes over gloo (tests, laptops, the demo)")
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"torch {report['torch']}, lightning {report['lightning']}, CUDA {report['cuda']}, NCCL {report['nccl']}"]
    for d in report["devices"]:
        rate = f"{d['peak_tflops']:.0f} TFLOP/s" if d["peak_tflops"] else "rate unknown"
        cc = f"cc {d['capability'][0]}.{d['capability'][1]}" if d["type"] == "cuda" else d["type"]
        lines.append(
            f"  [{d['rank']}] {d['name']:<28} {cc:<8} {d['memory_bytes'] / 2**30:6.1f} GiB  "
            f"{d['multiprocessors']:4d} SMs/cores  {rate:<16} -> {d['suggested_precision']}"
        )
    if "suggested_capacities" in report:
        lines.append(f"suggested capacities (published rates): {report['suggested_capacities']}")
    for pair in report["peer_access"]:
        lines.append(f"  p2p {pair['pair']}: {'yes' if pair['p2p'] else 'NO'}")
    if report["env"]:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(report["env"].items())))
    lines += [f"advice: {a}" for a in report["advice"]] or ["advice: none"]
    return "\n".join(lines)


def main(as_json: bool = False) -> None:
    report = diagnose()
    print(json.dumps(report, indent=2) if as_json else format_report(report))
