"""Periodic cross-host sync against exact sync: held-out loss after the same samples, for H in {1, 8, 32, 128}.

Two emulated hosts ("a": the fast rank, capacity 3; "b": capacity 1), one gloo rank each, a small GPT (2 layers, width
64, 32 tokens) with AdamW inside each host, on a synthetic bigram language (each token's successor is a fixed one 3
times in 4, else uniform: the best possible loss is known, ≈ 0.25·ln(V) + H(0.75)). Every configuration trains the
same ``--steps`` steps on the same global batches; rank 0's held-out loss is measured every ``--eval-every`` steps
(mid-period that is host a's own model; at multiples of H it is the combined one). ``--steps`` should be a multiple
of the largest H so that every run ends right after an outer step.

    python benchmarks/periodic_sync.py                          # CPU, ~ 10 minutes on 2 shared cores
    python benchmarks/periodic_sync.py --steps 64 --every 1,8   # a quick look
    python benchmarks/periodic_sync.py --every 8,32,128 --overlap   # the exchange overlapped with the next step

Writes ``periodic_sync.json`` and ``periodic_sync.png`` (``periodic_sync_overlap.*`` with ``--overlap``) to ``--out``
(default ``benchmarks/results``).
"""

import argparse
import json
import math
import os
import socket
import sys
import time
from typing import Any, Optional

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import GPT, GPTConfig  # noqa: E402
from plotting import pyplot  # noqa: E402

HOSTS = [{"host": "a"}, {"host": "b"}]
CAPACITIES = [3.0, 1.0]


def bigram_tokens(n: int, cfg: GPTConfig, seed: int) -> torch.Tensor:
    """``n`` sequences of ``cfg.seq + 1`` tokens from one fixed bigram language (the table does not depend on seed)."""
    table = torch.randint(0, cfg.vocab, (cfg.vocab,), generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (n,), generator=g)
    noise = torch.randint(0, cfg.vocab, (n, cfg.seq + 1), generator=g)
    keep = torch.rand(n, cfg.seq + 1, generator=g) < 0.75
    for t in range(1, cfg.seq + 1):
        tokens[:, t] = torch.where(keep[:, t], table[tokens[:, t - 1]], noise[:, t])
    return tokens


class Sequences(Dataset):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def _module_class() -> type:
    from lightning.pytorch import LightningModule

    class SmallGPT(LightningModule):
        def __init__(self, train_tokens: torch.Tensor, batch_size: int, lr: float) -> None:
            super().__init__()
            self.net = GPT(GPTConfig.tiny())
            self.train_tokens, self.batch_size, self.lr = train_tokens, batch_size, lr

        def loss(self, tokens: torch.Tensor) -> torch.Tensor:
            logits = self.net(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.loss(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Sequences(self.train_tokens), batch_size=self.batch_size, shuffle=True)

    return SmallGPT


def _eval_callback_class() -> type:
    from lightning.pytorch import Callback

    class HeldOut(Callback):
        """Rank 0's held-out loss every ``every`` optimizer steps (no collective: the other rank goes on)."""

        def __init__(self, tokens: torch.Tensor, every: int, out_file: str) -> None:
            self.tokens, self.every, self.out_file = tokens, every, out_file
            self.curve: list[tuple[int, float]] = []

        def _measure(self, trainer: Any, module: Any) -> None:
            if trainer.global_rank != 0:
                return
            with torch.no_grad():
                losses = [float(module.loss(chunk)) for chunk in self.tokens.split(256)]
            self.curve.append((trainer.global_step, sum(losses) / len(losses)))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._measure(trainer, pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step % self.every == 0:
                self._measure(trainer, pl_module)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank == 0:
                torch.save(self.curve, self.out_file)

    return HeldOut


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, periodic: Optional[Any], args: argparse.Namespace, train: torch.Tensor, held_out: torch.Tensor
        ) -> dict[str, Any]:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_hetero import HeteroDDPStrategy

    os.environ["MASTER_PORT"] = str(_free_port())
    seed_everything(0)
    module = _module_class()(train, args.batch_size, args.lr)
    curve_file = os.path.join(args.out, f".periodic_{name}.pt")
    strategy = HeteroDDPStrategy(capacities=CAPACITIES, emulate=HOSTS, periodic_sync=periodic, start_method="fork",
                                 observation={"print_table": False}, resilience={"timeout": 300})
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[_eval_callback_class()(held_out, args.eval_every, curve_file)])
    start = time.perf_counter()
    trainer.fit(module)
    wall = time.perf_counter() - start
    curve = torch.load(curve_file)
    os.remove(curve_file)
    params = sum(p.numel() for p in module.parameters())
    every = periodic.every if periodic is not None else 1
    return {
        "name": name, "every": periodic.every if periodic else None, "outer": periodic.outer if periodic else "exact",
        "outer_lr": periodic.outer_lr if periodic else None,
        "outer_momentum": periodic.outer_momentum if periodic else None,
        "overlap": periodic.overlap if periodic else False,
        "samples_per_step": args.batch_size * 2, "curve": curve, "final": curve[-1][1], "wall_s": round(wall, 1),
        # What the hosts' leaders send between hosts per optimizer step, fp32 (computed, not paced): the gradient
        # every step for exact sync, the parameter delta every H steps for periodic sync.
        "link_bytes_per_step": params * 4 / every,
    }


def table(rows: list[dict[str, Any]]) -> str:
    exact = next(r["final"] for r in rows if r["outer"] == "exact")
    lines = ["| sync | H | held-out loss | vs exact | link bytes / step (fp32) |", "|---|---|---|---|---|"]
    for r in rows:
        label = "exact" if r["outer"] == "exact" else (
            "average" if r["outer"] == "average" else f"nesterov ({r['outer_lr']:g}, {r['outer_momentum']:g})"
        ) + (", overlapped" if r["overlap"] else "")
        lines.append(f"| {label} | {r['every'] or 1} | {r['final']:.4f} | {100 * (r['final'] / exact - 1):+.1f} % | "
                     f"{r['link_bytes_per_step'] / 1e3:.1f} kB |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    exact = next(r for r in rows if r["outer"] == "exact")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, outer in zip(axes, ("average", "nesterov")):
        for r in [exact] + [r for r in rows if r["outer"] == outer]:
            samples = [step * r["samples_per_step"] for step, _ in r["curve"]]
            label = "exact sync" if r is exact else f"H={r['every']}" + (" overlapped" if r["overlap"] else "")
            ax.plot(samples, [loss for _, loss in r["curve"]], label=label, lw=2 if r is exact else 1.2,
                    color="black" if r is exact else None)
        ax.set_title(f"outer: {outer}")
        ax.set_xlabel("samples trained on (all hosts)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("held-out loss (rank 0)")
    fig.suptitle("Periodic cross-host sync vs exact sync: small GPT, 2 emulated hosts (capacity 3:1), CPU gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--every", default="1,8,32,128", help="comma-separated H values")
    parser.add_argument("--outers", default="average,nesterov")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank loader batch: global batch = 2x this")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--overlap", action="store_true", help="periodic configs overlap the exchange (one step late)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)  # two processes on a shared 2-core machine

    from lightning_hetero import PeriodicSync

    cfg = GPTConfig.tiny()
    train, held_out = bigram_tokens(args.steps * args.batch_size * 2, cfg, seed=0), bigram_tokens(1024, cfg, seed=1)
    configs: list[tuple[str, Optional[Any]]] = [("exact", None)]
    for outer in args.outers.split(","):
        for every in (int(h) for h in args.every.split(",")):
            name = f"{outer}_H{every}" + ("_overlap" if args.overlap else "")
            configs.append((name, PeriodicSync(every=every, outer=outer, outer_lr=args.outer_lr,
                                               outer_momentum=args.outer_momentum, overlap=args.overlap)))
    rows = []
    for name, periodic in configs:
        rows.append(run(name, periodic, args, train, held_out))
        print(f"{name}: held-out loss {rows[-1]['final']:.4f} ({rows[-1]['wall_s']} s)", flush=True)
    bigram_floor = 0.25 * math.log(cfg.vocab) - (0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    print(table(rows))
    print(f"(best possible loss of the language ≈ {bigram_floor:.3f})")
    stem = "periodic_sync_overlap" if args.overlap else "periodic_sync"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump({"steps": args.steps, "args": vars(args), "torch": torch.__version__, "hosts": HOSTS,
                   "capacities": CAPACITIES, "bigram_floor": bigram_floor, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(args.out, f"{stem}.png"))
    return rows


if __name__ == "__main__":
    main()
