"""``python -m lightning_hetero doctor``: what this machine offers a mixed-GPU job, and what to set.

Checks, locally and without starting a job: versions, each visible device with its published rate and bf16
support, suggested capacities, peer-to-peer access between GPU pairs (flaky on some consumer cards: then NCCL
needs ``NCCL_P2P_DISABLE=1``), and the NCCL settings in the environment.

``doctor --model CONFIG`` also trains the config's model for a few steps on this machine with a
:class:`~lightning_hetero.observe.monitor.HeteroMonitor`, so the lab table (shares, batch per card) and the monitor's
summary (compute, wait, data and communication per card) show what each card will do before a real run.
"""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from lightning_hetero.lab.devices import describe_device, has_bf16_hardware, is_consumer_card, peak_tflops
from lightning_hetero.plan.layout_choice import (
    ASSUMED_MFU,
    Card,
    assumed_costs,
    compare_layouts,
    comparison_table,
    trainer_code,
    trainer_yaml,
)
from lightning_hetero.plan.step_cost import Workload, with_link


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
                "suggested_precision": ("bf16-mixed" if has_bf16_hardware(d)
                                        else "16-mixed" if d.type == "cuda" else "32-true"),
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
    report["peer_access"] = gpu_pair_links(count)
    report["network"] = network_interfaces()
    report["nccl_recommended"] = nccl_recommendations(report["peer_access"], [d["name"] for d in report["devices"]],
                                                      report["network"])
    for key, (value, why) in report["nccl_recommended"].items():
        if os.environ.get(key) != value:
            report["advice"].append(f"export {key}={value}  ({why})")
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
        link = f", {pair['link']}" if pair.get("link") else ""
        lines.append(f"  GPUs {pair['pair'][0]}-{pair['pair'][1]}: p2p {'yes' if pair['p2p'] else 'NO'}{link}")
    for nic in report.get("network", []):
        speed = f"{nic['gbit']:g} Gbit/s" if nic["gbit"] else "speed unknown"
        lines.append(f"  network {nic['name']}: {speed}")
    if report["env"]:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(report["env"].items())))
    lines += [f"advice: {a}" for a in report["advice"]] or ["advice: none"]
    return "\n".join(lines)


def main(as_json: bool = False) -> None:
    report = diagnose()
    print(json.dumps(report, indent=2) if as_json else format_report(report))


# -- GPU pairs and the links between hosts ---------------------------------------------------------------------------
def gpu_pair_links(count: int) -> list[dict[str, Any]]:
    """Peer-to-peer access of every GPU pair and, with ``nvidia-ml-py`` installed, how they are connected (NVLink
    lane count, or the PCIe topology level NVML reports)."""
    nvml = _nvml()
    pairs = []
    for i in range(count):
        for j in range(i + 1, count):
            entry: dict[str, Any] = {"pair": [i, j], "p2p": bool(torch.cuda.can_device_access_peer(i, j))}
            if nvml is not None:
                entry["link"] = _nvml_link(nvml, i, j)
            pairs.append(entry)
    return pairs


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, or no driver: the P2P flag alone is still reported
        return None


def _nvml_link(nvml: Any, i: int, j: int) -> str:
    try:
        a, b = nvml.nvmlDeviceGetHandleByIndex(i), nvml.nvmlDeviceGetHandleByIndex(j)
        pci_b = nvml.nvmlDeviceGetPciInfo(b).busId
        pci_b = pci_b.decode() if isinstance(pci_b, bytes) else pci_b
        lanes = 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nvml.nvmlDeviceGetNvLinkState(a, link) != 1:
                    continue
                remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(a, link).busId
            except Exception:
                continue
            remote = remote.decode() if isinstance(remote, bytes) else remote
            # Behind NVSwitch the remote end is the switch: count those lanes as reaching every GPU.
            lanes += 1 if remote.lower() == pci_b.lower() or _is_nvswitch(nvml, remote) else 0
        if lanes:
            return f"NVLink x{lanes}"
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
        names = {0: "same board", 10: "PCIe switch", 20: "PCIe switches", 30: "PCIe host bridge",
                 40: "CPU interconnect (SMP)", 50: "across CPU sockets"}
        return f"PCIe ({names.get(int(level), level)})"
    except Exception as err:  # an NVML call this driver lacks
        return f"unknown ({type(err).__name__})"


def _is_nvswitch(nvml: Any, bus_id: str) -> bool:
    try:
        nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        return False  # a GPU, but not the one asked about
    except Exception:
        return True


def network_interfaces() -> list[dict[str, Any]]:
    """Network interfaces that are up, with their link speed (Linux sysfs): the candidates between hosts."""
    root = "/sys/class/net"
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name == "lo" or name.startswith(("docker", "veth", "virbr", "br-")):
            continue
        try:
            with open(os.path.join(root, name, "operstate")) as f:
                if f.read().strip() not in ("up", "unknown"):
                    continue
            with open(os.path.join(root, name, "speed")) as f:
                mbit = int(f.read().strip())
        except (OSError, ValueError):
            mbit = -1
        out.append({"name": name, "gbit": mbit / 1000 if mbit > 0 else None})
    return out


def nccl_recommendations(pairs: list[dict[str, Any]], names: list[str],
                         network: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """NCCL settings this machine needs: ``{variable: (value, why)}``.

    Cards without working peer-to-peer (most consumer cards: RTX 3090 / 4090 have none, or a flaky one behind some
    chipsets) need ``NCCL_P2P_DISABLE=1``: NCCL then stages through host shared memory instead of hanging or
    corrupting data. Between hosts NCCL needs to know which interface is the lab network.
    """
    out: dict[str, tuple[str, str]] = {}
    no_p2p = [p["pair"] for p in pairs if not p["p2p"]]
    consumer = [n for n in names if is_consumer_card(n)]
    if no_p2p:
        out["NCCL_P2P_DISABLE"] = ("1", f"GPU pairs {no_p2p} have no peer-to-peer access")
    elif consumer and len(names) > 1:
        out["NCCL_P2P_DISABLE"] = ("1", f"consumer cards ({consumer[0]}): peer-to-peer reported but unreliable "
                                        "on many drivers; remove if a P2P bandwidth test passes")
    fast = [n for n in network if n["gbit"]]
    if fast:
        best = max(fast, key=lambda n: n["gbit"])
        out["NCCL_SOCKET_IFNAME"] = (best["name"], f"the fastest interface ({best['gbit']:g} Gbit/s) for traffic "
                                                   "between hosts; set the same on every host")
    return out


# -- `doctor --compare-layouts`: every layout, subsets of the cards included, from the model's size -------------------


def layouts_report(cards: Sequence[Card], params: float, optimizer_slots: int, global_batch: int, tokens: int,
                   mfu: float = ASSUMED_MFU, link: Optional[str] = None,
                   solo: Optional[Mapping[str, float]] = None) -> dict[str, Any]:
    """The layouts compared on ``cards`` for a model of ``params`` fp32 parameters (``6 × params × tokens`` FLOPs a
    sample at ``mfu`` of each card's published rate, or ``solo``: the samples/s a card class measured alone), as
    JSON: every layout's samples/s and step, the pick, its Trainer arguments and YAML, and the table as ``text``."""
    if params <= 0 or global_batch < 1:
        raise ValueError(f"`--params`={params!r} must be positive and `--global-batch`={global_batch!r} >= 1.")
    job = Workload(param_bytes=int(params) * 4, global_batch=global_batch, optimizer_slots=optimizer_slots)
    costs = with_link(assumed_costs(cards, job, tokens, mfu), link)
    unknown = sorted(set(solo or {}) - {c.label for c in costs})
    if unknown:
        raise ValueError(f"`--solo` names {unknown}, which are not cards of `--lab` "
                         f"({sorted({c.label for c in costs})}).")
    costs = [replace(c, sample_s=1.0 / solo[c.label], measured=True) if solo and c.label in solo else c for c in costs]
    comparison = compare_layouts(job, costs)
    pick = comparison.pick
    return {
        "layouts": {v.key: v.samples_per_s for v in comparison.verdicts},
        "verdicts": [{"key": v.key, "samples_per_s": v.samples_per_s, "needed_bytes": list(v.needed_bytes),
                      "fits": list(v.fits), "note": v.note,
                      "step": None if v.prediction is None else {
                          "step_s": v.prediction.step_s, "compute_s": v.prediction.compute_s,
                          "comm_s": v.prediction.comm_s, "exposed_s": v.prediction.exposed_s,
                          "fixed_s": v.prediction.fixed_s, "traffic_bytes": v.prediction.traffic_bytes,
                          "batches": list(v.prediction.batches), "link": v.prediction.link}}
                     for v in comparison.verdicts],
        "pick": None if pick is None else pick.key, "why": comparison.why,
        "measured": list(comparison.measured), "assumed": list(comparison.assumed),
        "inputs": {"params": params, "optimizer_slots": optimizer_slots, "global_batch": global_batch,
                   "tokens": tokens, "mfu": mfu, "link": link, "solo": dict(solo or {})},
        "trainer": None if pick is None else trainer_code(pick.plan, len(costs)),
        "yaml": None if pick is None else trainer_yaml(pick.plan, len(costs)),
        "text": comparison_table(comparison, costs, job).replace(
            "\npick:", f"\nassumed: optimizer steps at each card's published memory bandwidth; {6 * tokens} FLOPs a "
            f"sample per parameter at {mfu:.0%} of the published rate where not measured\npick:", 1),
    }


def parse_solo(text: Optional[str]) -> dict[str, float]:
    """``"A100-80GB=1900,RTX3090=420"``: samples/s each card class measured alone."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"`--solo` entry {part!r} is not CARD=SAMPLES_PER_S.") from None
        if not out[name.strip()] > 0:
            raise ValueError(f"`--solo` entry {part!r}: samples/s must be positive.")
    return out


# -- `doctor --model CONFIG`: a short dry run of the config's model and data on this machine -------------------------

DRY_RUN_STEPS = 20


def dry_run_command(config: str, script: Optional[str] = None, steps: int = DRY_RUN_STEPS,
                    root_dir: Optional[str] = None) -> list[str]:
    """The command that trains ``config`` for ``steps`` optimizer steps with a :class:`HeteroMonitor` and no logger,
    checkpoints or validation: through ``script`` (a LightningCLI script, e.g. ``examples/train_digits.py``) or, when
    the config names its classes (``model: {class_path: ...}``), through a generic LightningCLI."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"`--steps`={steps!r} must be an integer >= 2.")
    if not os.path.isfile(config):
        raise ValueError(f"`config`={config!r} is not a file.")
    entry = [sys.executable, script] if script else [sys.executable, "-m", "lightning_hetero.observe.doctor"]
    overrides = [
        f"--trainer.max_steps={steps}", "--trainer.max_epochs=-1", "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_checkpointing=false", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", f"--trainer.log_every_n_steps={steps}",
        "--trainer.callbacks+=lightning_hetero.HeteroMonitor",
        f"--trainer.callbacks.init_args.warmup_steps={min(5, steps // 4)}",
    ]
    if root_dir:
        overrides.append(f"--trainer.default_root_dir={root_dir}")
    return entry + ["fit", "--config", config] + overrides


def dry_run(config: str, script: Optional[str] = None, steps: int = DRY_RUN_STEPS) -> int:
    """Run the dry run (its output streams through: the lab table, the monitor's summary and warnings)."""
    with tempfile.TemporaryDirectory(prefix="hetero-doctor-") as root:
        cmd = dry_run_command(config, script, steps, root)
        print(f"doctor --model: {steps} training steps of {config} on this machine (nothing is saved)\n  "
              + " ".join(cmd), flush=True)
        return subprocess.call(cmd)


def _generic_cli() -> None:
    """LightningCLI over any LightningModule / LightningDataModule named by ``class_path`` in the config."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    # A registry name in the config (`strategy: hetero_ddp`) resolves: running this module imported the package first,
    # which registered its strategies.
    LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 save_config_callback=None)


if __name__ == "__main__":
    from lightning_hetero.observe.errors import run_main

    run_main(_generic_cli, "lightning-hetero doctor --model")
