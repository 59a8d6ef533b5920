"""Raw torch + gloo workers for the FSDP building blocks (no Lightning): fork-launched, one function per rank."""

import os
from itertools import pairwise
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_hetero.grad.sharding import device_mesh, set_gradient_sync, shard_module
from lightning_hetero.plan.blocks import default_blocks
from lightning_hetero.grad.weighting import loss_weight
from lightning_hetero.resilience.sharded import full_model_state, load_sharded, save_sharded


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 1))


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference(steps: list[list[int]], optimizer: str, accumulate: int = 1,
              equal_rank_weights: bool = False) -> dict[str, torch.Tensor]:
    """One process on the global batches (Lightning's accumulation: each micro-step's loss divided by the window).
    ``equal_rank_weights``: the mean of the ranks' mean losses instead, what unweighted FSDP computes."""
    model, (x, y), pos = make_model(), data(), 0
    opt = make_optimizer(optimizer, model.parameters())
    for i, shares in enumerate(steps):
        total = sum(shares)
        if equal_rank_weights:
            bounds = [pos + sum(shares[:r]) for r in range(len(shares) + 1)]
            loss = sum(nn.functional.mse_loss(model(x[a:b]), y[a:b]) for a, b in pairwise(bounds)) / len(
                shares)
        else:
            loss = nn.functional.mse_loss(model(x[pos:pos + total]), y[pos:pos + total])
        (loss / accumulate).backward()
        pos += total
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_sharded(rank: int, world: int, steps: list[list[int]], optimizer: str, checkpoint_rank: Optional[int],
                  offload_rank: Optional[int], accumulate: int = 1, start: int = 0, load: Optional[str] = None,
                  save: Optional[str] = None, hosts: int = 1) -> dict[str, list]:
    """Rank ``rank`` of ``world`` trains its slice of each global batch with the loss weighted by b_r · W / G.
    ``hosts`` > 1: the ranks pretend to sit on that many hosts (HSDP: shard inside a host, replicate across)."""
    per_host = world // hosts
    mesh = device_mesh({f"host{h}": list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)}, "cpu")
    assert mesh.ndim == (2 if hosts > 1 else 1)
    model = make_model()
    shard_module(model, mesh, default_blocks(model), checkpoint=rank == checkpoint_rank, offload=rank == offload_rank)
    opt = make_optimizer(optimizer, model.parameters())
    if load is not None:
        load_sharded(load, model, [opt])
    (x, y), pos = data(), sum(sum(s) for s in steps[:start])
    for i in range(start, len(steps)):
        shares = steps[i]
        begin, count, total = pos + sum(shares[:rank]), shares[rank], sum(shares)
        pos += total
        last = (i + 1) % accumulate == 0
        set_gradient_sync(model, last)
        rows = slice(begin, begin + max(count, 1))  # a rank without samples pads with one at weight 0
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        (loss * loss_weight(count, total, world) / accumulate).backward()
        if last:
            opt.step()
            opt.zero_grad()
        if save is not None and i + 1 == len(steps) // 2:
            save_sharded(save, {"step": i + 1}, model, [opt], rank, dist.barrier)
    return {k: v.tolist() for k, v in full_model_state(model).items()}


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], queue: Any, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(rank, world, **kwargs)))
    except BaseException as err:  # the parent reports it instead of waiting forever
        queue.put((rank, err))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, port: int, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
    """Fork ``world`` ranks running ``fn(rank, world, **kwargs)``; their results by rank (plain Python values)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, queue, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value = queue.get(timeout=120)
            if isinstance(value, BaseException):
                raise RuntimeError(f"rank {rank} failed: {value!r}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
