"""The hybrid layout against the alternatives on 2 whole GPUs + 2 emulated RTX 3090s, for a GPT whose AdamW state
does not fit one 24 GiB card but fits two (``--model gpt``), or a BERT-base-shaped encoder that fits every card
(``--model bert``: the seed's table, data parallel on all four against the fast pair, sharding and the pipeline).

Configurations, each a separate Lightning fit (its own process group, launched by Lightning's script launcher):

- ``hybrid``: ``HeteroHybridStrategy(pipelines=[[2, 3]])``: ranks 0, 1 data-parallel, ranks 2, 3 (the emulated
  3090s) one 2-stage pipelined replica;
- ``hybridlate``: ``hybrid`` with ``overlap_stage_exchange=False``: every stage exchange after the whole backward
  (``hybridlate,hybrid`` on one machine: the overlap's gain);
- ``hybridprofile``: ``hybrid`` with ``capacities="profile"``: each replica's share from its timed steps, not from
  the cards' published rates (on BERT, ``peak`` gave the pipeline more samples than it computes in the fast ranks'
  step time);
- ``hybridauto``: ``HeteroHybridStrategy(pipelines="auto", capacities="profile")``: the cards that cannot hold a
  replica paired by the planner, each replica's share from its timed steps (on CPU the slow ranks' memory is
  capped at 0.8 of a replica, so the planner pairs them there too);
- ``fast2``: ``HeteroDDPStrategy`` on the two whole GPUs alone (a);
- ``dp4``: ``HeteroDDPStrategy`` on all four (b): a 3090 must hold a whole replica, so it is expected not to fit;
- ``fsdp4``: ``HeteroFSDPStrategy`` on all four (c);
- ``lfsdp4``: Lightning's ``FSDPStrategy`` on all four, each step under the rank's emulation (d).

Every configuration trains ``--warmup`` untimed and ``--steps`` timed AdamW steps (bf16 autocast) on random tokens
(BERT: masked-language-model labels at 15 % of each sequence's positions);
rank 0 reports samples/s and each rank's peak memory. In ``hybrid``, every rank also times a fixed bf16 matmul loop
with and without its emulation: the measured slowdown against the expected one (1 / SM share), so the emulation is
verified in the same run. An out-of-memory error is reported as "does not fit".

    python benchmarks/bench_hybrid.py --out $OUT/hybrid                       # 4 GPUs, GPT ~1.6B, ~8 min
    python benchmarks/bench_hybrid.py --tiny --accelerator cpu --out /tmp/hy  # smoke run of every code path
    python benchmarks/bench_hybrid.py --fast-card A100-80GB --configs hybridauto,fast2,fsdp4 --out $OUT/hybrid
                                      # the seed's lab: ranks 0, 1 emulated as A100s; hybridauto prints ÷ ideal
    python benchmarks/bench_hybrid.py --model bert --fast-card A100-80GB --configs hybrid,dp4,fast2,fsdp4 \
        --global-batch 160 --out $OUT/bert  # BERT-base, 160 sequences of 128 tokens a step in every configuration

BERT's global batch is the same in every configuration, so a fast card trains about the same number of sequences in
each (160: 80 on each of two cards, about 72 beside two 3090s by their peak rates; 8-9k tokens, enough for a card's
matmuls to run near their rate) and the pipeline's share under peak rates (16) splits into 4 equal micro-batches (a
share the micro-batch count does not divide, e.g. 13 of 128, runs as 1 micro-batch: no overlap of the stages).
"""

import argparse
import json
import os
import subprocess
import tempfile
import sys
import time
from contextlib import nullcontext
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import GPT, Bert, BertConfig, Block, EncoderLayer, GPTConfig, mlm_batch  # noqa: E402

CONFIGS = ("hybrid", "hybridlate", "hybridprofile", "hybridauto", "fast2", "dp4", "fsdp4", "lfsdp4")
# Without --configs: the layouts' comparison (hybridlate and hybridprofile are levers of hybrid, asked for by name).
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c not in ("hybridlate", "hybridprofile"))
MODELS = ("gpt", "bert")
XL = GPTConfig(vocab=50304, seq=512, width=1600, layers=48, heads=25)  # GPT-2 XL shape, untied head: ~1.63B
# Sequences per rank and step by default: the 1.63B GPT's activations at 512 tokens fill a fast card at 8; BERT-base
# at 128 tokens needs about 64 (8k tokens) for a fast card's matmuls to run near their rate.
DEFAULT_BATCH = {"gpt": 8, "bert": 64}


def _module_class(model: str) -> type:
    from lightning.pytorch import LightningModule

    if model == "bert":
        return _bert_module_class()

    class UntiedGPT(LightningModule):
        """GPT with its own output head (a tied head would join the first and last stages)."""

        def __init__(self, cfg: GPTConfig) -> None:
            super().__init__()
            self.gpt = GPT(cfg)
            self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.gpt.hidden(tokens))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            logits = self(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return UntiedGPT


def _bert_module_class() -> type:
    from lightning.pytorch import LightningModule

    class MaskedLM(LightningModule):
        """A BERT encoder trained on the masked-language-model loss (its head untied: see :class:`models.Bert`)."""

        def __init__(self, cfg: BertConfig) -> None:
            super().__init__()
            self.bert = Bert(cfg)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.bert(tokens)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens, labels = batch
            logits = self(tokens)
            # Every sequence masks the same number of positions: the mean over masked tokens is the mean over
            # sequences, so unequal per-rank batches weigh it exactly.
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return MaskedLM


def model_and_data(args: argparse.Namespace, samples: int) -> tuple[Any, Any]:
    """The ``--model``'s LightningModule (tiny with ``--tiny``) and ``samples`` random training samples."""
    if args.model == "bert":
        return workload(BertConfig.tiny() if args.tiny else BertConfig(), samples)
    return workload(GPTConfig.tiny() if args.tiny else XL, samples)


def workload(cfg: Any, samples: int) -> tuple[Any, Any]:
    """The LightningModule of ``cfg`` (a :class:`BertConfig`: masked LM; a :class:`GPTConfig`: untied-head GPT) and
    ``samples`` random training samples for it.

        module, dataset = workload(GPTConfig.gpt2_small(), 64)
    """
    from torch.utils.data import TensorDataset

    if isinstance(cfg, BertConfig):
        return _module_class("bert")(cfg), TensorDataset(*mlm_batch(cfg, samples))
    tokens = torch.randint(0, cfg.vocab, (samples, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    return _module_class("gpt")(cfg), TensorDataset(tokens)


def emulate_specs(args: argparse.Namespace, world: int, replica_bytes: Optional[int] = None) -> list[Any]:
    """Ranks 0, 1: whole devices, or ``--fast-card`` (an emulator preset); ranks 2, 3: the slow cards. On CPU,
    ``replica_bytes`` caps the slow ranks' memory below one replica (parameters, gradients, AdamW's moments) and
    above a 2-stage pipeline's stage, as a 24 GiB card is for the 1.63B GPT."""
    slow: Any = "RTX3090"
    if args.accelerator == "cpu":
        slow = {"slowdown": 3.0, "name": "CPU at 33%"}
        if replica_bytes is not None:
            slow["memory_gib"] = 0.8 * replica_bytes / 2**30
    fast = args.fast_card
    return [fast, fast, slow, slow][:world]


def verify_emulation(emulator: Any, device: torch.device) -> dict[str, Any]:
    """Seconds of a fixed matmul loop plain and under this rank's emulation; the measured and expected slowdown.

    The loop runs as steps (each inside one ``emulator.work()``, as a training step does), so a GPU time dilation,
    which idles after each step in proportion to the fastest recent step, is counted once its window has a step.
    """
    size, reps = (256, 4) if device.type == "cpu" else (4096, 10)
    a = torch.randn(size, size, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)

    def timed(context: Callable[[], Any]) -> float:
        def step() -> None:
            with context():
                for _ in range(reps):
                    a @ a
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's events complete: the next step's dilation can read them

        for _ in range(3):
            step()
        # Whole steps are timed: on CPU the emulator pauses when the work ends, on GPU the dilation's idle follows.
        start = time.perf_counter()
        for _ in range(5):
            step()
        return time.perf_counter() - start

    plain = timed(nullcontext)
    emulated = timed(emulator.work) if emulator is not None else plain
    expected = 1.0
    if emulator is not None:
        expected = (emulator.device.slowdown if device.type == "cpu"
                    else emulator.device.dilation / emulator.device.sm_share)
    return {"measured_slowdown": round(emulated / plain, 2), "expected_slowdown": round(expected, 2)}


def _strategy(config: str, args: argparse.Namespace, world: int, module: nn.Module) -> Any:
    from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy, HeteroHybridStrategy

    common: dict[str, Any] = {"observation": {"print_table": False, "monitor": args.monitor},
                              "resilience": {"timeout": 150}}
    precision = "32-true" if args.accelerator == "cpu" else "bf16-mixed"
    emulate = emulate_specs(args, world)
    # Published rates of the emulated cards on GPUs; the CPU emulator's slowdowns have none, so their inverse.
    peak: Any = [3, 3, 1, 1] if args.accelerator == "cpu" else "peak"
    if config in ("hybrid", "hybridlate", "hybridprofile"):
        return HeteroHybridStrategy(pipelines=[[2, 3]], capacities="profile" if config == "hybridprofile" else peak,
                                    emulate=emulate, micro_batches=args.micro_batches, precision_policy=precision,
                                    overlap_stage_exchange=config != "hybridlate",
                                    profiling={"steps": args.profile_steps}, **common)
    if config == "hybridauto":
        replica = 4 * sum(p.numel() * p.element_size() for p in module.parameters())
        return HeteroHybridStrategy(pipelines="auto", capacities="profile", emulate=emulate_specs(args, world, replica),
                                    micro_batches=args.micro_batches, precision_policy=precision,
                                    profiling={"steps": args.profile_steps}, **common)
    if config == "fast2":
        return HeteroDDPStrategy(capacities="equal", precision_policy=precision, emulate=emulate, **common)
    if config == "dp4":
        return HeteroDDPStrategy(capacities=peak, emulate=emulate, precision_policy=precision, **common)
    if config == "fsdp4":
        return HeteroFSDPStrategy(capacities=peak, emulate=emulate, precision_policy=precision, **common)
    if config == "lfsdp4":
        return _emulated_fsdp(emulate, EncoderLayer if args.model == "bert" else Block)
    raise ValueError(f"configuration {config!r}: one of {list(CONFIGS)}")


def _emulated_fsdp(emulate: list[Any], block: type) -> Any:
    """Lightning's FSDPStrategy, each step under this rank's emulation (its compute and memory caps)."""
    from lightning.pytorch.strategies import FSDPStrategy

    return emulated_lightning(FSDPStrategy, emulate, {"auto_wrap_policy": {block}, "state_dict_type": "sharded"})


def emulated_lightning(base: type, emulate: list[Any], options: Optional[dict[str, Any]] = None) -> Any:
    """Lightning's strategy ``base(**options)``, each training and optimizer step under this rank's entry of
    ``emulate`` (its compute and memory caps; ``strategy.emulator``), started when the rank's device is known.

        strategy = emulated_lightning(DDPStrategy, ["A100-80GB", "RTX3090"])
    """
    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    from bench_lab import emulated_steps

    class Emulated(emulated_steps(base)):  # type: ignore[misc]
        def setup_environment(self) -> None:
            super().setup_environment()
            rank, device = self.global_rank, self.root_device
            self.emulator = start_emulation(parse_emulate(emulate), rank, self.world_size,
                                            describe_device(device, device.index or 0), device)
            if self.emulator is not None:
                self.emulator.activate()

    Emulated.__name__ = f"Emulated{base.__name__}"
    return Emulated(**(options or {}))


def run(config: str, args: argparse.Namespace) -> None:
    """One configuration's fit (every rank runs this; rank 0 writes the row)."""
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from bench_lab import _timer_class

    if args.dump_every:  # where each rank is, every N s, on stderr (a configuration that runs past its limit)
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_every, repeat=True)
    world = 2 if config == "fast2" else 4
    batch = rank_batch(args, world)
    seed_everything(0, verbose=False)
    steps = args.warmup + args.steps
    module, dataset = model_and_data(args, batch * world * steps)
    loader = DataLoader(dataset, batch_size=batch)
    timer = _timer_class()(args.warmup, args.steps)
    checks: dict[str, Any] = {}

    class Verify(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            import torch.distributed as dist

            mine = verify_emulation(getattr(trainer.strategy, "emulation", None), pl_module.device)
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, mine)
            checks["emulation"] = gathered

    precision = "bf16-mixed" if config == "lfsdp4" and args.accelerator != "cpu" else None
    trainer = Trainer(accelerator="cpu" if args.accelerator == "cpu" else "gpu", devices=world,
                      strategy=_strategy(config, args, world, module), max_steps=steps,
                      logger=CSVLogger(os.path.join(args.out, config)) if args.monitor else False,
                      log_every_n_steps=max(1, args.steps // 2),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[timer] + ([Verify()] if config == "hybrid" else []),
                      **({"precision": precision} if precision else {}))
    trainer.fit(module, loader)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    import torch.distributed as dist

    peaks: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(peaks, None if peak is None else round(peak, 2))
    if trainer.global_rank == 0:
        elapsed = timer.t1 - timer.t0
        row = {"config": config, "model": args.model, "world": world, "global_batch": batch * world,
               "samples_per_s": round(batch * world * args.steps / elapsed, 3),
               "step_s": round(elapsed / args.steps, 4), "peak_gib": peaks, **checks}
        strategy = trainer.strategy
        if config.startswith("hybrid"):
            profile = strategy.core.profiler.profile
            row["pipelines"] = strategy.pipelines
            row["overlapping"] = strategy.overlapping
            row["capacities"] = [round(c, 4) for c in strategy.plan.capacities]
            if profile is not None:
                row["replica_rates"] = [round(r, 2) for r in profile.extra["replica_rates"]]
                row["micro_batches"] = profile.extra.get("micro_batches")
        with open(os.path.join(args.out, f"{config}.json"), "w") as f:
            json.dump(row, f)


def rank_batch(args: argparse.Namespace, world: int) -> int:
    """The loader's sequences per rank: ``--global-batch`` / world (the same global batch in every configuration),
    else ``--batch`` (default: the model's)."""
    if args.global_batch:
        if args.global_batch % world:
            raise ValueError(f"--global-batch {args.global_batch} is not a multiple of the world size {world}.")
        return args.global_batch // world
    return args.batch or DEFAULT_BATCH[args.model]


def checked_options(args: argparse.Namespace) -> tuple[list[str], dict[str, int]]:
    """The ``--configs`` to run and the ``--timeouts`` per configuration, checked before anything runs: a ``ValueError``
    naming the flag (an unknown name, a malformed limit, a ``--global-batch`` a configuration's ranks do not divide)."""
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"--configs: {unknown or 'none given'}, each one of {list(CONFIGS)}")
    limits: dict[str, int] = {}
    for item in filter(None, args.timeouts.split(",")):
        name, _, seconds = item.partition("=")
        if name not in CONFIGS or not seconds.isdigit() or int(seconds) < 1:
            raise ValueError(f"--timeouts item {item!r}: CONFIG=SECONDS, CONFIG one of {list(CONFIGS)}, SECONDS >= 1")
        limits[name] = int(seconds)
    for config in configs:
        rank_batch(args, 2 if config == "fast2" else 4)  # a --global-batch the configuration cannot split
    return configs, limits


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one configuration, in Lightning's launch
    p.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--model", default="gpt", choices=MODELS,
                   help="gpt: a 1.63B GPT (GPT-2 XL shape); bert: a BERT-base-shaped encoder, MLM loss, 128 tokens")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"sequences per rank and step (global = batch x world; default {DEFAULT_BATCH})")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step in every configuration (overrides --batch; a multiple of 4)")
    p.add_argument("--profile-steps", type=int, default=4, help="timed steps per size of `capacities=\"profile\"`")
    p.add_argument("--micro-batches", type=int, default=None, help="the pipeline's micro-batches (default 2 x stages)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=int, default=100, help="seconds per configuration")
    p.add_argument("--timeouts", default="", help="per-configuration seconds overriding --timeout: hybridauto=240,...")
    p.add_argument("--fast-card", default=None,
                   help="emulate ranks 0, 1 as this preset (e.g. A100-80GB, the seed's lab); default: whole devices")
    p.add_argument("--monitor", action="store_true",
                   help="HeteroMonitor on in our configurations: per-rank (and per-stage) times in each config's log")
    p.add_argument("--dump-every", type=int, default=0, help="dump every rank's stack every N s (0: never)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.run is not None:
        run(args.run, args)
        return
    try:
        configs, limits = checked_options(args)
    except ValueError as err:
        p.error(str(err))
    rows = []
    work = tempfile.mkdtemp(prefix="bench_hybrid_")  # per-configuration logs and rows; only the summary goes to --out
    for config in configs:
        if config == "lfsdp4" and args.accelerator == "cpu":  # Lightning's FSDPStrategy needs an accelerator
            rows.append({"config": config, "error": "skipped on CPU"})
            continue
        command = [sys.executable, os.path.abspath(__file__), "--run", config, "--out", work, "--model", args.model,
                   "--accelerator", args.accelerator, "--batch", str(rank_batch(args, 2 if config == "fast2" else 4)),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--dump-every", str(args.dump_every),
                   "--profile-steps", str(args.profile_steps)] + (["--monitor"] if args.monitor else [])
        command += ["--fast-card", args.fast_card] if args.fast_card else []
        command += (["--tiny"] if args.tiny else []) + (
            ["--micro-batches", str(args.micro_batches)] if args.micro_batches else [])
        log_path = os.path.join(work, f"{config}.log")
        began = time.perf_counter()
        try:
            with open(log_path, "w") as log:
                code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limits.get(config, args.timeout)).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        text = open(log_path).read()
        result_path = os.path.join(work, f"{config}.json")
        if code == 0 and os.path.exists(result_path):
            row = json.load(open(result_path))
            if args.monitor:  # the monitor's summary (per rank, per stage) is in the log
                with open(os.path.join(args.out, f"{config}.log"), "w") as f:
                    f.write(text)
        else:
            oom = "out of memory" in text.lower()
            row = {"config": config, "error": "does not fit (out of memory)" if oom else f"failed ({code})",
                   "tail": text[-600:]}
            with open(os.path.join(args.out, f"{config}.log"), "w") as f:  # the whole log of a failed configuration
                f.write(text)
        row["wall_s"] = round(time.perf_counter() - began, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
    with open(os.path.join(args.out, "bench_hybrid.json"), "w") as f:
        json.dump(rows, f, indent=1)
    best = max((r["samples_per_s"] for r in rows if not r["config"].startswith("hybrid") and "samples_per_s" in r),
               default=None)
    print(f"\n{'config':10} {'samples/s':>10} {'step s':>8}  peak GiB per rank / note")
    for r in rows:
        if "samples_per_s" in r:
            print(f"{r['config']:10} {r['samples_per_s']:10.2f} {r['step_s']:8.3f}  {r['peak_gib']}")
        else:
            print(f"{r['config']:10} {'-':>10} {'-':>8}  {r['error']}")
    hybrid = next((r for r in rows if r["config"] == "hybrid" and "samples_per_s" in r), None)
    if hybrid is not None:
        for rank, check in enumerate(hybrid.get("emulation", [])):
            print(f"rank {rank} emulation: measured {check['measured_slowdown']}x, expected "
                  f"{check['expected_slowdown']}x")
    for r in rows:
        if "overlapping" in r:
            when = "begun in the backward" if r["overlapping"] else "after the backward"
            print(f"{r['config']}: stage exchange {when}")
        if r["config"].startswith("hybrid") and "samples_per_s" in r and best:
            print(f"{r['config']} / best other: {r['samples_per_s'] / best:.2f}x")
        if r["config"].startswith("hybrid") and r.get("replica_rates"):
            # The ideal: every replica at its own rate, profiled at set-up (forward + backward; no exchange, no optimizer).
            ideal = sum(r["replica_rates"])
            print(f"{r['config']} / ideal (sum of the replicas' measured rates {r['replica_rates']}): "
                  f"{r['samples_per_s'] / ideal:.2f}")


if __name__ == "__main__":
    main()
