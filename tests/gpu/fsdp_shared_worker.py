"""Two ranks sharing one GPU, capped like a mixed pair (52 + 22 GiB), under ``HeteroFSDPStrategy``.

The launcher starts 2 worker processes per phase with ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` set, so Lightning
treats them as externally launched and each builds its own model (nothing large is pickled or handed back). Phases:

- ``exact``: a small GPT twin in fp32, capacities [3, 1], a mixed per-block memory plan (rank 0 recomputes two blocks,
  rank 1 offloads two and recomputes all), 2 steps, a sharded checkpoint, then a resumed fit to step 4; the launcher
  compares the final parameters with one process on the same global batches;
- ``big``: a 2.65B GPT (AdamW, bf16-mixed, 512 tokens, global batch 4 split 3 + 1, 2 steps), ``memory="auto"``: each
  rank's plan, its estimate and its measured peak;
- ``baseline``: Lightning's ``FSDPStrategy`` on the same GPT with equal batches (2 + 2) and the same caps: expected to
  run out of memory on the 22 GiB rank (the launcher stops the other rank).

    python tests/gpu/fsdp_shared_worker.py --out DIR                      # all phases, a table last
    python tests/gpu/fsdp_shared_worker.py --out DIR --accelerator cpu    # gloo dry run of the code (tiny sizes)

``--knobs`` switches parts of the exact phase off, one suspect at a time (:data:`KNOBS`; none: the test's run, which
they leave as it is); ``tests/gpu/fsdp_shared_bisect.py`` runs the phase under each in turn.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

GIB = 2**30
CAPS_GIB = (52.0, 22.0)
CAPACITIES = [3.0, 1.0]
BIG = {"vocab": 50304, "seq": 512, "width": 2560, "layers": 32, "heads": 20}
TWIN = {"vocab": 512, "seq": 64, "width": 256, "layers": 4, "heads": 4}
TINY = {"vocab": 256, "seq": 32, "width": 64, "layers": 4, "heads": 4}  # the CPU dry run's "big" model
EXACT_PLAN = {"rank:0": "checkpoint:2", "rank:1": "offload:2,checkpoint:all"}
EXACT_LR = 0.05
EXACT_STEPS = 4  # 2 before the checkpoint, 2 after the resume

# What the exact phase can leave out, each alone or together (the library's defaults are untouched: each knob is an
# option given to the strategy or the trainer, or an instance of the worker's own strategy changed).
KNOBS = {
    "no-measure": "MemoryPolicy(measure=False): no trial forward/backward before the first step of either fit",
    "measure-fit1": "trial steps in the first fit only (not after the resume)",
    "no-preempt": "the pre-emption handler inert (no stop notes all-reduced, no non-blocking copy, Lightning's "
                  "SIGTERM broadcast kept)",
    "keep-sigterm-broadcast": "Lightning's per-batch SIGTERM broadcast kept (the handler otherwise as it is)",
    "no-watchdog": "no fault watchdog thread (the RNG state still saved)",
    "no-offload": "rank 1 plans 'checkpoint:all' (no FSDP2 CPU offload)",
    "no-checkpoint": "no ModelCheckpoint; the second fit starts afresh (two fits in one process, no resume)",
    "fit1-only": "the first fit only (2 steps and the checkpoint)",
    "fit2-only": "the resumed fit only, from the checkpoint in --ckpt-dir (a fresh pair of processes)",
    "no-state": "no whole-tensor state_dict() after the last fit (no gather of the shards)",
    "trace": "print each Lightning hook as it starts (flushed), to place a crash",
    "segv-at-fit2": "crash on purpose (SIGSEGV) as the second fit starts: checks that a crash is caught and shown",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_data(n: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(1))


# -- worker side ------------------------------------------------------------------------------------------------------
def _mark(text: str) -> None:
    """A line in this rank's log, written at once (a rank killed by a signal loses what Python still buffers); the
    crash report armed again (see :func:`_arm_crash_report`)."""
    _arm_crash_report()
    sys.stderr.write(f"[worker rank {os.environ.get('RANK')}] {text}\n")
    sys.stderr.flush()


def _arm_crash_report() -> None:
    """A rank killed by SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE prints every thread's native stack (torch's fatal
    signal handler: the C++ frames, gloo's and CUDA's threads too) and then every thread's Python stack
    (faulthandler). Armed before each fit and at each mark: Lightning's teardown puts every signal's handler back as
    Python's ``signal.getsignal`` saw it at set-up (``SIG_DFL`` for SIGSEGV: neither handler is a Python one), so a
    fit ended with both gone and a crash in the next fit printed nothing."""
    import faulthandler

    # torch's handler has no public switch; a release without it leaves faulthandler's alone.
    native = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    # Each does nothing while it thinks itself installed: off first, then on installs the handlers anew. torch's
    # last, so that it runs first and then calls faulthandler's (which ends the process).
    if native is not None:
        native(False)
    faulthandler.disable()
    faulthandler.enable(all_threads=True)
    if native is not None:
        native(True)


def check_knobs(knobs: Any) -> frozenset[str]:
    """``knobs`` (names of :data:`KNOBS`) as a set; ``ValueError`` naming the unknown ones."""
    knobs = frozenset(knobs)
    unknown = sorted(knobs - set(KNOBS))
    if unknown:
        raise ValueError(f"`knobs` {unknown} unknown; known: {sorted(KNOBS)}")
    if {"fit1-only", "fit2-only"} <= knobs:
        raise ValueError("`knobs`: 'fit1-only' and 'fit2-only' leave no fit; give one of them")
    return knobs


def _worker(phase: str, out: str, accelerator: str, knobs: frozenset[str] = frozenset(),
            ckpt_dir: Optional[str] = None) -> None:
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from models import GPT, Block, GPTConfig, gpt_activation_bytes
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from lightning_hetero import HeteroFSDPStrategy, MemoryPolicy
    from lightning_hetero.lab.shared_gpu import one_gpu
    from lightning_hetero.resilience.sharded import is_sharded_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rank = int(os.environ["RANK"])
    gpu = accelerator == "gpu"
    devices = one_gpu(2) if gpu else [torch.device("cpu")] * 2
    emulate = [{"memory_gib": c} for c in CAPS_GIB] if gpu else None

    class Tokens(Dataset):
        def __init__(self, n: int, seq: int, vocab: int) -> None:
            self.data = _token_data(n, seq, vocab)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return self.data[i], i

    class GPTModule(LightningModule):
        """The GPT built in ``setup`` (in host memory, on each rank: the strategy shards and places it)."""

        def __init__(self, cfg: dict, optimizer: str, batch_size: int, n: int) -> None:
            super().__init__()
            self.cfg, self.optimizer_name, self.batch_size, self.n = GPTConfig(**cfg), optimizer, batch_size, n
            self.gpt: Optional[nn.Module] = None
            self.seen: list[tuple[int, list[int]]] = []
            self.losses: list[float] = []

        def setup(self, stage: str) -> None:
            if self.gpt is None:
                torch.manual_seed(0)
                self.gpt = GPT(self.cfg)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.gpt(tokens)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens, index = batch
            self.seen.append((self.trainer.global_step, index.tolist()))
            logits = self(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.optimizer_name == "sgd":
                return torch.optim.SGD(self.parameters(), lr=EXACT_LR, momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Tokens(self.n, self.cfg.seq, self.cfg.vocab), batch_size=self.batch_size, shuffle=False)

    class Capped(Callback):
        """Lightning's FSDPStrategy has no emulator: cap each rank's allocator before the model is placed."""

        def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
            if gpu:
                total = torch.cuda.get_device_properties(0).total_memory
                torch.cuda.set_per_process_memory_fraction(CAPS_GIB[rank] * GIB / total, 0)

    def trainer(strategy: Any, precision: str, max_steps: int, callbacks: list) -> Trainer:
        return Trainer(accelerator=accelerator, devices=1 if gpu else 2, strategy=strategy, precision=precision,
                       max_steps=max_steps, callbacks=callbacks, logger=False, enable_checkpointing=any(
                           isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)

    class Trace(Callback):
        """Each hook's name as it starts: the last one in a crashed rank's log is where it was."""

    def _traced(name: str) -> Any:
        return lambda self, *args, **kwargs: _mark(f"hook {name}")

    for _hook in ("setup", "on_fit_start", "on_load_checkpoint", "on_train_start", "on_train_batch_start",
                  "on_train_batch_end", "on_save_checkpoint", "on_train_end", "on_fit_end", "teardown"):
        setattr(Trace, _hook, _traced(_hook))

    def inert_preemption(strategy: HeteroFSDPStrategy) -> None:
        # The handler is always added by the strategy; these two hooks are all it does in a run without a signal.
        handler = strategy.core.resilience.preemption
        handler.on_train_start = lambda trainer, pl_module: None
        handler.on_train_batch_end = lambda *args, **kwargs: None

    def no_watchdog(strategy: HeteroFSDPStrategy) -> None:
        hooks = strategy.core.resilience
        hooks.start_watchdog = lambda host, device_name: hooks.rank_states.register("rng", hooks.rng)

    if "keep-sigterm-broadcast" in knobs:
        import lightning_hetero._compat as compat

        compat.skip_sigterm_broadcast = lambda trainer: (lambda: None)

    result: dict[str, Any] = {"rank": rank, "knobs": sorted(knobs)}
    start = time.perf_counter()
    if phase == "exact":
        ckpt_dir = ckpt_dir or os.path.join(out, "exact_ckpt")
        cfg = TWIN if gpu else TINY
        plan = dict(EXACT_PLAN, **({"rank:1": "checkpoint:all"} if "no-offload" in knobs else {}))
        checkpointing = "no-checkpoint" not in knobs
        fits = [False] if "fit1-only" in knobs else [True] if "fit2-only" in knobs else [False, True]
        seen: list = []
        for resume in fits:
            _mark(f"fit {2 if resume else 1}: start")
            if resume and "segv-at-fit2" in knobs:
                import ctypes

                ctypes.string_at(0)  # SIGSEGV
            measure = "no-measure" not in knobs and not (resume and "measure-fit1" in knobs)
            memory = plan if measure else MemoryPolicy(rules=plan, measure=False)
            strategy = HeteroFSDPStrategy(capacities=CAPACITIES, memory=memory, parallel_devices=devices,
                                          emulate=emulate, resilience={"timeout": 120})
            if "no-preempt" in knobs:
                inert_preemption(strategy)
            if "no-watchdog" in knobs:
                no_watchdog(strategy)
            model = GPTModule(cfg, "sgd", batch_size=4, n=4 * 2 * EXACT_STEPS)
            callbacks: list = [Trace()] if "trace" in knobs else []
            if checkpointing:
                callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1))
            path = os.path.join(ckpt_dir, "epoch=0-step=2.ckpt")
            trainer(strategy, "32-true", EXACT_STEPS if resume else 2, callbacks).fit(
                model, ckpt_path=path if resume and checkpointing else None)
            _mark(f"fit {2 if resume else 1}: done")
            seen += model.seen
            if not resume:
                result["sharded_checkpoint"] = checkpointing and bool(is_sharded_checkpoint(path))
                result["plan"] = [p.mode for p in strategy.memory_plan]
        result["seen"] = seen
        result["resumed_from_step"] = seen[2][0] if len(seen) > 2 else None
        if "no-state" not in knobs:
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # whole tensors after fit (every rank)
            _mark("whole-tensor state_dict: done")
            if rank == 0:
                torch.save(state, os.path.join(out, "exact_params.pt"))
    elif phase == "big":
        cfg = BIG if gpu else TINY
        per_sample, fraction = gpt_activation_bytes(GPTConfig(**cfg))
        policy = MemoryPolicy(activation_bytes_per_sample=per_sample, checkpointed_fraction=fraction)
        # The global batch known at setup: the plan counts each rank's activations before the model is sharded.
        strategy = HeteroFSDPStrategy(capacities=CAPACITIES, memory=policy, parallel_devices=devices, emulate=emulate,
                                      global_batch_size=4, resilience={"timeout": 300})
        model = GPTModule(cfg, "adamw", batch_size=2, n=64)
        # Two steps: the peaks are set beside the estimates once AdamW's state exists (at the end of the fit here).
        trainer(strategy, "bf16-mixed" if gpu else "32-true", 2, []).fit(model)
        result.update(plan=[p.mode for p in strategy.memory_plan],
                      estimate_gib=[p.needed / GIB for p in strategy.memory_plan],
                      budget_gib=[p.budget / GIB for p in strategy.memory_plan],
                      peak_gib=[None if p is None else p / GIB for p in strategy.memory_peaks or []],
                      losses=model.losses, parameters=sum(p.numel() for p in model.parameters()),
                      samples=[len(i) for _, i in model.seen[:1]], table=strategy.lab.table(strategy.plan))
    elif phase == "baseline":
        from datetime import timedelta

        from lightning.pytorch.strategies import FSDPStrategy

        cfg = BIG if gpu else TINY
        strategy = FSDPStrategy(auto_wrap_policy={Block}, parallel_devices=devices, process_group_backend="gloo",
                                timeout=timedelta(seconds=60))
        model = GPTModule(cfg, "adamw", batch_size=2, n=64)
        try:
            trainer(strategy, "bf16-mixed" if gpu else "32-true", 2, [Capped()]).fit(model)
            result["outcome"] = "trained"
            result["peak_gib"] = torch.cuda.max_memory_allocated(0) / GIB if gpu else None
        except Exception as err:  # the expected outcome on the small rank: recorded, then the rank exits with it
            result["outcome"] = "out of memory" if isinstance(err, torch.OutOfMemoryError) else repr(err)[:500]
            _write(out, phase, rank, result)
            raise
    result["seconds"] = time.perf_counter() - start
    _write(out, phase, rank, result)
    if dist.is_initialized():
        dist.barrier()
    _mark("end")


def _write(out: str, phase: str, rank: int, result: dict) -> None:
    with open(os.path.join(out, f"{phase}_rank{rank}.json"), "w") as f:
        json.dump(result, f)


# -- launcher side ----------------------------------------------------------------------------------------------------
def launch(phase: str, out: str, accelerator: str, timeout: float = 400, knobs: Any = (),
           ckpt_dir: Optional[str] = None, wrap: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start the 2 ranks of ``phase``; once one fails, stop the other (it waits in a collective). Returns each rank's
    JSON (or ``None``), the return codes and the tail of each log. ``knobs`` (:data:`KNOBS`), ``ckpt_dir`` and
    ``wrap`` (a command that runs each rank, e.g. a debugger's) serve the bisection; the test gives none."""
    os.makedirs(out, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        # Unbuffered: a rank killed by a signal keeps every line it printed.
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", PYTHONUNBUFFERED="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [*wrap, sys.executable, os.path.abspath(__file__), "--worker", phase, "--out", out, "--accelerator",
               accelerator]
        if knobs:
            cmd += ["--knobs", ",".join(sorted(check_knobs(knobs)))]
        if ckpt_dir is not None:
            cmd += ["--ckpt-dir", ckpt_dir]
        log = open(os.path.join(out, f"{phase}_rank{rank}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, failed_at = time.time() + timeout, None
    try:
        while any(p.poll() is None for p, _ in procs) and time.time() < deadline:
            if failed_at is None and any(p.poll() not in (None, 0) for p, _ in procs):
                failed_at = time.time()
            if failed_at is not None and time.time() - failed_at > 10:
                break
            time.sleep(0.5)
    finally:
        # Also when the launcher itself is stopped (SIGTERM from `timeout`): no rank outlives it on the GPU.
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    results: dict[str, Any] = {"returncodes": [p.returncode for p, _ in procs], "ranks": [], "logs": []}
    for rank in range(2):
        path = os.path.join(out, f"{phase}_rank{rank}.json")
        results["ranks"].append(json.load(open(path)) if os.path.exists(path) else None)
        with open(os.path.join(out, f"{phase}_rank{rank}.log")) as f:
            results["logs"].append(f.read()[-3000:])
    return results


def exact_reference(out: str, ranks: list[dict], accelerator: str) -> dict[str, Any]:
    """One process on the global batches the ranks saw (SGD, fp32), against the sharded run's final parameters; and
    the ranks' batches weighted equally (what unweighted FSDP averaging computes) for scale."""
    from models import GPT, GPTConfig
    from torch import nn

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0) if accelerator == "gpu" and torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(**(TWIN if accelerator == "gpu" else TINY))
    data = _token_data(4 * 2 * EXACT_STEPS, cfg.seq, cfg.vocab).to(device)
    steps: dict[int, list[list[int]]] = {}
    for r in ranks:
        for step, indices in r["seen"]:
            steps.setdefault(step, []).append(indices)

    def run(equal_rank_weights: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=EXACT_LR, momentum=0.9)
        for step in sorted(steps):
            parts = [data[torch.tensor(i, device=device)] for i in steps[step] if i]

            def loss_of(tokens: torch.Tensor) -> torch.Tensor:
                logits = model(tokens[:, :-1])
                return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

            loss = (sum(loss_of(p) for p in parts) / len(parts) if equal_rank_weights else loss_of(torch.cat(parts)))
            loss.backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    trained = torch.load(os.path.join(out, "exact_params.pt"))
    trained = {k.removeprefix("gpt."): v for k, v in trained.items()}

    def rel(reference: dict[str, torch.Tensor]) -> float:
        return max(float((trained[k] - v).abs().max() / v.abs().max()) for k, v in reference.items())

    return {"steps": sorted(steps), "samples_per_step": [[len(i) for i in steps[s]] for s in sorted(steps)],
            "max_rel_diff": rel(run(False)), "max_rel_diff_unweighted": rel(run(True))}


def baseline_prediction(cfg: dict) -> list[dict[str, Any]]:
    """The memory plan's estimate for equal batches (2 + 2) with everything kept, on the caps with no headroom: what
    Lightning's ``FSDPStrategy`` without offload or activation checkpointing needs per rank."""
    from models import GPT, Block, GPTConfig, gpt_activation_bytes

    from lightning_hetero.lab.devices import DeviceInfo
    from lightning_hetero.plan.memory import ModelFootprint, estimate

    config = GPTConfig(**cfg)
    with torch.device("meta"):
        footprint = ModelFootprint.of(GPT(config), (Block,), slots=2)
    per_sample, _ = gpt_activation_bytes(config)
    rows = []
    for rank, cap in enumerate(CAPS_GIB):
        device = DeviceInfo(rank, "host", "cuda", f"{cap:g} GiB cap", (9, 0), int(cap * GIB), 132)
        plan = estimate(footprint, "keep", device, 2, 2, per_sample, int(cap * GIB))
        rows.append({"rank": rank, "needed_gib": plan.needed / GIB, "cap_gib": cap, "fits": plan.fits})
    return rows


def run_all(out: str, accelerator: str, phases: tuple[str, ...] = ("exact", "big", "baseline")) -> dict[str, Any]:
    results: dict[str, Any] = {"accelerator": accelerator, "caps_gib": CAPS_GIB}
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name(0)
    for phase in phases:
        start = time.perf_counter()
        results[phase] = launch(phase, out, accelerator)
        results[phase]["wall_s"] = time.perf_counter() - start
        if phase == "baseline":
            results["baseline"]["prediction"] = baseline_prediction(BIG if accelerator == "gpu" else TINY)
        if phase == "exact" and all(results["exact"]["ranks"]):
            results["exact"]["reference"] = exact_reference(out, results["exact"]["ranks"], accelerator)
        # After every phase: a run cut short keeps what it measured.
        with open(os.path.join(out, "fsdp_shared.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def summary(results: dict[str, Any]) -> str:
    lines = [f"two ranks sharing one {results.get('device', 'CPU')} (time-shared), caps {results['caps_gib']} GiB"]
    exact = results.get("exact")
    if exact:
        ref = exact.get("reference") or {}
        r0 = exact["ranks"][0] or {}
        lines.append(f"exact: rc {exact['returncodes']}, plan {r0.get('plan')}, sharded checkpoint "
                     f"{r0.get('sharded_checkpoint')}, resumed from step {r0.get('resumed_from_step')}, samples/step "
                     f"{ref.get('samples_per_step')}, max rel diff vs one process {ref.get('max_rel_diff')} "
                     f"(unweighted: {ref.get('max_rel_diff_unweighted')}), {exact['wall_s']:.0f} s")
    big = results.get("big")
    if big:
        r0 = big["ranks"][0] or {}
        lines.append(f"big: rc {big['returncodes']}, {r0.get('parameters', 0) / 1e9:.2f}B parameters, losses "
                     f"{[round(x, 2) for x in r0.get('losses', [])]}, {big['wall_s']:.0f} s")
        for rank in range(2):
            r = big["ranks"][rank] or r0
            plan, est, peak = r.get("plan") or [None] * 2, r.get("estimate_gib") or [0] * 2, r.get("peak_gib") or [
                None] * 2
            peak_text = "n/a" if peak[rank] is None else f"{peak[rank]:.2f}"
            lines.append(f"  rank {rank}: plan {plan[rank]}, estimate {est[rank]:.2f} GiB, peak {peak_text} GiB")
    baseline = results.get("baseline")
    if baseline:
        outcomes = [(r or {}).get("outcome") for r in baseline["ranks"]]
        predicted = [f"{p['needed_gib']:.1f}/{p['cap_gib']:g} GiB" for p in baseline.get("prediction", [])]
        lines.append(f"baseline (Lightning FSDPStrategy, 2 + 2): rc {baseline['returncodes']}, outcomes {outcomes}, "
                     f"plan's estimate (keep, 2 samples) {predicted}, {baseline['wall_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--phases", default="exact,big,baseline")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--knobs", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # runs the launcher's clean-up
    if args.worker:
        # A rank killed by a signal leaves its Python stack in its log (both ranks of the exact phase once died of
        # SIGSEGV on GPUs in the whole-tensor gather after the fit: tests/gpu/repro_gloo_cuda_gather.py).
        _arm_crash_report()
        _worker(args.worker, args.out, args.accelerator, check_knobs(filter(None, args.knobs.split(","))),
                args.ckpt_dir)
    else:
        res = run_all(args.out, args.accelerator, tuple(args.phases.split(",")))
        print(summary(res))
