"""Step-time balance on a length-skewed dataset: splitting each global batch by sample count vs by tokens.

A small Transformer (token-mean loss, padding masked) trains on sequences whose lengths have a long tail: 75 % short,
25 % up to 8x longer. Every rank gets the same capacity, so with ``balance="samples"`` each rank trains on the same
number of sequences but a random number of tokens, and the step waits for the rank that drew the long ones; with
``balance="tokens"`` each rank's tokens match its capacity; ``"padded_tokens"`` balances sequences times the
longest sequence, which is what the padded batch computes. All use ``loss_denominator="tokens"`` (exact for a
token-mean loss). Optional ``tokens+micro``: token balance with micro-batches of at most ``--micro`` sequences.

Per configuration, per rank and step: compute seconds (``training_step`` start to the end of the local backward, the
strategy's own ``StepTimer``: on CUDA with events), real and padded tokens; and the step's wall time. Printed: mean
step ms, mean imbalance (slowest rank's compute / mean rank's compute, 1.0 = perfect), mean idle fraction of the
ranks (waiting for the slowest), tokens per rank. JSON goes to ``--out``/token_balance.json.

    python benchmarks/token_balance.py --accelerator cpu                      # 2 CPU processes (gloo), small model
    python benchmarks/token_balance.py --accelerator gpu --devices 2 --out $OUT  # 2 GPUs (NCCL), larger model
"""

import argparse
import json
import os
import random
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Optional

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plotting import pyplot  # noqa: E402

CONFIGS = ("samples", "tokens", "padded_tokens", "tokens+micro")
_TIMEOUT_S = 600


class SkewedSequences(Dataset):
    """Token-id sequences: 75 % of lengths in [short, 2*short), 25 % in [long/2, long]. ``lengths`` is public."""

    def __init__(self, n: int, short: int, long: int, vocab: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.lengths = [rng.randrange(short, 2 * short) if rng.random() < 0.75 else rng.randint(long // 2, long)
                        for _ in range(n)]
        self.vocab, self.seed = vocab, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab, (self.lengths[i],), generator=g)


def pad_collate(samples: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-1)


def _module_class() -> type:
    from lightning.pytorch import LightningModule

    class TinyLM(LightningModule):
        """Embedding, a few Transformer layers (padding masked), next-token loss averaged over real tokens."""

        def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            pad = batch < 0
            causal = nn.Transformer.generate_square_subsequent_mask(batch.shape[1], device=batch.device)
            h = self.body(self.embed(batch.clamp_min(0)), mask=causal, src_key_padding_mask=pad, is_causal=True)
            logits = self.head(h[:, :-1])
            target = batch[:, 1:].masked_fill(pad[:, 1:], -100)
            return nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100)

        def sample_cost(self, sample: torch.Tensor) -> float:
            return float(len(sample) - 1)  # the tokens the loss averages over

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return TinyLM


def _recorder_class() -> type:
    from lightning.pytorch import Callback

    from lightning_hetero.plan.rebalance import StepTimer

    class Recorder(Callback):
        """Per step: this rank's compute seconds, real and padded tokens, and the synchronized wall time."""

        def __init__(self, warmup: int) -> None:
            self.warmup, self.rows, self.timer, self.t0 = warmup, [], None, 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.timer = StepTimer(pl_module.device)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self.timer.watch(loss)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self.t0 = time.perf_counter()
            self.timer.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            compute = self.timer.stop()
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            wall = time.perf_counter() - self.t0
            if batch_idx >= self.warmup:
                self.rows.append({"compute_s": compute, "wall_s": wall, "tokens": int((batch >= 0).sum()),
                                  "padded": int(batch.numel()), "samples": int(batch.shape[0])})

    return Recorder


def run_config(config: str, args: argparse.Namespace, world: int, rank: int) -> dict[str, Any]:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_hetero import HeteroDDPStrategy

    seed_everything(0, workers=False, verbose=False)
    module = _module_class()(args.vocab, args.width, args.layers, args.heads)
    micro = args.micro if config.endswith("micro") else None
    strategy = HeteroDDPStrategy(capacities="equal",
                                 data={"balance": config.split("+")[0], "loss_denominator": "tokens",
                                       "micro_batch": micro},
                                 observation={"print_table": False}, resilience={"timeout": _TIMEOUT_S})
    recorder = _recorder_class()(args.warmup)
    n = args.batch * world * (args.warmup + args.steps)
    dataset = SkewedSequences(n, args.short, args.long, args.vocab)
    trainer = Trainer(accelerator=args.accelerator, devices=world, strategy=strategy, max_epochs=1,
                      precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch, shuffle=True, collate_fn=pad_collate))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, recorder.rows)
    steps = min(len(r) for r in gathered)
    compute = [[gathered[r][s]["compute_s"] for r in range(world)] for s in range(steps)]
    imbalance = [max(c) / (sum(c) / world) for c in compute]
    idle = [1 - (sum(c) / world) / max(c) for c in compute]
    return {
        "config": config, "steps": steps,
        "step_ms": 1000 * sum(gathered[0][s]["wall_s"] for s in range(steps)) / steps,
        "imbalance": sum(imbalance) / steps, "idle": sum(idle) / steps,
        "compute_ms_per_rank": [1000 * sum(c[r] for c in compute) / steps for r in range(world)],
        "tokens_per_rank": [sum(g["tokens"] for g in gathered[r][:steps]) / steps for r in range(world)],
        "padded_per_rank": [sum(g["padded"] for g in gathered[r][:steps]) / steps for r in range(world)],
        "samples_per_rank": [sum(g["samples"] for g in gathered[r][:steps]) / steps for r in range(world)],
    }


def worker(rank: int, world: int, args: argparse.Namespace, port: int, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    cuda = args.accelerator != "cpu"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=_TIMEOUT_S), device_id=device if cuda else None)
    rows = []
    for config in args.configs:
        row = run_config(config, args, world, rank)
        row.update(accelerator=args.accelerator, device=torch.cuda.get_device_name(device) if cuda else "cpu",
                   world=world, batch_per_rank=args.batch, short=args.short, long=args.long)
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no results"
    title = f"token balance, {rows[0]['world']} ranks on {rows[0]['device']} ({rows[0]['accelerator'].upper()} numbers)"
    lines = [title, "| config | step ms | imbalance (max/mean compute) | idle | compute ms per rank | tokens per rank "
             "| padded per rank | samples per rank |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda xs, p=0: "[" + ", ".join(f"{x:.{p}f}" for x in xs) + "]"  # noqa: E731
        lines.append(f"| {r['config']} | {r['step_ms']:.1f} | {r['imbalance']:.3f} | {r['idle']:.1%} | "
                     f"{fmt(r['compute_ms_per_rank'], 1)} | {fmt(r['tokens_per_rank'])} | "
                     f"{fmt(r['padded_per_rank'])} | {fmt(r['samples_per_rank'], 1)} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu", choices=["cpu", "gpu"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 12 CPU, 40 GPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (DDP's meaning; default 8 CPU, 16 GPU)")
    p.add_argument("--micro", type=int, default=4, help="micro-batch limit of the tokens+micro configuration")
    p.add_argument("--precision", default=None)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    if any(c not in CONFIGS for c in args.configs):
        p.error(f"--configs: choose from {CONFIGS}")
    gpu = args.accelerator == "gpu"
    args.steps = args.steps or (40 if gpu else 12)
    args.batch = args.batch or (16 if gpu else 8)
    args.precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    # CPU: a model that takes tens of ms a step; GPU: big enough that compute, not launch overhead, dominates.
    args.short, args.long = (64, 1024) if gpu else (8, 64)
    args.vocab, args.width, args.layers, args.heads = (8192, 512, 6, 8) if gpu else (256, 64, 2, 4)
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, "token_balance.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.devices, args, port, out_file), nprocs=args.devices, join=True)
    with open(out_file) as f:
        rows = json.load(f)
    png = plot(rows, os.path.join(args.out, "token_balance.png"))
    print(f"[token_balance] wrote {out_file}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    print(table(rows), flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> Optional[str]:
    """Per configuration: each rank's mean compute ms (bars) and the step's wall ms (line)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    world = len(rows[0]["compute_ms_per_rank"]) if rows else 0
    width = 0.8 / max(world, 1)
    for r in range(world):
        ax.bar([i + (r - (world - 1) / 2) * width for i in range(len(rows))], [row["compute_ms_per_rank"][r] for row in rows],
               width, label=f"rank {r} compute")
    ax.plot(range(len(rows)), [row["step_ms"] for row in rows], "ko-", label="step (wall)")
    ax.set_xticks(range(len(rows)), [row["config"] for row in rows])
    ax.set_ylabel("ms per step")
    ax.set_title(f"length-skewed batches, {world} ranks on {rows[0].get('device', '?')}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    main()
