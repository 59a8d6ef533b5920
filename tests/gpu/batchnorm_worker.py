"""BatchNorm under uneven shares on CUDA, against one process on the same GPU: ``Trainer(sync_batchnorm=True)`` with
both strategies, and torch's own ``SyncBatchNorm`` checked with unequal per-rank counts.

    python tests/gpu/batchnorm_worker.py --out DIR --mode shared   # 2 ranks on cuda:0 (gloo), shares [3, 1]
    python tests/gpu/batchnorm_worker.py --out DIR --mode nccl     # 2 GPUs (NCCL), shares [3, 1]

Writes ``DIR/result.json``: per strategy, the largest relative parameter difference over all steps and the largest
buffer difference (running_mean, running_var, num_batches_tracked) against one process, synced and not, and synced
under FSDP with rank 0 recomputing its BatchNorm blocks (activation checkpointing on CUDA's autograd threads); with
``nccl`` also torch's ``SyncBatchNorm`` on 6 + 2 samples against ``BatchNorm2d`` on all 8.
"""

import argparse
import json
import os
import sys
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

# fp32 means fp32: cuDNN's convolutions default to TF32 on Ampere and later.
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False

from tests.grad.test_batchnorm import BatchNormModel, BlockNormModel  # noqa: E402
from tests.helpers import fit_distributed, max_rel_diff, reference_run  # noqa: E402

CAPACITIES, EPOCHS = [3, 1], 2


def fit(out: str, strategy_class: type, sync: bool, shared: bool, memory: Any = None) -> tuple[list[dict], Any]:
    """A fit on CUDA at [3, 1] (the fork launcher: CUDA starts in the ranks only) and the untrained copy of its model."""
    import copy

    from lightning.pytorch import seed_everything

    from lightning_hetero.lab.shared_gpu import one_gpu

    seed_everything(0)
    model = BatchNormModel(n=53) if memory is None else BlockNormModel(n=53)
    reference = copy.deepcopy(model)
    name = f"{strategy_class.__name__}-{'sync' if sync else 'plain'}{'-memory' if memory else ''}"
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    # Two ranks on one GPU: gloo, no device binding (lightning_hetero.lab.shared_gpu).
    extra = {"parallel_devices": one_gpu(2), "process_group_backend": "gloo"} if shared else {}
    if memory is not None:
        extra["memory"] = memory
    records = fit_distributed(model, folder, 2, {"capacities": CAPACITIES, **extra}, max_epochs=EPOCHS,
                              strategy_class=strategy_class, sync_batchnorm=sync, accelerator="gpu",
                              devices=1 if shared else 2)
    return records, reference


def against_one_process(records: list[dict], reference: Any) -> dict[str, Any]:
    """One process on the same GPU and global batches (run after every fit: the parent may not start CUDA before)."""
    reference.cuda()
    ref_params, _ = reference_run(reference, 2, CAPACITIES, EPOCHS)
    params = max(max_rel_diff(records[0]["params"][s], expected) for s, expected in enumerate(ref_params))
    buffers = max(float((r["buffers"][name].double() - b.double().cpu()).abs().max())
                  for r in records for name, b in reference.named_buffers())
    return {"steps": [r["steps"] for r in records], "reference_steps": len(ref_params), "params": params,
            "buffers": buffers}


def _torch_sync_batchnorm_rank(rank: int, port: int, out: Any) -> None:
    """torch's SyncBatchNorm over NCCL, 6 + 2 samples, against BatchNorm2d on all 8 (loss scaled by b_r·W/G)."""
    import copy

    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=2)
        torch.cuda.set_device(rank)
        counts = [6, 2]
        torch.manual_seed(0)
        x = (torch.randn(8, 3, 4, 4) * 3 + 5).cuda()
        probe = torch.randn(8, 3, 4, 4).cuda()
        reference = torch.nn.BatchNorm2d(3).cuda()
        torch.nn.init.uniform_(reference.weight)
        layer = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(copy.deepcopy(reference)))[0]
        x_ref = x.clone().requires_grad_()
        y_ref = reference(x_ref)
        ((y_ref * probe).sum() / 8).backward()
        mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
        x_mine = x[mine].clone().requires_grad_()
        y = layer(x_mine)
        ((y * probe[mine]).sum() / counts[rank] * counts[rank] * 2 / 8).backward()
        grad = layer.weight.grad / 2
        dist.all_reduce(grad)
        errors = {
            "forward": float((y - y_ref[mine]).abs().max()),
            "input grad": float((x_mine.grad / 2 - x_ref.grad[mine]).abs().max()),
            "weight grad": float((grad - reference.weight.grad).abs().max()),
            "running_mean": float((layer.running_mean - reference.running_mean).abs().max()),
            "running_var": float((layer.running_var - reference.running_var).abs().max()),
        }
        out.put((rank, errors))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def torch_sync_batchnorm() -> dict[str, Any]:
    import multiprocessing

    from tests.helpers import free_port

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_torch_sync_batchnorm_rank, args=(r, port, queue)) for r in range(2)]
    for p in processes:
        p.start()
    results = dict(queue.get(timeout=300) for _ in processes)
    for p in processes:
        p.join(timeout=60)
    return {str(rank): result for rank, result in sorted(results.items())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("shared", "nccl"), default="shared")
    args = parser.parse_args()
    from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy

    result: dict[str, Any] = {"mode": args.mode, "runs": {}}
    fits = {}
    # Two ranks sharing one GPU through gloo: DDP only. FSDP2 over gloo with CUDA tensors in fork-launched ranks
    # dies with SIGSEGV on torch 2.11 (with and without BatchNorm sync); the NCCL mode checks the sharded path.
    strategies = (HeteroDDPStrategy,) if args.mode == "shared" else (HeteroDDPStrategy, HeteroFSDPStrategy)
    for strategy_class in strategies:
        for sync in (True, False):
            key = f"{strategy_class.__name__} sync={sync}"
            try:
                fits[key] = fit(args.out, strategy_class, sync, shared=args.mode == "shared")
            except Exception:
                result["runs"][key] = {"error": traceback.format_exc()[-4000:]}
    key = "HeteroFSDPStrategy sync=True checkpoint rank 0"
    if args.mode == "nccl":
        try:
            fits[key] = fit(args.out, HeteroFSDPStrategy, True, shared=False,
                            memory={"rank:0": "checkpoint", "*": "keep"})
        except Exception:
            result["runs"][key] = {"error": traceback.format_exc()[-4000:]}
    for key, (records, reference) in fits.items():
        try:
            result["runs"][key] = against_one_process(records, reference)
        except Exception:
            result["runs"][key] = {"error": traceback.format_exc()[-4000:]}
    if args.mode == "nccl":
        result["torch_sync_batchnorm"] = torch_sync_batchnorm()
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
