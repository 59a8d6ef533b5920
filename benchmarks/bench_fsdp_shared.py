"""The largest GPT each memory plan trains on a mixed pair emulated on one GPU, and what per-block plans save in time.

Two ranks share one GPU (gloo, the device not bound to the process group), each capped like a card of a mixed pair
(``--caps-gib 52,22``) with ``torch.cuda.set_per_process_memory_fraction``. The ranks take turns on the GPU: memory
figures are those of the caps, step times are time-shared and only comparable between plans measured here.

Plans, each with the package's planner (:func:`lightning_hetero.plan.memory.resolve_memory`) and sharding
(:func:`lightning_hetero.grad.sharding.shard_module`), AdamW, bf16 all-gather / reduce-scatter, 512 tokens:

- ``equal-keep``: equal batches (2 + 2), everything kept: what FSDP does without offload or activation checkpointing
  (Lightning's ``FSDPStrategy`` default);
- ``whole-rank``: capacity shares (3 + 1), one whole-rank mode per rank (keep / checkpoint / offload / both);
- ``per-block``: capacity shares (3 + 1), ``memory="auto"``: per rank, how many blocks offload and recompute.

For a grid of depths the planner predicts the largest GPT each plan holds; that size is then trained (2 warm-up and
``--steps`` timed steps, in fresh processes) to confirm it, and a planned size that runs out of memory is reported
as such. The step time of whole-rank against per-block is measured at ``--ratio-layers``.

    python benchmarks/bench_fsdp_shared.py --out $OUT                 # one GPU
    python benchmarks/bench_fsdp_shared.py --out /tmp/b --cpu --tiny  # gloo dry run of the code on CPU
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import GPT, Block, GPTConfig, gpt_activation_bytes, gpt_parameters  # noqa: E402
from plotting import pyplot  # noqa: E402

from lightning_hetero.grad.sharding import device_mesh, mixed_precision, shard_module  # noqa: E402
from lightning_hetero.grad.weighting import loss_weight  # noqa: E402
from lightning_hetero.lab.devices import DeviceInfo  # noqa: E402
from lightning_hetero.plan.memory import (  # noqa: E402
    GIB,
    MemoryFitError,
    MemoryPolicy,
    ModelFootprint,
    RankMemory,
    device_budget,
    resolve_memory,
)

PLANS = {"equal-keep": [2, 2], "whole-rank": [3, 1], "per-block": [3, 1]}


def config(layers: int, tiny: bool) -> GPTConfig:
    if tiny:
        return GPTConfig(vocab=256, seq=32, width=64, layers=layers, heads=4)
    return GPTConfig(vocab=50304, seq=512, width=2560, layers=layers, heads=20)


def plan(name: str, cfg: GPTConfig, caps_gib: list[float]) -> Optional[list[RankMemory]]:
    """Each rank's plan for ``cfg`` under plan ``name``, or ``None`` where the planner says it cannot fit."""
    per_sample, fraction = gpt_activation_bytes(cfg)
    rules = {"*": "keep"} if name == "equal-keep" else {"*": "auto"}
    policy = MemoryPolicy(rules=rules, activation_bytes_per_sample=per_sample, checkpointed_fraction=fraction,
                          granularity="rank" if name == "whole-rank" else "block")
    with torch.device("meta"):
        footprint = ModelFootprint.of(GPT(cfg), (Block,), slots=2)
    devices = [DeviceInfo(r, "host", "cuda", f"{c:g} GiB cap", (9, 0), int(c * GIB), 132)
               for r, c in enumerate(caps_gib)]
    try:
        return resolve_memory(policy, footprint, devices, PLANS[name], [device_budget(d, policy.headroom)
                                                                        for d in devices], len(devices))
    except MemoryFitError:
        return None


def _rank(rank: int, world: int, port: int, cfg: GPTConfig, rules: list[str], samples: list[int], caps: list[float],
          warmup: int, steps: int, cuda: bool, queue: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(caps[rank] * GIB / total, 0)
        # Ranks sharing one GPU: gloo, the device not bound (see lightning_hetero.lab.shared_gpu).
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = GPT(cfg)
        blocks = cfg.layers
        from lightning_hetero.plan.memory import parse_rule

        counts = parse_rule(rules[rank])
        offload = blocks if counts.offload is None else counts.offload
        checkpoint = blocks if counts.checkpoint is None else counts.checkpoint
        shard_module(model, device_mesh({"host": list(range(world))}, device.type), (Block,), checkpoint=checkpoint,
                     offload=offload, mp_policy=mixed_precision(["bf16-mixed"] * world) if cuda else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab, (samples[rank], cfg.seq + 1), device=device,
                               generator=torch.Generator(device).manual_seed(rank))
        weight = loss_weight(samples[rank], sum(samples), world)
        times, losses = [], []
        for step in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            (loss * weight).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            losses.append(float(loss.detach()))
            if step >= warmup:
                times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        queue.put((rank, {"ok": True, "step_s": statistics.median(times), "peak_gib": None if peak is None else
                          peak / GIB, "losses": losses}))
    except BaseException as err:  # the parent records it and stops the other rank
        oom = isinstance(err, torch.OutOfMemoryError)
        queue.put((rank, {"ok": False, "error": "out of memory" if oom else traceback.format_exc()[-1500:]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def trial(cfg: GPTConfig, plans: list[RankMemory], samples: list[int], caps: list[float], warmup: int, steps: int,
          cuda: bool) -> dict[str, Any]:
    """Train ``cfg`` under ``plans`` on two fresh ranks; a rank that fails stops the trial."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rules = [p.mode for p in plans]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, cfg, rules, samples, caps, warmup, steps, cuda, queue))
             for r in range(2)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    while len(results) < 2:
        try:
            rank, value = queue.get(timeout=600)
        except Exception:
            break
        results[rank] = value
        if not value["ok"]:
            break  # the other rank waits in a collective
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    ranks = [results.get(r, {"ok": False, "error": "stopped after the other rank failed"}) for r in range(2)]
    ok = all(r["ok"] for r in ranks)
    return {"layers": cfg.layers, "parameters": gpt_parameters(cfg), "plan": rules, "samples": samples, "ok": ok,
            "estimate_gib": [p.needed / GIB for p in plans], "budget_gib": [p.budget / GIB for p in plans],
            "peak_gib": [r.get("peak_gib") for r in ranks], "errors": [r.get("error") for r in ranks],
            "step_s": ranks[0].get("step_s") if ok else None, "losses": ranks[0].get("losses"),
            "wall_s": time.perf_counter() - start}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps-gib", default="52,22")
    parser.add_argument("--layers", default="16,24,32,40,48", help="the depths the planner is asked about")
    parser.add_argument("--ratio-layers", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (the first allocates AdamW's state)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--plans", default="equal-keep,whole-rank,per-block")
    parser.add_argument("--cpu", action="store_true", help="a gloo dry run on CPU (no memory figures)")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT (with --cpu)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    cuda = not args.cpu and torch.cuda.is_available()
    caps = [float(c) for c in args.caps_gib.split(",")]
    grid = [int(x) for x in args.layers.split(",")]
    names = args.plans.split(",")
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()

    predicted: dict[str, dict[int, Optional[list[str]]]] = {}
    for name in names:
        predicted[name] = {}
        for layers in grid:
            plans = plan(name, config(layers, args.tiny), caps)
            predicted[name][layers] = None if plans is None else [p.mode for p in plans]

    trials: dict[tuple[str, int], dict[str, Any]] = {}

    def run(name: str, layers: int) -> dict[str, Any]:
        if (name, layers) not in trials:
            cfg = config(layers, args.tiny)
            plans = plan(name, cfg, caps)
            assert plans is not None
            trials[(name, layers)] = {"plan_name": name, **trial(cfg, plans, PLANS[name], caps, args.warmup, args.steps,
                                                                   cuda)}
            t = trials[(name, layers)]
            save()
            print(f"{name:<11} {layers:>3} layers ({t['parameters'] / 1e9:.2f}B): {'ok' if t['ok'] else 'FAILED'} "
                  f"plan {t['plan']} est {[round(x, 1) for x in t['estimate_gib']]} peak "
                  f"{[None if x is None else round(x, 1) for x in t['peak_gib']]} step {t['step_s']} "
                  f"({t['wall_s']:.0f} s) {[e for e in t['errors'] if e]}", flush=True)
        return trials[(name, layers)]

    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    tag = "cpu" if not cuda else "1gpu_shared"
    largest: dict[str, dict[str, Any]] = {}
    ratio: dict[str, Any] = {"layers": args.ratio_layers}

    def result() -> dict[str, Any]:
        return {"device": device, "torch": torch.__version__, "emulation": f"two ranks time-sharing one {device}, "
                f"memory caps {caps} GiB emulated (set_per_process_memory_fraction), gloo", "caps_gib": caps,
                "grid_layers": grid, "width": config(1, args.tiny).width, "seq": config(1, args.tiny).seq,
                "warmup": args.warmup, "steps": args.steps,
                "predicted": {n: {str(k): v for k, v in p.items()} for n, p in predicted.items()},
                "largest": largest, "ratio": ratio, "trials": list(trials.values()),
                "wall_s": time.perf_counter() - started}

    def save() -> None:
        # After every trial: a run cut short keeps what it measured.
        with open(os.path.join(args.out, f"fsdp_shared_{tag}.json"), "w") as f:
            json.dump(result(), f, indent=1)

    # The ratio first: both plans at one size, measured back to back in this run.
    if {"whole-rank", "per-block"} <= set(names):
        for name in ("whole-rank", "per-block"):
            ratio[name] = run(name, args.ratio_layers) if plan(name, config(args.ratio_layers, args.tiny),
                                                                  caps) else None
        times = [ratio[n]["step_s"] if ratio[n] else None for n in ("whole-rank", "per-block")]
        ratio["whole_over_per_block"] = times[0] / times[1] if all(times) else None
    for name in names:
        fitting = [layers for layers in grid if predicted[name][layers] is not None]
        confirmed = None
        for layers in reversed(fitting[-2:]):  # the planned largest; one size down if it runs out of memory
            if run(name, layers)["ok"]:
                confirmed = layers
                break
        largest[name] = {"planned_layers": fitting[-1] if fitting else None, "trained_layers": confirmed,
                         "parameters": gpt_parameters(config(confirmed, args.tiny)) if confirmed else 0,
                         "grid_top": fitting[-1:] == grid[-1:]}
        save()
    final = result()
    plot(final, os.path.join(args.out, f"fsdp_shared_{tag}.png"))
    print(summary(final))


def summary(result: dict[str, Any]) -> str:
    lines = [result["emulation"], f"{'plan':<11} {'planned':>8} {'trained':>8} {'params':>8}"]
    for name, r in result["largest"].items():
        top = " (largest tried)" if r["grid_top"] and r["trained_layers"] == r["planned_layers"] else ""
        lines.append(f"{name:<11} {str(r['planned_layers']):>8} {str(r['trained_layers']):>8} "
                     f"{r['parameters'] / 1e9:>7.2f}B{top}")
    ratio = result["ratio"]
    if ratio.get("whole_over_per_block"):
        lines.append(f"step time at {ratio['layers']} layers: whole-rank {ratio['whole-rank']['step_s']:.2f} s "
                     f"({ratio['whole-rank']['plan']}), per-block {ratio['per-block']['step_s']:.2f} s "
                     f"({ratio['per-block']['plan']}): ratio {ratio['whole_over_per_block']:.2f} (time-shared GPU)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(result["largest"])
    axes[0].bar(names, [result["largest"][n]["parameters"] / 1e9 for n in names], color="tab:green")
    axes[0].set_ylabel("largest GPT trained (B parameters)")
    axes[0].set_title(f"caps {result['caps_gib']} GiB (grid up to {max(result['grid_layers'])} layers)")
    ratio = result["ratio"]
    if ratio.get("whole_over_per_block"):
        plans = ["whole-rank", "per-block"]
        axes[1].bar(plans, [ratio[p]["step_s"] for p in plans], color=["tab:orange", "tab:blue"])
        axes[1].set_ylabel("step time, s (time-shared GPU)")
        axes[1].set_title(f"{ratio['layers']} layers: ratio {ratio['whole_over_per_block']:.2f}")
    fig.suptitle(result["emulation"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
