"""A lab over two emulated hosts on one machine: a fast server and a slow workstation joined by 10 / 25 GbE.

The hosts are emulated (:mod:`lightning_hetero.lab.emulation`): each rank reports its emulated host name and NCCL gets
``NCCL_HOSTID`` (NVLink / P2P inside a host, NCCL's socket transport between hosts), the workstation's GPU is capped
to a 3090-class share of the SMs (on CPU: a sleep-based slowdown), and the exchange between hosts is *paced* to the
link's bandwidth (the bytes really cross at the machine's speed; the step is held until the emulated link would have
delivered them, overlapping the backward pass as a real link does).

Configurations, for each link and model, on the same processes (one per device, spawned once):

- ``solo``: each emulated device alone (ideal throughput = Σ solo rates);
- ``ddp``: Lightning's ``DDPStrategy`` (equal batches, full-precision all-reduce over the paced link);
- ``flat``: ``HeteroDDPStrategy(capacities="auto", compression="none")``: capacity split, flat fp32 all-reduce;
- ``auto``: ``HeteroDDPStrategy(capacities="auto", compression="auto")``: capacity split, hierarchical sync with
  the method chosen from the measured link.
- ``periodic``: ``HeteroDDPStrategy(capacities="auto", periodic_sync=PeriodicSync(every=--every, outer="average"))``:
  exact sync inside each host every step, the hosts' parameters averaged (sample-weighted) every H steps over the
  paced link. ``--steps`` is rounded up so that the run ends right after an outer step.

After each fit every configuration's **held-out loss** (GPT: 64 unseen sequences of the same bigram language, rank
0's model) is measured; the table's ``held-out vs ddp`` compares it with Lightning DDP's after the same samples.
Every rank's steps are checked to run under its emulation (the capped stream on GPUs, a slowdown slept on CPU):
the ``emulated`` column.

Every configuration trains ``--warmup`` + ``--steps`` steps on the same data (a fixed pool of learnable synthetic
samples: a bigram language for GPT, labelled images for ResNet-50) and records the global training loss of every
step (the batch-size weighted mean over ranks); samples/s is timed over the last ``--steps`` steps. A configuration
that exceeds ``--time-limit`` seconds stops early (all ranks agree) and is timed over the steps it ran.

    python benchmarks/bench_hosts.py --quick                         # 2 GPUs: 1 + 1, 10 and 25 GbE, GPT + ResNet-50
    python benchmarks/bench_hosts.py --layout 2+2                    # 4 GPUs: two per host
    python benchmarks/bench_hosts.py --tiny --accelerator cpu        # CPU smoke run (gloo, 2 hosts x 2 ranks)
    python benchmarks/bench_hosts.py --layout 2+2 --models gpt --links 10gbe --configs solo,ddp,periodic --every 8

Writes ``bench_hosts.json`` and ``bench_hosts.png`` (throughput and loss curves) to ``--out`` (default ``$OUT``).
"""

import argparse
import json
import signal
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lab import (  # noqa: E402
    Indices,
    _commit,
    _emulated_ddp_class,
    _free_port,
    _lightning_module_class,
    _sync,
    capped,
    format_detail,
    format_table,
    keep_row,
    collect_ranks,
    solo_rate,
    stop_on_sigterm,
    rank_device,
)

LINKS = {"10gbe": 10.0, "25gbe": 25.0}
# (host of each rank, SM share / speed of each rank): the workstation's card is a quarter of the server's.
LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[float, ...]]] = {
    "1+1": (("server", "ws"), (1.0, 0.25)),
    "2+2": (("server", "server", "ws", "ws"), (1.0, 1.0, 0.25, 0.25)),
    "2+1": (("server", "server", "ws"), (1.0, 1.0, 0.25)),
}
CONFIGS = ("solo", "ddp", "flat", "auto")
EXTRA_CONFIGS = ("periodic",)  # not run by default
HELD_OUT = 64  # sequences (GPT) of the held-out pool
_TIMEOUT_S = 300


def emulate_specs(layout: str, gbit: float, accelerator: str) -> list[dict[str, Any]]:
    hosts, shares = LAYOUTS[layout]
    specs: list[dict[str, Any]] = []
    for host, share in zip(hosts, shares):
        spec: dict[str, Any] = {"host": host, "link": "ethernet", "inter_host_gbit": gbit}
        if share < 1.0:
            if accelerator == "cpu":
                spec.update(slowdown=1.0 / share, name=f"CPU at {share:.0%}")
            else:
                spec.update(sm_share=share, memory_gib=24, name="RTX 3090-class slice")
        specs.append(spec)
    return specs


# -- workload: bench_lab's, on a fixed pool of learnable samples --------------------------------------------------------
def _workload_class() -> type:
    Base = _lightning_module_class()

    class PoolWorkload(Base):
        """bench_lab's workload, but batch indices select samples from a pool (so the loss curve means something)."""

        pool_size = 512

        def inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            raise RuntimeError("use pool_inputs")

        def _make_pool(self, held_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator(device=self.device).manual_seed(1234)
            p = HELD_OUT if held_out else self.pool_size
            if self.kind == "resnet50":
                x = torch.randn(p, 3, self.pixels, self.pixels, device=self.device, generator=g)
                if self.device.type == "cuda":
                    x = x.contiguous(memory_format=torch.channels_last)
                return x, torch.randint(0, self.classes, (p,), device=self.device, generator=g)
            # A bigram language: each token's successor is a fixed one 3 times in 4, else uniform.
            seq, vocab = self.net.cfg.seq + 1, self.classes
            table = torch.randint(0, vocab, (vocab,), device=self.device, generator=g)
            if held_out:  # the same language (table), other sentences
                g = torch.Generator(device=self.device).manual_seed(4321)
            tokens = torch.empty(p, seq, dtype=torch.long, device=self.device)
            tokens[:, 0] = torch.randint(0, vocab, (p,), device=self.device, generator=g)
            noise = torch.randint(0, vocab, (p, seq), device=self.device, generator=g)
            keep = torch.rand(p, seq, device=self.device, generator=g) < 0.75
            for t in range(1, seq):
                tokens[:, t] = torch.where(keep[:, t], table[tokens[:, t - 1]], noise[:, t])
            return tokens, tokens

        @torch.no_grad()
        def held_out_loss(self, batch: int, autocast: bool) -> Optional[float]:
            """The mean loss of this rank's model on the held-out pool (GPT: unseen sequences of the language)."""
            if self.kind != "gpt":
                return None  # ResNet-50's pool is random labels: nothing to generalise to
            tokens, _ = self._make_pool(held_out=True)
            was_training = self.net.training
            self.net.eval()
            total = 0.0
            for i in range(0, len(tokens), batch):
                x = tokens[i:i + batch]
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    logits = self.net(x[:, :-1])
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1),
                                               reduction="sum"))
            self.net.train(was_training)
            return total / (len(tokens) * (tokens.shape[1] - 1))

        def loss(self, batch: torch.Tensor) -> torch.Tensor:
            if self.device.type == "cuda":
                self.streams.add(torch.cuda.current_stream(self.device).cuda_stream)
            pool = getattr(self, "_pool", None)
            if pool is None or pool[0].device != self.device:
                pool = self._pool = self._make_pool()
            idx = batch.to(self.device) % self.pool_size
            x, y = pool[0][idx], pool[1][idx]
            if self.kind == "resnet50":
                return F.cross_entropy(self.net(x), y)
            logits = self.net(x[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y[:, 1:].reshape(-1))

    return PoolWorkload


def held_out_loss(module: Any, device: torch.device, batch: int, autocast: bool) -> Optional[float]:
    """The module's held-out loss on ``device`` (Lightning's teardown moved it to the CPU), then back where it was."""
    module.to(device)
    try:
        return module.held_out_loss(batch, autocast)
    finally:
        module.cpu()


def _recorder_class() -> type:
    from lightning.pytorch import Callback

    class HostBench(Callback):
        """Timed steps, the global loss of every step, and a time limit the ranks agree on."""

        def __init__(self, warmup: int, steps: int, limit_s: float) -> None:
            self.warmup, self.steps, self.limit_s = warmup, steps, limit_s
            self.losses: list[tuple[torch.Tensor, int]] = []
            self.start = self.t0 = self.t1 = 0.0
            self.timed_steps = 0
            self.global_losses: list[float] = []
            self.stopped_early = False

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == self.warmup:
                _sync(pl_module.device)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append((outputs["loss"].detach(), len(batch)))
            last = batch_idx == self.warmup + self.steps - 1
            if not last and batch_idx % 5 == 4:
                over = torch.tensor([float(time.perf_counter() - self.start > self.limit_s)], device=pl_module.device)
                dist.all_reduce(over, op=dist.ReduceOp.MAX)
                if over.item() > 0:
                    trainer.should_stop = self.stopped_early = True
                    last = True
            if last:
                _sync(pl_module.device)
                self.t1 = time.perf_counter()
                self.timed_steps = max(0, batch_idx + 1 - self.warmup)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            local = [(float(loss) * n, n) for loss, n in self.losses]
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            steps = min(len(g) for g in gathered)
            self.global_losses = [sum(g[i][0] for g in gathered) / sum(g[i][1] for g in gathered) for i in range(steps)]

    return HostBench


def _paced_ddp_class() -> type:
    """Lightning's DDPStrategy under the bench's emulation, its all-reduce over the paced link (any device type)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from lightning_hetero.lab.link_pacing import LinkPacer, PacedState, paced_hook

    class PacedDDP(_emulated_ddp_class()):
        gbit: float = 10.0

        def _register_ddp_hooks(self) -> None:
            # torch's averaging all-reduce (what DDP does without a hook), then the link's pacing.
            pacer = LinkPacer(self.gbit, self.world_size, self.root_device)
            self.model.register_comm_hook(PacedState(allreduce_hook, None, pacer), paced_hook)

    return PacedDDP


def run_fit(config: str, module: Any, args: argparse.Namespace, world: int, specs: Any, emulator: Any,
            gbit: float) -> dict[str, Any]:
    from lightning.pytorch import Trainer

    from lightning_hetero import HeteroDDPStrategy

    from lightning_hetero import PeriodicSync

    slept_before = emulator.slept_seconds if emulator is not None else 0.0
    if config == "ddp":
        strategy = _paced_ddp_class()(timeout=timedelta(seconds=_TIMEOUT_S))
        strategy.emulator, strategy.gbit = emulator, gbit
    else:
        periodic = PeriodicSync(every=args.every, outer="average") if config == "periodic" else None
        strategy = HeteroDDPStrategy(capacities=args.capacities, emulate=specs,
                                     observation={"print_table": config == "auto"},
                                     resilience={"timeout": _TIMEOUT_S},
                                     compression="auto" if config == "auto" else "none", periodic_sync=periodic)
    recorder = _recorder_class()(args.warmup, args.steps, args.time_limit)
    batch = args.batch[module.kind]
    trainer = Trainer(accelerator=args.accelerator, devices=world, strategy=strategy, precision=args.precision,
                      max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[recorder])
    module.prepare(args.accelerator == "gpu")
    n = batch * world * (args.warmup + args.steps + 1)
    trainer.fit(module, train_dataloaders=DataLoader(Indices(n), batch_size=batch, shuffle=False))
    seconds = recorder.t1 - recorder.t0
    row: dict[str, Any] = {
        "samples_per_s": batch * world * recorder.timed_steps / seconds if recorder.timed_steps and seconds > 0
        else None,
        "step_s": seconds / recorder.timed_steps if recorder.timed_steps else None,
        "timed_steps": recorder.timed_steps,
        "stopped_early": recorder.stopped_early,
        "losses": recorder.global_losses,
        "wall_s": time.perf_counter() - recorder.start,
        "held_out_loss": held_out_loss(module, strategy.root_device, batch, args.accelerator == "gpu"),
        "capped_local": capped(module, emulator if config == "ddp" else strategy.emulation, slept_before),
    }
    if config != "ddp":
        lab, plan = strategy.lab, strategy.plan
        columns = dict(lab.columns)
        row.update(capacity_source=plan.source, capacities=[round(c, 4) for c in plan.capacities],
                   split=list(plan.split), hosts={k: list(v) for k, v in lab.hosts.items()},
                   compression=columns.get("compression"), links=columns.get("link (measured)"))
        pacer = getattr(getattr(strategy.compression, "state", None), "pacer", None) if strategy.compression else None
        pacer = pacer or getattr(getattr(strategy.weighting, "inner_state", None), "pacer", None)
        if pacer is not None:
            row["paced_s"] = pacer.slept_s
    else:
        row.update(split=[batch] * world)
    return row


def worker(local_rank: int, args: argparse.Namespace, port: int, out_file: str) -> None:
    from lightning.pytorch import seed_everything

    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    world = len(LAYOUTS[args.layout][0])
    device = rank_device(local_rank, world, port, args.accelerator, threads=1)
    cuda = device.type == "cuda"
    # The bench process's own emulation (hosts, NCCL_HOSTID, SM cap) for the solo loop and the DDP baseline; the
    # link's bandwidth only paces, so one process group serves both links.
    base = parse_emulate(emulate_specs(args.layout, LINKS[args.links[0]], args.accelerator))
    emulator = start_emulation(base, local_rank, world, describe_device(device, local_rank), device)
    emulator.activate()
    dist.init_process_group("nccl" if cuda else "gloo", rank=local_rank, world_size=world,
                            timeout=timedelta(seconds=_TIMEOUT_S), device_id=device if cuda else None)
    Workload = _workload_class()
    rows: list[dict[str, Any]] = []
    solos: dict[str, list[float]] = {}
    for kind in args.models:
        for link in args.links:
            specs = emulate_specs(args.layout, LINKS[link], args.accelerator)
            for config in args.configs:
                seed_everything(0, workers=False, verbose=False)
                module = Workload(kind, args.tiny, args.seq)
                started = time.perf_counter()
                try:
                    if config == "solo":
                        if kind not in solos:  # no link involved: measured once per model
                            rate = solo_rate(module, args.batch[kind], args.steps, args.warmup, device, emulator,
                                             args.precision)
                            gathered: list[Any] = [None] * world
                            dist.all_gather_object(gathered, rate)
                            solos[kind] = [float(r) for r in gathered]
                        row: dict[str, Any] = {"samples_per_s": sum(solos[kind]), "solo_per_rank": solos[kind]}
                        if len(solos[kind]) == world:  # measured now: the emulation check of this loop
                            row["capped_local"] = capped(module, emulator, 0.0)
                    else:
                        row = run_fit(config, module, args, world, specs, emulator, LINKS[link])
                except Exception as err:  # an error on every rank (e.g. out of memory): report it, go on
                    row = {"error": f"{type(err).__name__}: {err}"[:400]}
                    print(f"[bench_hosts] rank {local_rank} {kind}/{link}/{config}: {row['error']}", flush=True)
                # Every rank's emulation check (rank 0's held-out loss is its model's; the others' are in the JSON).
                checks: list[Any] = [None] * world
                dist.all_gather_object(checks, [row.pop("capped_local", None), row.get("held_out_loss")])
                row["capped"] = [c[0] for c in checks]
                if row.get("held_out_loss") is not None:
                    row["held_out_per_rank"] = [c[1] for c in checks]
                row.update(model=kind, link=link, config=config, layout=args.layout,
                           config_s=time.perf_counter() - started)
                del module
                keep_row(rows, row, out_file, local_rank == 0, cuda,
                         f"[bench_hosts] {kind}/{link}/{config}: {row.get('samples_per_s')} samples/s "
                         f"({row['config_s']:.0f} s)")
    dist.destroy_process_group()


# -- driver -------------------------------------------------------------------------------------------------------------
def finish(rows: list[dict[str, Any]]) -> None:
    """Fraction of ideal (Σ solo), ratio to DDP, final-loss gap to the uncompressed runs."""
    for row in rows:
        same = [r for r in rows if r["model"] == row["model"] and r["link"] == row["link"]]
        get = {r["config"]: r for r in same}
        value = row.get("samples_per_s")
        ideal = get.get("solo", {}).get("samples_per_s")
        ddp = get.get("ddp", {}).get("samples_per_s")
        row["fraction_of_ideal"] = value / ideal if ideal and value else None
        row["ratio_to_ddp"] = value / ddp if ddp and value else None
        held, held_ddp = row.get("held_out_loss"), get.get("ddp", {}).get("held_out_loss")
        row["held_out_vs_ddp"] = held / held_ddp - 1 if held is not None and held_ddp else None
        losses, flat = row.get("losses"), get.get("flat", {}).get("losses")
        if losses and flat:
            n = min(len(losses), len(flat))
            k = max(1, n // 10)  # mean over the last tenth of the common steps: one step's loss is noisy
            ours, ref = sum(losses[n - k:n]) / k, sum(flat[n - k:n]) / k
            row["final_loss"], row["final_loss_flat"] = ours, ref
            row["final_loss_vs_flat"] = ours / ref - 1 if ref else None
            row["loss_compared_steps"] = n


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["model", "link", "config", "samples/s", "/ideal", "/ddp", "step ms", "steps", "final loss",
               "vs flat", "held-out", "vs ddp", "emulated", "compression / split"]
    lines = []
    for r in rows:
        comp = r.get("compression")
        detail = r.get("error") or (comp[0] if comp else None) or r.get("solo_per_rank") or r.get("split") or ""
        lines.append([
            r["model"], r["link"], r["config"],
            f"{r['samples_per_s']:.1f}" if r.get("samples_per_s") else "-",
            f"{r['fraction_of_ideal']:.2f}" if r.get("fraction_of_ideal") else "-",
            f"{r['ratio_to_ddp']:.2f}" if r.get("ratio_to_ddp") else "-",
            f"{1000 * r['step_s']:.0f}" if r.get("step_s") else "-",
            str(r.get("timed_steps", "-")) + ("*" if r.get("stopped_early") else ""),
            f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "-",
            f"{100 * r['final_loss_vs_flat']:+.2f}%" if r.get("final_loss_vs_flat") is not None else "-",
            f"{r['held_out_loss']:.4f}" if r.get("held_out_loss") is not None else "-",
            f"{100 * r['held_out_vs_ddp']:+.2f}%" if r.get("held_out_vs_ddp") is not None else "-",
            "NOT rank " + ",".join(str(i) for i, c in enumerate(r.get("capped") or []) if c is False)
            if False in (r.get("capped") or []) else "ok",
            format_detail(detail),
        ])
    return format_table(headers, lines)


def plot(rows: list[dict[str, Any]], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = list(dict.fromkeys((r["model"], r["link"]) for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(4.4 * len(groups), 7.0), squeeze=False)
    colors = {"solo": "#999999", "ddp": "#1f77b4", "flat": "#ff7f0e", "auto": "#2ca02c", "periodic": "#d62728"}
    for col, (model, link) in enumerate(groups):
        same = [r for r in rows if r["model"] == model and r["link"] == link]
        ax = axes[0][col]
        ax.bar([r["config"] for r in same], [r.get("samples_per_s") or 0.0 for r in same],
               color=[colors.get(r["config"], "#555555") for r in same])
        ax.set_title(f"{model} / {link}")
        ax.set_ylabel("samples/s (solo = ideal sum)")
        ax = axes[1][col]
        for r in same:
            if r.get("losses"):
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["config"], color=colors.get(r["config"]))
        ax.set_xlabel("step (same samples per step)")
        ax.set_ylabel("training loss (global batch)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default="1+1", choices=list(LAYOUTS), help="GPUs per emulated host")
    p.add_argument("--links", default="10gbe,25gbe", help=f"comma-separated, of {list(LINKS)}")
    p.add_argument("--models", default="gpt,resnet50", help="comma-separated, of gpt, resnet50")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS + EXTRA_CONFIGS)}")
    p.add_argument("--every", type=int, default=8, help="H of the periodic configuration (optimizer steps)")
    p.add_argument("--accelerator", default="gpu", choices=["gpu", "cuda", "cpu"])
    p.add_argument("--capacities", default="auto", help="capacities of the hetero configs (auto = profiled)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10; quick 5; tiny 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 200; quick 40; tiny 4)")
    p.add_argument("--quick", action="store_true", help="fewer steps, shorter GPT sequences")
    p.add_argument("--tiny", action="store_true", help="tiny models and batches (CPU smoke run)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds per configuration before it stops early (default 120; quick 45)")
    p.add_argument("--resnet-batch", type=int, default=None, help="per-device batch (DDP meaning); default 64")
    p.add_argument("--gpt-batch", type=int, default=None, help="per-device batch of sequences; default 8")
    p.add_argument("--seq", type=int, default=None, help="GPT sequence length (default 1024; quick 512)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    args.links = [s for s in args.links.split(",") if s]
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c]
    for name, values, known in (("--links", args.links, LINKS), ("--models", args.models, ("gpt", "resnet50")),
                                ("--configs", args.configs, CONFIGS + EXTRA_CONFIGS)):
        bad = [v for v in values if v not in known]
        if bad or not values:
            p.error(f"{name}: {bad or 'empty'} not in {list(known)}")
    args.accelerator = "cpu" if args.accelerator == "cpu" else "gpu"
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5 if args.quick else 10)
    args.steps = args.steps if args.steps is not None else (4 if args.tiny else 40 if args.quick else 200)
    args.time_limit = args.time_limit or (60.0 if args.tiny else 45.0 if args.quick else 120.0)
    if args.warmup < 1 or args.steps < 1 or not math.isfinite(args.time_limit) or args.every < 1:
        p.error("--warmup, --steps and --every must be >= 1")
    if "periodic" in args.configs and (args.warmup + args.steps) % args.every:
        # Every configuration trains the same samples; the periodic run ends right after an outer step.
        args.steps += args.every - (args.warmup + args.steps) % args.every
        print(f"[bench_hosts] --steps rounded up to {args.steps}: warm-up + steps a multiple of --every {args.every}")
    args.seq = args.seq or (512 if args.quick else 1024)
    args.batch = {"resnet50": args.resnet_batch or (4 if args.tiny else 64),
                  "gpt": args.gpt_batch or (4 if args.tiny else 8)}
    args.precision = "bf16-mixed" if args.accelerator == "gpu" else "32-true"
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    world = len(LAYOUTS[args.layout][0])
    if args.accelerator == "gpu" and torch.cuda.device_count() < world:
        raise SystemExit(f"layout {args.layout} needs {world} CUDA devices; found {torch.cuda.device_count()}.")
    started = time.perf_counter()
    part = os.path.join(args.out, ".bench_hosts.json")
    stop_on_sigterm()
    rows, _ = collect_ranks(worker, (args, _free_port(), part), world, part, "bench_hosts")
    finish(rows)
    result = {
        "layout": args.layout, "hosts": LAYOUTS[args.layout][0], "speeds": LAYOUTS[args.layout][1],
        "links_gbit": {k: LINKS[k] for k in args.links},
        "emulate": {k: emulate_specs(args.layout, LINKS[k], args.accelerator) for k in args.links},
        "warmup": args.warmup, "steps": args.steps, "batch_per_device": args.batch, "seq": args.seq,
        "precision": args.precision, "tiny": args.tiny, "time_limit_s": args.time_limit, "every": args.every,
        "commit": _commit(),
        "wall_s": time.perf_counter() - started,
        "device": torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu",
        "torch": torch.__version__, "rows": rows,
    }
    with open(os.path.join(args.out, "bench_hosts.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = plot(rows, os.path.join(args.out, "bench_hosts.png")) if rows else None
    print(f"[bench_hosts] wrote {os.path.join(args.out, 'bench_hosts.json')}" + (f" and {png}" if png else "")
          + f"; total {result['wall_s']:.0f} s on {result['device']}")
    if rows:
        print(table(rows))
    return rows


if __name__ == "__main__":
    main()
