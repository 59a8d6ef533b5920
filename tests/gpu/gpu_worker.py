"""GPU checks run as a standalone script (Lightning's launchers re-execute or pickle ``__main__``; pytest must not be
that ``__main__``). Writes ``result.json`` to ``--out``; tests/gpu/test_gpu_lab.py asserts on it.

    python tests/gpu/gpu_worker.py equivalence --out DIR [--emulate]   # 2 GPUs, capacities [3, 1], fp32, NCCL
    python tests/gpu/gpu_worker.py equivalence --out DIR --micro       # the same, rank 0 in 3 micro-batches
    python tests/gpu/gpu_worker.py equivalence --out DIR --sharded     # the same under HeteroFSDPStrategy (FSDP2)
    python tests/gpu/gpu_worker.py hybrid --out DIR                    # 4 GPUs: 2 data-parallel + a 2-stage pipeline
    python tests/gpu/gpu_worker.py hybrid_eval --out DIR               # the same, validation through the pipeline
    python tests/gpu/gpu_worker.py hybrid_compressed --out DIR --stage-compression topk   # hosts emulated 2 + 2
    python tests/gpu/gpu_worker.py cap --out DIR                       # 1 GPU: green-context cap on training steps
"""

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy, HeteroHybridStrategy  # noqa: E402
from tests.helpers import Recorder, TinyModel, max_rel_diff, reference_run  # noqa: E402

# Exact fp32 for the equivalence check (module level: the spawned ranks import this file too).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")


def equivalence(out: str, emulate: bool, accelerator: str = "gpu", micro: bool = False,
                sharded: bool = False) -> dict[str, Any]:
    """2 ranks with batches split [3, 1] vs one process on the global batch (on the CPU, in fp32).

    ``micro``: at most 4 samples per forward/backward, so rank 0 runs its 12 as 3 micro-batches under ``no_sync``.
    ``sharded``: the same under HeteroFSDPStrategy (FSDP2 over NCCL: reduce-scatter of the weighted gradients).
    """
    capacities, epochs = [3.0, 1.0], 3
    seed_everything(0)
    model = TinyModel("sgd", batch_size=8, n=96)
    reference = copy.deepcopy(model)
    # Emulated: rank 1 at a quarter of the SMs on a PCIe-class link; its steps run on the green context's stream,
    # so this also checks the stream hand-offs (a missing wait would corrupt or race the results).
    profile = {"sm_share": 0.25, "link": "pcie"} if accelerator == "gpu" else {"slowdown": 2.0}
    strategy_class = HeteroFSDPStrategy if sharded else HeteroDDPStrategy
    strategy = strategy_class(capacities=capacities, start_method="spawn", resilience={"timeout": 300},
                                 emulate=[None, profile] if emulate else None,
                                 data={"micro_batch": 4 if micro else None})
    trainer = Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=epochs, precision="32-true",
                      callbacks=[Recorder(out)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model)
    records = [torch.load(os.path.join(out, f"rank{r}.pt"), map_location="cpu") for r in range(2)]
    ref_params, ref_batches = reference_run(reference, 2, capacities, epochs)
    steps = min(len(records[0]["params"]), len(records[1]["params"]))
    identical = [bool(torch.equal(records[0]["params"][i], records[1]["params"][i])) for i in range(steps)]
    diffs = [max_rel_diff(records[0]["params"][i], ref_params[i]) for i in range(min(steps, len(ref_params)))]
    sizes = [[len(records[r]["indices"][i]) for r in range(2)] for i in range(steps)]
    same_batches = [sorted(records[0]["indices"][i] + records[1]["indices"][i]) == sorted(ref_batches[i])
                    for i in range(min(steps, len(ref_batches)))]
    return {
        "emulate": emulate, "micro": micro, "sharded": sharded, "steps": [len(r["params"]) for r in records], "reference_steps": len(ref_params),
        "replicas_identical_every_step": all(identical), "max_rel_diff": max(diffs), "per_step_rel_diff": diffs,
        "batch_sizes": sizes[:4], "same_global_batches": all(same_batches),
    }


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class MatmulNet(LightningModule):
    """Matmul-bound training step: SM count decides its speed."""

    def __init__(self, width: int = 4096, depth: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(depth)))
        self.width = width

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = torch.randn(len(batch), self.width, device=self.device)
        return self.net(x).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class _StepTimer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.t0, self.t1, self.steps = warmup, 0.0, 0.0, 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            torch.cuda.synchronize()
            self.t1 = time.perf_counter()
            self.steps = batch_idx + 1 - self.warmup


def _step_seconds(emulate: Any, warmup: int = 3, steps: int = 8, batch: int = 8192) -> tuple[float, str]:
    # ~6.6 TFLOP per step: ~10 ms on a whole H200, far above Lightning's per-step overhead
    seed_everything(0)
    strategy = HeteroDDPStrategy(capacities="equal", emulate=emulate, resilience={"timeout": 300})
    timer = _StepTimer(warmup)
    trainer = Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed",
                      max_steps=warmup + steps, callbacks=[timer], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(_Indices(batch * (warmup + steps + 1)), batch_size=batch)
    trainer.fit(MatmulNet(), train_dataloaders=loader)
    summary = dict(strategy.lab.columns).get("emulated", ["-"])[0]
    return (timer.t1 - timer.t0) / timer.steps, summary


def cap(out: str) -> dict[str, Any]:
    """Training-step time (forward + backward + optimizer, through Lightning) with all SMs vs a green context."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    full, _ = _step_seconds(None)
    quarter, summary = _step_seconds([{"sm_share": 0.25}])
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "sms": sms, "full_step_s": full,
                              "quarter_step_s": quarter, "slowdown": quarter / full, "summary": summary}
    # memory cap: a 4 GiB profile cannot hold 6 GiB (last: the cap stays for the rest of the process)
    from lightning_hetero.lab.devices import describe_device
    from lightning_hetero.lab.emulation import start_emulation
    from lightning_hetero.lab.emulation_spec import parse_emulate

    device = torch.device("cuda", 0)
    import gc

    gc.collect()
    torch.cuda.empty_cache()  # the fits' cached blocks would count against the cap
    emulator = start_emulation(parse_emulate([{"memory_gib": 4}]), 0, 1, describe_device(device, 0), device)
    emulator.activate()
    try:
        torch.empty(6 * 2**30, dtype=torch.uint8, device=device)
        result["memory_cap_holds"] = False
    except torch.OutOfMemoryError:
        result["memory_cap_holds"] = True
    small = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)  # below the cap: fine
    result["below_cap_ok"] = small.numel() == 2 * 2**30
    emulator.restore()
    return result


def hybrid(out: str, accelerator: str = "gpu") -> dict[str, Any]:
    """4 ranks: 0 and 1 data-parallel, 2 and 3 one 2-stage pipelined replica (P2P activations over NCCL), capacities
    [3, 2, 1, 1], AdamW, fp32, vs one process on the global batches (tests/strategies/test_hybrid.py on GPUs)."""
    from tests.strategies.test_hybrid import Chain, NamedRecorder

    world, pipelines, capacities, epochs = 4, [[2, 3]], [3.0, 2.0, 1.0, 1.0], 2
    seed_everything(0)
    model = Chain(optimizer="adamw", n=53, batch_size=4)
    reference = copy.deepcopy(model)
    # The overlapped stage exchange (async all-reduces begun from autograd's hooks): the path to check on CUDA streams.
    _fit_hybrid(model, accelerator, world, pipelines, capacities, epochs, [NamedRecorder(out)],
                {"overlap_stage_exchange": True})
    records = [torch.load(os.path.join(out, f"rank{r}.pt"), map_location="cpu") for r in range(world)]
    ref_params, ref_batches = reference_run(reference, world, capacities, epochs)
    flat = [[torch.cat([t.reshape(-1) for t in step.values()]) for step in rec["params"]] for rec in records]
    steps = min(len(f) for f in flat)
    replicas_identical = all(torch.equal(flat[0][i], flat[1][i]) for i in range(steps))
    stages_equal = all(torch.equal(records[r]["params"][i][name], records[0]["params"][i][name])
                       for r in (2, 3) for i in range(steps) for name in records[r]["owned"])
    # Sets: a stage rank whose slice of its pipeline's share is empty loads a padding sample (not trained on twice).
    same_batches = all({i for rec in records for i in rec["indices"][k]} == set(ref_batches[k])
                       for k in range(min(steps, len(ref_batches))))
    diffs = [max_rel_diff(flat[0][i], ref_params[i]) for i in range(min(steps, len(ref_params)))]
    return {"steps": [len(f) for f in flat], "reference_steps": len(ref_params),
            "owned": [records[r]["owned"] for r in (2, 3)], "replicas_identical_every_step": replicas_identical,
            "stages_equal_replicas": stages_equal, "same_global_batches": same_batches,
            "max_rel_diff": max(diffs), "per_step_rel_diff": diffs}


def hybrid_eval(out: str, accelerator: str = "gpu") -> dict[str, Any]:
    """The hybrid case with ``pipelined_evaluation=True`` and a validation set of 23 samples: each epoch's
    ``val_loss`` on every rank vs one process's, a stage rank's parameter bytes at every validation batch vs its
    stage's, and training vs one process (tests/strategies/test_hybrid.py's pipelined validation on GPUs)."""
    from tests.helpers import IndexedDataset
    from tests.strategies.test_hybrid import NamedRecorder, PipelineValidated, ValidationHeld

    world, pipelines, capacities, epochs, val_n = 4, [[2, 3]], [3.0, 2.0, 1.0, 1.0], 2, 23
    seed_everything(0)
    model = PipelineValidated(val_n=val_n, optimizer="adamw", n=53, batch_size=4)
    reference = copy.deepcopy(model)
    _fit_hybrid(model, accelerator, world, pipelines, capacities, epochs, [NamedRecorder(out), ValidationHeld(out)],
                {"pipelined_evaluation": True}, sanity_steps=1)
    records = [torch.load(os.path.join(out, f"rank{r}.pt"), map_location="cpu") for r in range(world)]
    validations = [torch.load(os.path.join(out, f"val{r}.pt"), map_location="cpu") for r in range(world)]
    ref_params, _ = reference_run(reference, world, capacities, epochs)
    flat = torch.cat([t.reshape(-1) for t in records[0]["params"][-1].values()])
    dataset, probe, expected = IndexedDataset(val_n, seed=1), copy.deepcopy(reference), []
    per_epoch = len(ref_params) // epochs
    for epoch in range(epochs):
        nn.utils.vector_to_parameters(ref_params[(epoch + 1) * per_epoch - 1], probe.parameters())
        expected.append(float(probe.loss((dataset.x, dataset.y, torch.arange(val_n))).detach()))
    # The last `epochs` values: the first is the sanity check's.
    val_diff = max(abs(v[-epochs:][e] - expected[e]) / max(1.0, abs(expected[e]))
                   for v in (x["values"] for x in validations) for e in range(epochs))
    own = {r: sum(records[r]["bytes"][n] for n in records[r]["owned"]) for r in (2, 3)}
    return {"steps": len(records[0]["params"]), "reference_steps": len(ref_params),
            "train_max_rel_diff": max_rel_diff(flat, ref_params[-1]), "expected_val_loss": expected,
            "val_loss": [x["values"] for x in validations], "val_max_rel_diff": val_diff,
            "stage_own_bytes": [own[r] for r in (2, 3)],
            "stage_held_bytes_at_validation": [sorted(set(validations[r]["held"])) for r in (2, 3)],
            "whole_model_bytes": sum(records[2]["bytes"].values())}


def _fit_hybrid(model: Any, accelerator: str, world: int, pipelines: list, capacities: list, epochs: int,
                callbacks: list, options: dict[str, Any], sanity_steps: int = 0) -> None:
    """One fp32 fit of ``model`` under ``HeteroHybridStrategy`` (spawned ranks, ``options`` its case's own)."""
    strategy = HeteroHybridStrategy(pipelines=pipelines, capacities=capacities, start_method="spawn",
                                    resilience={"timeout": 300}, observation={"print_table": False}, **options)
    trainer = Trainer(accelerator=accelerator, devices=world, strategy=strategy, max_epochs=epochs,
                      precision="32-true", callbacks=callbacks, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=sanity_steps)
    trainer.fit(model)


def hybrid_compressed(out: str, method: str, accelerator: str = "gpu") -> dict[str, Any]:
    """The hybrid case on two emulated hosts (ranks 0, 1 and 2, 3) with ``stage_compression`` PowerSGD or top-k
    between them (NCCL, the two-level exchange on its side stream): every copy of a stage bit-identical, the
    whole-dataset loss vs the exact run's, the bytes rank 0 hands the hop between hosts
    (tests/strategies/test_hybrid_compression.py on GPUs)."""
    from lightning_hetero import PowerSGDCompression, TopKCompression
    from tests.strategies.test_hybrid import Chain, NamedRecorder
    from tests.strategies.test_hybrid_compression import HopBytes, full_loss

    config = {"powersgd": PowerSGDCompression(rank=1, start_iter=2, hierarchical=True),
              "topk": TopKCompression(ratio=0.1, hierarchical=True)}[method]
    world, pipelines, capacities, epochs = 4, [[2, 3]], [2.0, 1.0, 1.0, 1.0], 3
    seed_everything(0)
    model = Chain(optimizer="sgd", n=96, batch_size=4)
    initial = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    reference = copy.deepcopy(model)
    _fit_hybrid(model, accelerator, world, pipelines, capacities, epochs, [NamedRecorder(out), HopBytes(out)],
                {"stage_compression": config, "emulate": [{"host": h} for h in "aabb"]})
    records = [torch.load(os.path.join(out, f"rank{r}.pt"), map_location="cpu") for r in range(world)]
    hops = torch.load(os.path.join(out, "hops0.pt"))
    ref_params, _ = reference_run(reference, world, capacities, epochs)
    final = records[0]["final"]
    steps = min(len(rec["params"]) for rec in records)
    stages_equal = all(torch.equal(records[r]["params"][i][name], records[0]["params"][i][name])
                       for r in (2, 3) for i in range(steps) for name in records[r]["owned"])
    compressed = torch.cat([t.reshape(-1) for t in final.values()])
    start, exact, lossy = (full_loss(reference, flat) for flat in (initial, ref_params[-1], compressed))
    fp32 = (sum(t.numel() for t in final.values()) + len(final)) * 4
    return {"method": method, "steps": steps, "reference_steps": len(ref_params),
            "replicas_identical": all(torch.equal(records[1]["final"][n], t) for n, t in final.items()),
            "stages_equal_replicas": stages_equal, "loss_start": start, "loss_exact": exact, "loss_compressed": lossy,
            "loss_rel_to_exact": lossy / exact - 1, "inter_bytes_last_step": hops[-1].get("inter"),
            "fp32_stage_bytes": fp32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["equivalence", "hybrid", "hybrid_eval", "hybrid_compressed", "cap"])
    parser.add_argument("--stage-compression", default="topk", choices=["topk", "powersgd"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--emulate", action="store_true")
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--sharded", action="store_true", help="equivalence under HeteroFSDPStrategy")
    parser.add_argument("--accelerator", default="gpu", help="cpu: dry run of the equivalence case's own logic")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.case == "equivalence":
        result = equivalence(args.out, args.emulate, args.accelerator, args.micro, args.sharded)
    elif args.case == "hybrid":
        result = hybrid(args.out, args.accelerator)
    elif args.case == "hybrid_eval":
        result = hybrid_eval(args.out, args.accelerator)
    elif args.case == "hybrid_compressed":
        result = hybrid_compressed(args.out, args.stage_compression, args.accelerator)
    else:
        result = cap(args.out)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_step_rel_diff"}))


if __name__ == "__main__":
    main()
