"""Exact gradients of a hybrid layout: one SUM all-reduce per pipeline stage, over the ranks that hold the stage.

Every replica weights its loss by its own share, b_replica / G (a data-parallel rank on its loss, a pipeline on each
micro-batch's loss, :func:`~lightning_hetero.grad.weighting.loss_weight` with one rank per replica), so the sum over
the holders of stage s's parameters is Σ_replicas (b / G) g: the gradient of one device on the global batch.
A data-parallel rank holds every stage and issues one all-reduce per stage group; a stage rank one, on its group.
The same groups re-broadcast the trained parameters when every rank needs the whole model (evaluation, the end of
training): a stage rank holds no values of the other stages' parameters.

With ``wire="bf16"`` (or ``"fp16"``) the exchange that crosses hosts is compressed, as hierarchical sync does for
the data-parallel strategy: each stage group sums in full precision inside every host, the hosts' leaders exchange
their sums cast to ``wire`` (:func:`~lightning_hetero.grad.compress_hooks.hierarchical_hook` with
:func:`~lightning_hetero.grad.compress_hooks.cast_hook`), and each leader broadcasts the result inside its host. A
stage group on one host stays exact.
"""

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_hetero.grad.bucket_state import CommCounter
from lightning_hetero.grad.compress_hooks import (CastState, FlatBucket, HierarchicalState, cast_hook,
                                                  hierarchical_hook)
from lightning_hetero.plan.layout import HybridLayout


class StageSync:
    """The stage groups of a :class:`~lightning_hetero.plan.layout.HybridLayout`, and which parameters each holds.

    ``groups`` is built on every rank in the same order (``dist.new_group`` is collective); ``partition`` (each
    stage's parameter names) is set once a pipeline has split the model (:meth:`share_partition`).
    """

    def __init__(self, layout: HybridLayout, rank: int, hosts: Optional[Sequence[str]] = None,
                 wire: Optional[str] = None) -> None:
        self.layout = layout
        self.rank = rank
        self.groups = [dist.new_group(list(layout.stage_members(s))) for s in range(layout.stages)]
        self.partition: Optional[list[list[str]]] = None
        self.counter = CommCounter()
        # Per stage: the two-level exchange's state where the stage group spans hosts and `wire` is set, else None.
        self.hops: list[Optional[HierarchicalState]] = [None] * layout.stages
        if wire is not None and hosts is not None:
            self.hops = [self._hop(layout.stage_members(s), hosts, wire) for s in range(layout.stages)]

    def _hop(self, members: Sequence[int], hosts: Sequence[str], wire: str) -> Optional[HierarchicalState]:
        """The stage group's hosts, each a full-precision group, and its leaders' group (collective: every rank
        builds every group, in the same order)."""
        by_host: dict[str, list[int]] = {}
        for r in members:
            by_host.setdefault(hosts[r], []).append(r)
        local = [dist.new_group(ranks) for ranks in by_host.values()]
        leaders = [ranks[0] for ranks in by_host.values()]
        leaders_group = dist.new_group(leaders) if len(leaders) > 1 else None
        if self.rank not in members or len(leaders) < 2:
            return None
        mine = next(i for i, ranks in enumerate(by_host.values()) if self.rank in ranks)
        inner = CastState(wire, leaders_group, self.counter, "inter")
        return HierarchicalState(local[mine], leaders[mine], leaders_group if self.rank in leaders else None,
                                 len(leaders), len(members), cast_hook, inner, self.counter)

    def share_partition(self, partition: Optional[list[list[str]]], module: nn.Module) -> None:
        """Every rank adopts the stage split of the first pipeline's first rank (a collective over all ranks); a
        trainable parameter in no stage, or in two, is refused (the exchange would miss or double it)."""
        box = [partition]
        dist.broadcast_object_list(box, src=self.layout.pipelines[0][0])
        stages = box[0]
        assert stages is not None
        named = [n for n, p in module.named_parameters() if p.requires_grad]
        placed = [n for names in stages for n in names]
        missing, twice = set(named) - set(placed), {n for n in placed if placed.count(n) > 1}
        if missing or twice:
            raise RuntimeError(f"the pipeline split left parameters {sorted(missing)} in no stage and "
                               f"{sorted(twice)} in two (tied weights across stages are not supported).")
        self.partition = stages

    def share_partition_once_split(self, partition: Optional[list[list[str]]], module: nn.Module,
                                   device: torch.device) -> bool:
        """:meth:`share_partition` as soon as a pipeline has split the model (its first trace, which releases the
        other stages' values on a stage rank), before any optimizer step; whether the split is known (a collective
        over all ranks)."""
        if self.partition is None:
            split = torch.tensor([float(partition is not None)], device=device)
            dist.all_reduce(split, op=dist.ReduceOp.MAX)
            if split.item() > 0:
                self.share_partition(partition, module)
        return self.partition is not None

    def _held(self) -> list[int]:
        stage = self.layout.stage_of(self.rank)
        return list(range(self.layout.stages)) if stage is None else [stage]

    def _params(self, module: nn.Module, stage: int) -> list[nn.Parameter]:
        assert self.partition is not None
        params = dict(module.named_parameters())
        return [params[n] for n in self.partition[stage]]

    def all_reduce_grads(self, module: nn.Module) -> None:
        """Sum each held stage's (pre-weighted) gradients over its group, in place; a gradient missing on some holders
        counts 0 there, one missing on every holder (a frozen or unused parameter) stays ``None``, as on one device
        (where e.g. AdamW then skips the parameter rather than decaying it)."""
        for stage in self._held():
            params = [p for p in self._params(module, stage) if p.requires_grad]
            if not params:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            # One presence flag per parameter rides in the same all-reduce (small counts: exact in any wire dtype).
            present = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype,
                                   device=grads[0].device)
            flat = torch.cat([g.reshape(-1) for g in grads] + [present])
            hop = self.hops[stage]
            if hop is None:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[stage])
            else:
                # The two-level hook averages over the group's ranks: times their count, the sum.
                flat = hierarchical_hook(hop, FlatBucket(flat)).wait().mul_(hop.world_size)
            _unflatten_into(flat, params, as_grad=True)
            for p, held in zip(params, flat[-len(params):].tolist()):
                if held < 0.5:
                    p.grad = None

    def grad_norm(self, module: nn.Module, device: torch.device) -> torch.Tensor:
        """The 2-norm of the whole model's (exchanged) gradients, on every rank (a collective over all ranks): each
        rank puts the squared norm of each stage it holds in that stage's slot, and a MAX over the world counts every
        stage once (its holders' gradients are equal after :meth:`all_reduce_grads`)."""
        squares = torch.zeros(self.layout.stages, dtype=torch.float32, device=device)
        for stage in self._held():
            grads = [p.grad for p in self._params(module, stage) if p.grad is not None]
            if grads:
                norms = torch.stack([torch.linalg.vector_norm(g).float() for g in grads])
                squares[stage] = norms.square().sum().to(device)
        dist.all_reduce(squares, op=dist.ReduceOp.MAX)
        return squares.sum().sqrt()

    def clip_grad_norm(self, module: nn.Module, params: Sequence[torch.Tensor], max_norm: float,
                       device: torch.device) -> None:
        """``torch.nn.utils.clip_grad_norm_`` of ``params``' gradients by the whole model's norm (:meth:`grad_norm`):
        a stage rank holds one stage's gradients, whose own norm would clip them less than one device does."""
        total = self.grad_norm(module, device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))

    def broadcast_params(self, module: nn.Module) -> None:
        """Every rank's whole model becomes the trained one: each stage's parameters from its holder (all ranks)."""
        for stage in range(self.layout.stages):
            params = self._params(module, stage)
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=self.layout.holder(stage))
            _unflatten_into(flat, params, as_grad=False)


def broadcast_buffers(module: nn.Module, src: int) -> None:
    """Every rank's buffers (running statistics, counters) become rank ``src``'s: with no DDP wrapper nothing else
    re-syncs them, and a stage rank's copies of the other stages' buffers never change (each tensor once)."""
    seen: set[int] = set()
    for buffer in module.buffers():
        if id(buffer) not in seen:
            seen.add(id(buffer))
            dist.broadcast(buffer, src=src)


def _unflatten_into(flat: torch.Tensor, params: Sequence[nn.Parameter], as_grad: bool) -> None:
    offset = 0
    for p in params:
        piece = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if as_grad:
            p.grad = piece.clone()
        else:
            with torch.no_grad():
                p.copy_(piece)
