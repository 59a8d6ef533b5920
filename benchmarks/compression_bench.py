"""Gradient compression on 2 GPUs: step time and final loss of none / fp16 / powersgd / topk, per link class.

A ≈ 98M-parameter GPT (benchmarks/models.py) trains with bf16 autocast under ``HeteroDDPStrategy(compression=...)``
on synthetic, learnable token streams. Each link class runs in its own pair of processes, because NCCL reads its
environment when the process group is created:

* ``nvlink``: NCCL's defaults (peer-to-peer over NVLink);
* ``ethernet``: ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` (sockets through the host, like two boxes on a LAN).

Ratios are against ``none`` measured in the same processes. Usage::

    python benchmarks/compression_bench.py --out $OUT/compression        # 2 GPUs, both link classes
    python benchmarks/compression_bench.py --tiny --accelerator cpu       # a quick end-to-end check on CPU
"""

import argparse
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
METHODS = ("none", "fp16", "powersgd", "topk")


def compression_for(name: str, steps: int) -> Any:
    from lightning_hetero import PowerSGDCompression, TopKCompression

    if name == "powersgd":
        return PowerSGDCompression(rank=4, start_iter=max(2, steps // 5))
    if name == "topk":
        return TopKCompression(ratio=0.01, warmup_steps=max(1, steps // 5), warmup_ratio=0.25)
    return name


def token_streams(n: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Sequences that follow a fixed random successor table 90% of the time: a loss the model can lower quickly."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
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
    os.environ.update(LINKS[link])
    import lightning.pytorch as pl
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.models import GPT, GPTConfig
    from lightning_hetero import HeteroDDPStrategy

    cfg = GPTConfig.tiny() if args.tiny else GPTConfig()
    cuda = args.accelerator == "cuda"

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.0)

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

    data = TensorDataset(token_streams(args.steps * args.batch * world, cfg.seq, cfg.vocab))
    results = []
    for method in args.methods:
        pl.seed_everything(0)
        timer = Timer()
        strategy = HeteroDDPStrategy(capacities="equal", compression=compression_for(method, args.steps),
                                     print_table=(method == args.methods[0]), timeout=300)
        trainer = pl.Trainer(accelerator=args.accelerator, devices=world, strategy=strategy,
                             precision="bf16-mixed", max_steps=args.steps, callbacks=[timer], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LM(), DataLoader(data, batch_size=args.batch, shuffle=True))
        warm = min(args.warmup, len(timer.times) - 1)
        # The mean loss of the last steps, averaged over the ranks (each saw its own samples).
        tail = torch.tensor(sum(timer.losses[-args.loss_window:]) / args.loss_window, device=strategy.root_device)
        loss = float(strategy.reduce(tail, reduce_op="mean"))
        results.append({
            "link": link, "method": method, "steps": len(timer.times),
            "step_s": sum(timer.times[warm:]) / len(timer.times[warm:]),
            "final_loss": loss, "bytes_per_step": timer.bytes[-1],
            "compression": str(strategy.lab.columns),
        })
        del trainer, strategy
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
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and a few steps (CPU smoke test)")
    parser.add_argument("--links", nargs="+", choices=list(LINKS), default=list(LINKS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per method (default 60; tiny 8)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per GPU per step (default 16; tiny 4)")
    parser.add_argument("--lr", type=float, default=6e-4)
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.tiny else 60)
    args.batch = args.batch or (4 if args.tiny else 16)
    args.warmup = 2 if args.tiny else 10  # steps left out of the time (CUDA warm-up, PowerSGD / top-k start)
    args.loss_window = 2 if args.tiny else 10
    if args.accelerator == "cuda" and torch.cuda.device_count() < 2:
        parser.error("needs 2 CUDA devices (use --accelerator cpu --tiny for a CPU check)")
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
        row["loss_vs_none"] = row["final_loss"] / base["final_loss"]
        row["bytes_vs_none"] = row["bytes_per_step"] / max(1, base["bytes_per_step"])
    summary = {"device": torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "cpu",
               "torch": torch.__version__, "tiny": args.tiny, "steps": args.steps, "batch_per_gpu": args.batch,
               "wall_s": time.time() - started, "rows": rows}
    with open(os.path.join(args.out, "compression_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(rows, os.path.join(args.out, "compression_bench.png"))

    print(f"\ncompression benchmark: {summary['device']}, {args.steps} steps x {args.batch} seq/GPU, "
          f"{summary['wall_s']:.0f} s")
    header = ("link", "method", "ms/step", "x none", "loss", "x none", "MB/step", "x none")
    print("{:<9} {:<9} {:>8} {:>7} {:>7} {:>7} {:>8} {:>7}".format(*header))
    for r in rows:
        print(f"{r['link']:<9} {r['method']:<9} {r['step_s'] * 1e3:8.1f} {r['time_vs_none']:7.2f} "
              f"{r['final_loss']:7.3f} {r['loss_vs_none']:7.3f} {r['bytes_per_step'] / 1e6:8.2f} "
              f"{r['bytes_vs_none']:7.3f}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 3.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        sel = [r for r in rows if r["link"] == link]
        ax.bar([r["method"] for r in sel], [r["step_s"] * 1e3 for r in sel])
        for i, r in enumerate(sel):
            ax.annotate(f"loss {r['final_loss']:.2f}", (i, r["step_s"] * 1e3), ha="center", va="bottom", fontsize=8)
        ax.set_title(link)
        ax.set_ylabel("ms / step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
