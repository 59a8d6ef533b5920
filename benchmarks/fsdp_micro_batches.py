"""Per-card micro-batches under FSDP2: what keeping parameters gathered costs against padding, on CPU (gloo).

Two ranks split each global batch 3 : 1 and run 3 and 1 micro-batches. Three schemes, each checked against one
process on the same global batches:

- ``one``: every rank runs its share in one piece (the reference for collectives and memory);
- ``gathered`` (what the strategy does): the parameters are gathered at a rank's first forward and kept until its
  last backward (:func:`~lightning_hetero.grad.sharding.gathered_across_micro_batches`);
- ``padded``: every rank runs the largest count of pieces, a rank with fewer adding pieces of one sample at weight
  0; plain FSDP each piece (gather and reshard per piece), no reduce-scatter before the last.

Measured per optimizer step and rank: all-gathers and reduce-scatters (calls and elements), the most bytes of
gathered parameters and unsharded gradients held (sampled after each block's forward and after each forward and
backward), wall time (median step; CPU and gloo, so indicative only). Run::

    PYTHONPATH=. python benchmarks/fsdp_micro_batches.py --out benchmarks/results/fsdp_micro_batches.json
"""

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hetero.grad.sharding import (
    device_mesh,
    gathered_across_micro_batches,
    set_gradient_sync,
    shard_module,
)
from lightning_hetero.grad.weighting import loss_weight

SHARES = [6, 2]  # samples per step: the large rank 6, the small one 2
PIECES = [3, 1]  # micro-batches per step
STEPS = 8


class Model(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def make(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return Model(width, depth)


def batches(width: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randn(sum(SHARES), 16, generator=g), torch.randn(sum(SHARES), 1, generator=g)


@contextmanager
def counted() -> Iterator[dict[str, list[int]]]:
    """Every all-gather and reduce-scatter FSDP issues (whichever spelling this torch uses), by element count."""
    calls: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}
    saved = {}
    for kind, spellings in names.items():
        name = next(n for n in spellings if hasattr(dist, n))
        original = getattr(dist, name)

        def wrapper(output: torch.Tensor, *args: Any, _kind: str = kind, _original: Any = original,
                    **kwargs: Any) -> Any:
            calls[_kind].append(int(output.numel()))
            return _original(output, *args, **kwargs)

        saved[name] = original
        setattr(dist, name, wrapper)
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of parameters held whole and of their unsharded gradients (FSDP swaps a module's sharded DTensor for
    the gathered tensor while it computes)."""
    whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return sum(p.numel() * p.element_size() * (1 + (p.grad is not None)) for p in whole)


def rank_main(rank: int, world: int, scheme: str, width: int, depth: int) -> dict[str, Any]:
    model = make(width, depth)
    shard_module(model, device_mesh({"h": list(range(world))}, "cpu"), (nn.Sequential,), checkpoint=False,
                 offload=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    total, mine = sum(SHARES), SHARES[rank]
    begin = sum(SHARES[:rank])
    count = max(PIECES) if scheme == "padded" else (PIECES[rank] if scheme == "gathered" else 1)
    own = PIECES[rank] if scheme != "one" else 1
    held, times = 0, []

    def sample(*_: Any) -> None:
        nonlocal held
        held = max(held, gathered_bytes(model))

    for block in model.blocks:
        # Before FSDP's own post-forward hook reshards the block: the block's gathered parameters count.
        block.register_forward_hook(sample, prepend=True)
    with counted() as calls:
        for x, y in batches(width):
            start = time.perf_counter()
            xs, ys = x[begin:begin + mine], y[begin:begin + mine]
            bounds = [round(mine * j / own) for j in range(own + 1)]
            for j in range(count):
                last = j == count - 1
                padding = j >= own
                a, b = (0, 1) if padding else (bounds[j], bounds[j + 1])
                weight = 0.0 if padding else (b - a) / mine
                if scheme == "gathered" and not last:
                    context = gathered_across_micro_batches(model)
                else:
                    set_gradient_sync(model, last)
                    context = nullcontext()
                with context:
                    loss = nn.functional.mse_loss(model(xs[a:b]), ys[a:b]) * weight
                    sample()
                    (loss * loss_weight(mine, total, world)).backward()
                    sample()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}
    return {"params": {k: v.tolist() for k, v in full.items()}, "all_gathers": len(calls["all_gather"]) / STEPS,
            "all_gather_elements": sum(calls["all_gather"]) / STEPS,
            "reduce_scatters": len(calls["reduce_scatter"]) / STEPS,
            "reduce_scatter_elements": sum(calls["reduce_scatter"]) / STEPS, "held_bytes": held,
            "step_ms": 1000 * sorted(times)[len(times) // 2], "micro_batches": count}


def reference(width: int, depth: int) -> dict[str, torch.Tensor]:
    model = make(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for x, y in batches(width):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _entry(rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, rank_main(rank, world, *args)))
    except BaseException as err:
        queue.put((rank, repr(err)))
        raise
    finally:
        dist.destroy_process_group()


def run(scheme: str, width: int, depth: int, port: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, 2, port, queue, (scheme, width, depth))) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    if any(isinstance(v, str) for v in results.values()):
        raise RuntimeError(f"{scheme}: {results}")
    return [results[r] for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--schemes", nargs="+", default=["one", "gathered", "padded"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    # The ranks first: a parent that computed before forking can deadlock its children in OpenMP.
    runs = {scheme: run(scheme, args.width, args.depth, args.port + i) for i, scheme in enumerate(args.schemes)}
    expected = reference(args.width, args.depth)
    rows = []
    for scheme, ranks in runs.items():
        params = ranks[0].pop("params")
        assert params == ranks[1].pop("params"), f"{scheme}: replicas differ"
        error = max(float(((torch.tensor(params[k]) - v).abs().max() / v.abs().max()).item())
                    for k, v in expected.items())
        for rank, r in enumerate(ranks):
            rows.append({"scheme": scheme, "rank": rank, "max_rel_error": error, **r})
    header = ("scheme", "rank", "micro_batches", "all_gathers", "reduce_scatters", "all_gather_elements",
              "held_bytes", "step_ms", "max_rel_error")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[h]:.3g}" if isinstance(row[h], float) else str(row[h]) for h in header))
    if args.out:
        meta = {"torch": torch.__version__, "device": "cpu (gloo), 2 processes", "width": args.width,
                "depth": args.depth, "shares": SHARES, "pieces": PIECES, "steps": STEPS}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
