"""Exact gradients of a hybrid layout: one SUM all-reduce per pipeline stage, over the ranks that hold the stage.

Every replica weights its loss by its own share, b_replica / G (a data-parallel rank on its loss, a pipeline on each
micro-batch's loss, :func:`~lightning_hetero.grad.weighting.loss_weight` with one rank per replica), so the sum over
the holders of stage s's parameters is Σ_replicas (b / G) g: the gradient of one device on the global batch.
A data-parallel rank holds every stage and issues one all-reduce per stage group; a stage rank one, on its group.
The same groups re-broadcast the trained parameters when every rank needs the whole model (evaluation, the end of
training): a stage rank holds no values of the other stages' parameters.

With ``compression`` (a cast, PowerSGD or top-k, :mod:`~lightning_hetero.grad.stage_compression`) the exchange that
crosses hosts is compressed, as hierarchical sync does for the data-parallel strategy: each stage group sums in full
precision inside every host, the hosts' leaders exchange their sums compressed
(:func:`~lightning_hetero.grad.compress_hooks.hierarchical_hook`, its inner hook one state per stage), and each
leader broadcasts the result inside its host, so every holder of a stage gets the same bits. A stage group on one
host stays exact.

The exchange may overlap the backward that precedes an optimizer step (:meth:`StageSync.overlapped`; the strategy
decides when, :mod:`~lightning_hetero.strategies.stage_exchange`): a data-parallel
rank starts stage s's all-reduce (async) as soon as every trainable parameter of stage s has accumulated its gradient
(backward reaches the last stage first, so stage S-1's exchange runs beside the backward of stages S-2..0); a stage
rank starts its one all-reduce as Lightning's backward returns (its pipeline's backward ran in the training step).
The optimizer step waits for them and exchanges the rest as before. Why no group can deadlock:

- each stage group still sees exactly one all-reduce per step from each member, of one size and dtype (every
  trainable parameter of the stage plus its presence flags, :func:`_flat`), early or late: ranks may decide
  differently (a rank where a parameter got no gradient exchanges that stage late), the collective is the same;
- every rank issues its stage exchanges in descending stage order, early or late: a stage starts early only once
  every stage above it has (the early ones are a top prefix, the late ones follow in the same order), so two ranks
  sharing two stage groups (data-parallel ranks) never issue them in opposite orders; a stage rank is in one
  stage group only, and issues its exchange after the training step's collectives, as a data-parallel rank does;
- a stage exchanged across hosts with compression stays late (its two-level exchange waits as it goes).

A change made to the gradients after the backward (``on_after_backward``) would be lost on a stage exchanged early:
the strategy keeps the exchange late when such a hook exists.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_hetero.grad.bucket_state import CommCounter, nbytes
from lightning_hetero.grad.compress_hooks import FlatBucket, HierarchicalState, hierarchical_hook
from lightning_hetero.grad.stage_compression import StageCompressionConfig, leaders_exchange
from lightning_hetero.plan.layout import HybridLayout


class StageSync:
    """The stage groups of a :class:`~lightning_hetero.plan.layout.HybridLayout`, and which parameters each holds.

    ``groups`` is built on every rank in the same order (``dist.new_group`` is collective); ``partition`` (each
    stage's parameter names) is set once a pipeline has split the model (:meth:`share_partition`).
    """

    def __init__(self, layout: HybridLayout, rank: int, hosts: Optional[Sequence[str]] = None,
                 compression: Optional[StageCompressionConfig] = None) -> None:
        self.layout = layout
        self.rank = rank
        self.groups = [dist.new_group(list(layout.stage_members(s))) for s in range(layout.stages)]
        self.partition: Optional[list[list[str]]] = None
        self.counter = CommCounter()
        self.compression = compression
        # Bytes this rank handed to the last step's exchange (its stage buffers, or the two-level hops' wire bytes),
        # in all and by hop ("all", "intra", "inter").
        self.bytes_last_step: Optional[int] = None
        self.bytes_by_hop_last_step: dict[str, int] = {}
        # Per stage: the two-level exchange's state where the stage group spans hosts and `compression` is set,
        # else None.
        self.hops: list[Optional[HierarchicalState]] = [None] * layout.stages
        if compression is not None and hosts is not None:
            self.hops = [self._hop(layout.stage_members(s), hosts, compression) for s in range(layout.stages)]
        # Whether this fit's exchanges may begin during the backward (the same on every rank: the strategy agrees
        # it); without, none is begun early and they run in ascending stage order.
        self.overlap = False
        # The exchanges begun during the backward, by stage: (work, flat buffer, its parameters).
        self._early: dict[int, tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = {}
        # While a backward is overlapped: the next stage to begin (descending), each stage's trainable parameters and
        # those still without this backward's gradient (ids); `_next` is None otherwise.
        self._next: Optional[int] = None
        self._trainable: dict[int, list[nn.Parameter]] = {}
        self._missing: dict[int, set[int]] = {}
        self._hooked: set[int] = set()

    @property
    def compresses(self) -> bool:
        """Whether this rank's exchange of some stage is compressed (its group spans hosts, ``compression`` set)."""
        return any(hop is not None for hop in self.hops)

    def _hop(self, members: Sequence[int], hosts: Sequence[str],
             compression: StageCompressionConfig) -> Optional[HierarchicalState]:
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
        hook, inner = leaders_exchange(compression, leaders_group, self.counter)
        return HierarchicalState(local[mine], leaders[mine], leaders_group if self.rank in leaders else None,
                                 len(leaders), len(members), hook, inner, self.counter)

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

    def _trainable_params(self, module: nn.Module, stage: int) -> list[nn.Parameter]:
        return [p for p in self._params(module, stage) if p.requires_grad]

    @contextmanager
    def overlapped(self, module: nn.Module) -> Iterator[None]:
        """Around the backward that precedes an optimizer step (once the stage split is shared): each held stage's
        exchange begins as soon as its gradients are complete, in descending stage order (see the module docstring);
        :meth:`all_reduce_grads` waits for them. A data-parallel rank counts each stage's gradients as autograd
        accumulates them; a stage rank's gradients are complete when the backward returns."""
        assert self.overlap, "overlapped() needs `overlap` (agreed by every rank)"
        stage_rank = self.layout.stage_of(self.rank) is not None
        self._early, self._next = {}, max(self._held())
        self._trainable = {s: self._trainable_params(module, s) for s in self._held()}
        self._missing = {s: {id(p) for p in params} for s, params in self._trainable.items()}
        if not stage_rank:
            for stage, params in self._trainable.items():
                for p in params:
                    if id(p) not in self._hooked:
                        self._hooked.add(id(p))
                        p.register_post_accumulate_grad_hook(partial(self._arrived, stage))
        self._begin_complete()  # stages without trainable parameters
        try:
            yield
            # Not on an error: a backward that raised begins no collective the other ranks would not match.
            if stage_rank:
                for stage, params in self._trainable.items():
                    self._missing[stage] = {id(p) for p in params if p.grad is None}
                self._begin_complete()
        finally:
            self._next = None

    def _arrived(self, stage: int, param: nn.Parameter) -> None:
        if self._next is None:
            return
        if stage in self._early:
            # Its exchange already took the gradient: the other holders expect no second one.
            raise RuntimeError(f"a parameter of pipeline stage {stage} received a second gradient in one backward, "
                               "after the stage's exchange began (a parameter used in two reentrant checkpointed "
                               "segments?): use `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, or "
                               "exchange after the backward with `HeteroHybridStrategy(overlap_stage_exchange=False)`.")
        self._missing[stage].discard(id(param))
        self._begin_complete()

    def _begin_complete(self) -> None:
        """Begin each stage from `_next` down whose gradients are all here, stopping at the first that is not (or
        whose exchange crosses hosts compressed): the early exchanges stay a top prefix of the stages."""
        while self._next in self._missing and not self._missing[self._next] and self.hops[self._next] is None:
            stage, params = self._next, self._trainable[self._next]
            if params:
                with torch.no_grad():
                    flat = _flat(params)
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[stage], async_op=True)
                self._early[stage] = (work, flat, params)
            self._next -= 1

    def all_reduce_grads(self, module: nn.Module) -> None:
        """Sum each held stage's (pre-weighted) gradients over its group, in place; a gradient missing on some holders
        counts 0 there, one missing on every holder (a frozen or unused parameter) stays ``None``, as on one device
        (where e.g. AdamW then skips the parameter rather than decaying it). Stages begun during the backward
        (:meth:`overlapped`) are waited for; the others are exchanged now, in the same descending order (ascending
        without `overlap`: every rank's are all late). :attr:`bytes_last_step` counts what this rank handed them."""
        early, self._early, self._next = self._early, {}, None
        for stage in sorted(self._held(), reverse=self.overlap):
            if stage in early:
                work, flat, params = early[stage]
                self.counter.add("all", nbytes(flat))
                work.wait()
                if flat.is_cuda:
                    # Made on the backward's stream, read and freed on this one: not reused before that.
                    flat.record_stream(torch.cuda.current_stream(flat.device))
            else:
                params = self._trainable_params(module, stage)
                if not params:
                    continue
                flat = _flat(params)
                hop = self.hops[stage]
                if hop is None:
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[stage])
                    self.counter.add("all", nbytes(flat))
                else:
                    # The two-level hook averages over the group's ranks: times their count, the sum.
                    flat = hierarchical_hook(hop, FlatBucket(flat, params)).wait().mul_(hop.world_size)
            _unflatten_into(flat, params, as_grad=True)
            for p, held in zip(params, flat[-len(params):].tolist()):
                if held < 0.5:
                    p.grad = None
        self.bytes_by_hop_last_step = self.counter.take()
        self.bytes_last_step = sum(self.bytes_by_hop_last_step.values())

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


def _flat(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """The stage's gradients (zeros where missing) and one presence flag per parameter, in one buffer: the same size
    and dtype on every holder of the stage, whatever it holds (small counts: exact in any wire dtype)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flags = [float(p.grad is not None) for p in params]
    dtype, device = grads[0].dtype, grads[0].device
    # All present (every early exchange): made on the device, as a tensor from a list would wait for the CUDA stream,
    # stalling the backward's kernel launches.
    present = torch.ones(len(flags), dtype=dtype, device=device) if all(flags) else torch.tensor(
        flags, dtype=dtype, device=device)
    return torch.cat([g.reshape(-1) for g in grads] + [present])


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
