"""Gradient compression on 2 ranks: loss curves, held-out loss and step time of none / fp16 / powersgd / top-k.

A GPT (benchmarks/models.py) trains under ``HeteroDDPStrategy(compression=...)`` on synthetic, learnable token
streams for a few hundred steps; every method sees the same samples in the same order. At the end each replica is
scored on held-out sequences. Each link class runs in its own pair of processes, because NCCL reads its
environment when the process group is created:

* ``nvlink``: NCCL's defaults (peer-to-peer over NVLink);
* ``ethernet``: ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` (sockets through the host, ≈ 2.6 GB/s: a 25 GbE class).

A method is a name or a name with settings, e.g. ``topk:ratio=0.02,momentum=0.9`` or ``powersgd:rank=8``. With a
top-k ``momentum`` the hook owns the momentum (Deep Gradient Compression), so the optimizer's own is turned off for
that run: SGD momentum 0, AdamW beta1 0. Ratios are against ``none`` measured in the same processes; "steady" times
the last third of the steps (after PowerSGD's start and top-k's ratio warm-up). Usage::

    python benchmarks/compression_bench.py --out $OUT/compression --links ethernet --steps 300   # 2 GPUs, ≈ 5 min
    python benchmarks/compression_bench.py --accelerator cpu --size tiny --steps 300             # CPU, gloo
"""

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from typing import Any

# No NVLink multicast / NVLS on the lent machines; set before torch or NCCL read them.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in _NO_MULTICAST.items():
    os.environ.setdefault(_name, _value)

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LINKS = {"nvlink": {}, "ethernet": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}
DEFAULT_METHODS = ("none", "fp16", "powersgd", "topk", "topk:warmup_steps=100", "topk:warmup_steps=100,momentum=0.9",
                   "topk:warmup_steps=100,momentum=0.9,ratio=0.02")
SIZES = {
    "tiny": dict(vocab=256, seq=32, width=64, layers=2, heads=4),  # CPU: seconds per run
    "small": dict(vocab=2048, seq=64, width=256, layers=4, heads=4),  # ≈ 3.7M parameters
    "gpt": {},  # GPTConfig's default: ≈ 98M parameters
}


def compression_for(method: str) -> Any:
    """``"topk:ratio=0.02,momentum=0.9"`` -> ``TopKCompression(ratio=0.02, momentum=0.9)``; plain names stay names."""
    from lightning_hetero import CastCompression, PowerSGDCompression, TopKCompression

    name, _, settings = method.partition(":")
    if not settings:
        return name
    cls = {"powersgd": PowerSGDCompression, "topk": TopKCompression, "fp16": CastCompression,
           "bf16": CastCompression}[name]
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {"dtype": name} if cls is CastCompression else {}
    for item in settings.split(","):
        key, _, value = item.partition("=")
        kind = types[key]
        kwargs[key] = value.lower() in ("1", "true", "yes") if kind in (bool, "bool") else (
            int(value) if kind in (int, "int") else float(value) if kind in (float, "float") else value)
    return cls(**kwargs)


def token_streams(n: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Sequences that follow a fixed random successor table 90% of the time: a loss the model can lower quickly.
    The table is the same for every ``seed``, so other seeds give held-out sequences of the same language."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.empty(n, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
    noise = torch.rand(n, seq, generator=g) < 0.1
    random_next = torch.randint(vocab, (n, seq), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = torch.where(noise[:, t], random_next[:, t], successor[tokens[:, t]])
    return tokens


def worker(rank: int, world: int, port: int, args: argparse.Namespace, link: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning sees an external launch: one run per method
    os.environ.update(LINKS.get(link, {}))
    import lightning.pytorch as pl
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.models import GPT, GPTConfig
    from lightning_hetero import HeteroDDPStrategy, TopKCompression

    cfg = GPTConfig(**SIZES[args.size])
    cuda = args.accelerator == "cuda"
    precision = "bf16-mixed" if cuda else "32-true"

    def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))

    class LM(pl.LightningModule):
        def __init__(self, hook_momentum: bool) -> None:
            super().__init__()
            self.model = GPT(cfg)
            self.hook_momentum = hook_momentum

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.model, batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if args.optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.0 if self.hook_momentum else 0.9)
            betas = (0.0 if self.hook_momentum else 0.9, 0.95)
            return torch.optim.AdamW(self.parameters(), lr=args.lr, betas=betas, weight_decay=0.0)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.bytes: list[int] = []
            self._t = 0.0

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            self._t = self._now()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:
            self.times.append(self._now() - self._t)
            self.losses.append(float(outputs["loss"]))
            self.bytes.append(int(trainer.strategy.comm_bytes_last_step or 0))

    data = TensorDataset(token_streams(args.steps * args.batch * world, cfg.seq, cfg.vocab, seed=0))
    held_out = token_streams(args.eval_sequences, cfg.seq, cfg.vocab, seed=1)
    results = []
    for method in args.methods:
        pl.seed_everything(0)
        compression = compression_for(method)
        timer = Timer()
        strategy = HeteroDDPStrategy(capacities="equal", compression=compression,
                                     observation={"print_table": method == args.methods[0]},
                                     resilience={"timeout": 300})
        trainer = pl.Trainer(accelerator=args.accelerator, devices=world, strategy=strategy,
                             precision=precision, max_steps=args.steps, callbacks=[timer], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        hook_momentum = isinstance(compression, TopKCompression) and compression.momentum > 0
        module = LM(hook_momentum=hook_momentum and not args.keep_optimizer_momentum)
        trainer.fit(module, DataLoader(data, batch_size=args.batch, shuffle=True))
        warm = min(args.warmup, len(timer.times) - 1)
        # Per-step training loss averaged over the ranks (each saw its own samples).
        losses = strategy.reduce(torch.tensor(timer.losses, device=strategy.root_device), reduce_op="mean")
        module.to(strategy.root_device).eval()  # the strategy's teardown moved it to the host
        with torch.no_grad(), torch.autocast(strategy.root_device.type, torch.bfloat16, enabled=cuda):
            held = held_out.to(strategy.root_device)
            parts = [float(lm_loss(module.model, held[i:i + args.batch])) for i in range(0, len(held), args.batch)]
        window = min(args.loss_window, len(timer.losses))
        results.append({
            "link": link, "method": method, "config": repr(compression), "steps": len(timer.times),
            "step_s": sum(timer.times[warm:]) / len(timer.times[warm:]),
            # The last third: after PowerSGD's start and top-k's ratio warm-up, what a long run would see.
            "step_s_steady": sum(timer.times[-max(1, len(timer.times) // 3):]) / max(1, len(timer.times) // 3),
            "held_out_loss": sum(parts) / len(parts),
            "train_loss_tail": float(losses[-window:].mean()),
            "bytes_per_step": timer.bytes[-1],
            "loss_curve": [round(float(x), 5) for x in losses],
            "step_s_curve": [round(t, 6) for t in timer.times],
            "compression": str(strategy.lab.columns),
        })
        del trainer, strategy, module
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f, indent=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "./out"))
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=list(SIZES), default=None, help="model size (default: gpt; cpu: tiny)")
    parser.add_argument("--tiny", action="store_true", help="alias of --size tiny --steps 8 (CPU smoke test)")
    parser.add_argument("--links", nargs="+", choices=list(LINKS), default=["ethernet"],
                        help="link classes, each a run of every method (default: ethernet, where compression pays)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="none | fp16 | bf16 | powersgd | topk, optionally with settings: topk:ratio=0.02")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per method (default 300)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 16; tiny 8)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=None, help="default: adamw 6e-4 (tiny 3e-3), sgd 0.1")
    parser.add_argument("--keep-optimizer-momentum", action="store_true",
                        help="keep the optimizer's momentum with top-k momentum too (applied twice: for comparison)")
    parser.add_argument("--eval-sequences", type=int, default=128, help="held-out sequences scored at the end")
    args = parser.parse_args()
    if args.tiny:
        args.size, args.steps = args.size or "tiny", args.steps or 8
    args.size = args.size or ("gpt" if args.accelerator == "cuda" else "tiny")
    args.steps = args.steps or 300
    args.batch = args.batch or (8 if args.size == "tiny" else 16)
    args.lr = args.lr or (0.1 if args.optimizer == "sgd" else 3e-3 if args.size == "tiny" else 6e-4)
    args.warmup = min(10, args.steps // 4)  # steps left out of the time (CUDA warm-up, PowerSGD / top-k start)
    args.loss_window = max(1, min(20, args.steps // 10))
    if "none" not in args.methods:
        args.methods.insert(0, "none")
    for method in args.methods:
        compression_for(method)  # refuse a bad setting before any process starts
    if args.accelerator == "cuda" and torch.cuda.device_count() < 2:
        parser.error("needs 2 CUDA devices (use --accelerator cpu for a CPU run)")
    if args.accelerator == "cpu":
        args.links = ["gloo"]  # no NCCL on CPU: one gloo run
    os.makedirs(args.out, exist_ok=True)

    rows: list[dict] = []
    started = time.time()
    for link in args.links:
        path = os.path.join(args.out, f"compression_{link}.json")
        mp.start_processes(worker, args=(2, free_port(), args, link, path), nprocs=2, start_method="spawn")
        with open(path) as f:
            rows += json.load(f)
    for row in rows:
        base = next(r for r in rows if r["link"] == row["link"] and r["method"] == "none")
        row["time_vs_none"] = row["step_s"] / base["step_s"]
        row["speedup_vs_none"] = base["step_s"] / row["step_s"]
        row["steady_speedup_vs_none"] = base["step_s_steady"] / row["step_s_steady"]
        row["held_out_vs_none"] = row["held_out_loss"] / base["held_out_loss"]
        row["train_tail_vs_none"] = row["train_loss_tail"] / base["train_loss_tail"]
        row["bytes_vs_none"] = row["bytes_per_step"] / max(1, base["bytes_per_step"])
    summary = {"device": torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "cpu",
               "torch": torch.__version__, "size": args.size, "model": SIZES[args.size] or "GPTConfig()",
               "steps": args.steps, "batch_per_rank": args.batch, "optimizer": args.optimizer, "lr": args.lr,
               "nccl_env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")},
               "wall_s": time.time() - started, "rows": rows}
    with open(os.path.join(args.out, "compression_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(rows, os.path.join(args.out, "compression_bench.png"))

    print(f"\ncompression benchmark: {summary['device']}, {args.size} model, {args.steps} steps x {args.batch} "
          f"seq/rank, {args.optimizer} lr {args.lr:g}, {summary['wall_s']:.0f} s")
    header = ("link", "method", "ms/step", "speedup", "steady", "held-out", "x none", "train", "x none", "MB/step")
    print("{:<9} {:<34} {:>8} {:>7} {:>7} {:>8} {:>7} {:>7} {:>7} {:>8}".format(*header))
    for r in rows:
        print(f"{r['link']:<9} {r['method']:<34} {r['step_s'] * 1e3:8.1f} {r['speedup_vs_none']:7.2f} "
              f"{r['steady_speedup_vs_none']:7.2f} "
              f"{r['held_out_loss']:8.4f} {r['held_out_vs_none']:7.4f} {r['train_loss_tail']:7.4f} "
              f"{r['train_tail_vs_none']:7.4f} {r['bytes_per_step'] / 1e6:8.3f}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(2, len(links), figsize=(6 * len(links), 7), squeeze=False)
    for col, link in enumerate(links):
        sel = [r for r in rows if r["link"] == link]
        ax = axes[0][col]
        for r in sel:
            curve = torch.tensor(r["loss_curve"])
            width = max(1, len(curve) // 30)  # moving average: per-step losses are noisy
            smooth = curve.unfold(0, width, 1).mean(1) if len(curve) >= width else curve
            ax.plot(range(width, width + len(smooth)), smooth.tolist(), label=f"{r['method']} "
                    f"({r['held_out_loss']:.3f})")
        ax.set_title(f"{link}: training loss (held-out at the end)")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ax.bar(range(len(sel)), [r["step_s"] * 1e3 for r in sel])
        ax.set_xticks(range(len(sel)), [r["method"] for r in sel], rotation=20, ha="right", fontsize=7)
        for i, r in enumerate(sel):
            ax.annotate(f"{r['speedup_vs_none']:.2f}x", (i, r["step_s"] * 1e3), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("ms / step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
