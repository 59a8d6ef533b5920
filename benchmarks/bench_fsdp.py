"""What HeteroFSDPStrategy's per-rank memory modes cost and save, on what one device can show.

For a GPT of a given size, one process (a process group of one: gloo on CPU, NCCL on a GPU) trains a few AdamW steps
with plain DDP (the baseline for a model that fits) and with FSDP2 under each memory mode of
:mod:`lightning_hetero.plan.memory` (``keep``, ``checkpoint``, ``offload``, ``checkpoint_offload``), and reports the
step time, the peak device memory and the plan's estimate of it. ``--largest`` then searches, per mode, the deepest
GPT that trains under a device-memory cap (``--cap-gib``, e.g. 24 for an RTX 3090): the largest model each mode lets
a short card hold.

    python benchmarks/bench_fsdp.py --out $OUT                         # one GPU: GPT 12x768, then the search at 24 GiB
    python benchmarks/bench_fsdp.py --tiny --accelerator cpu --out /tmp/fsdp   # smoke run on CPU (no memory figures)
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import GPT, Block, GPTConfig
from plotting import pyplot

from lightning_hetero.grad.sharding import device_mesh, shard_module
from lightning_hetero.lab.devices import describe_device
from lightning_hetero.plan.memory import GIB, MEMORY_MODES, ModelFootprint, estimate

CONFIGS = ("ddp",) + tuple(f"fsdp-{m}" for m in MEMORY_MODES)


def build(config: str, cfg: GPTConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    mode = config.split("-", 1)[1] if config != "ddp" else "keep"
    with torch.device(device if "offload" not in mode else "cpu"):  # an offloaded model is built in host memory
        model = GPT(cfg)
    if config == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = device_mesh({"host": (0,)}, device.type)
    return shard_module(model, mesh, (Block,), checkpoint="checkpoint" in mode, offload="offload" in mode)


def measure(config: str, cfg: GPTConfig, batch: int, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """Median step time and peak device memory of AdamW steps on random tokens."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build(config, cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        with autocast:
            logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, optimizer
    return {"config": config, "step_ms": 1000 * statistics.median(times),
            "peak_gib": None if peak is None else peak / GIB}


def planned_gib(config: str, cfg: GPTConfig, batch: int, activation_bytes_per_sample: int) -> float:
    """The memory plan's estimate for one rank (the fit check's number) of this configuration."""
    model = GPT(cfg)
    footprint = ModelFootprint.of(model, (Block,), slots=2)
    mode = "keep" if config == "ddp" else config.split("-", 1)[1]
    device = describe_device(torch.device("cpu"), 0)
    return estimate(footprint, mode, device, 1, batch, activation_bytes_per_sample, 0).needed / GIB


def fits(config: str, cfg: GPTConfig, batch: int, device: torch.device) -> bool:
    try:
        measure(config, cfg, batch, device, warmup=1, steps=1)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def largest(config: str, width: int, seq: int, batch: int, device: torch.device, max_layers: int) -> int:
    """The most layers of a GPT of ``width`` that trains under the cap (doubling, then bisection)."""
    def cfg(layers: int) -> GPTConfig:
        return GPTConfig(vocab=50304, seq=seq, width=width, layers=layers, heads=width // 64)

    low, high = 0, 1
    while high <= max_layers and fits(config, cfg(high), batch, device):
        low, high = high, high * 2
    high = min(high, max_layers + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(config, cfg(middle), batch, device) else (low, middle)
    return low


def parameters(width: int, layers: int, seq: int) -> int:
    return 50304 * width + seq * width + layers * (12 * width * width + 13 * width) + 2 * width


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT and 2 + 3 steps (smoke run)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--largest", action="store_true",
                        help="search the deepest GPT each mode trains under --cap-gib")
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--width", type=int, default=2048, help="GPT width for --largest")
    parser.add_argument("--max-layers", type=int, default=96)
    parser.add_argument("--out", default="benchmarks/results/fsdp")
    args = parser.parse_args(argv)
    cuda = args.accelerator == "cuda" or (args.accelerator == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    cfg = GPTConfig.tiny() if args.tiny else GPTConfig(vocab=50304, seq=1024, width=768, layers=12, heads=12)
    warmup, steps = (2, 3) if args.tiny else (args.warmup, args.steps)
    os.makedirs(args.out, exist_ok=True)

    rows = [measure(c, cfg, args.batch, device, warmup, steps) for c in CONFIGS]
    keep = next(r for r in rows if r["config"] == "fsdp-keep")
    # Activation bytes per sample, measured: the keep mode's peak minus its planned states, per sample.
    per_sample = 0
    if keep["peak_gib"] is not None:
        states = planned_gib("fsdp-keep", cfg, 0, 0)
        per_sample = max(0, int((keep["peak_gib"] - states) * GIB / args.batch))
    for row in rows:
        row["planned_gib"] = planned_gib(row["config"], cfg, args.batch, per_sample)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    result: dict[str, Any] = {"device": device_name, "torch": torch.__version__, "model": cfg.__dict__,
                              "parameters": sum(p.numel() for p in GPT(cfg).parameters()), "batch": args.batch,
                              "rows": rows}
    print(f"{device_name}, GPT {cfg.layers}x{cfg.width} ({result['parameters'] / 1e6:.0f}M), batch {args.batch}")
    print(f"{'config':<24} {'step ms':>8} {'peak GiB':>9} {'planned GiB':>12}")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['config']:<24} {r['step_ms']:>8.1f} {peak:>9} {r['planned_gib']:>12.2f}")

    if args.largest and cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device)
        found = {}
        for config in CONFIGS:
            layers = largest(config, args.width, 1024, args.batch, device, args.max_layers)
            found[config] = {"layers": layers, "parameters": parameters(args.width, layers, 1024) if layers else 0}
            print(f"largest under {args.cap_gib} GiB, {config}: {layers} layers of width {args.width} "
                  f"({found[config]['parameters'] / 1e9:.2f}B parameters)")
        result["largest"] = {"cap_gib": args.cap_gib, "width": args.width, "batch": args.batch, "by_config": found}

    with open(os.path.join(args.out, "bench_fsdp.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "bench_fsdp.png"))
    dist.destroy_process_group()


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    names = [r["config"] for r in rows]
    panels = 3 if "largest" in result else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    axes[0].bar(names, [r["step_ms"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("step time (ms)")
    peaks = [r["peak_gib"] or 0 for r in rows]
    axes[1].bar(names, peaks, color="tab:orange", label="measured peak")
    axes[1].scatter(names, [r["planned_gib"] for r in rows], color="black", zorder=3, label="plan's estimate")
    axes[1].set_ylabel("device memory (GiB)")
    axes[1].legend()
    if "largest" in result:
        largest = result["largest"]
        axes[2].bar(names, [v["parameters"] / 1e9 for v in largest["by_config"].values()], color="tab:green")
        axes[2].set_ylabel(f"largest GPT under {largest['cap_gib']:g} GiB (B params)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(f"{result['device']}: GPT {result['model']['layers']}x{result['model']['width']}, "
                 f"batch {result['batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
