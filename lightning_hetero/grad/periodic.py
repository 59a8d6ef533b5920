"""Periodic cross-host sync (local SGD / DiLoCo): exact inside each host every step, hosts combined every H steps.

Inside a host, DDP runs on the host's process group and the weighting hook sums; rank r's loss is scaled by
b_r / B_host (B_host: the host's samples of the global batch), so each host trains exactly like one device on its
share of every global batch. Nothing crosses hosts per step. Every ``every`` optimizer steps the hosts combine their
parameter deltas since the last outer step, Δ_h = θ_0 − θ_h, weighted by the samples each host trained on in the
period (S_h / S):

    Δ = Σ_h (S_h / S) · Δ_h,  then one outer optimizer step on θ_0 with Δ as its gradient.

``outer="average"``: θ ← θ_0 − Δ = Σ_h (S_h / S) · θ_h (local SGD, weighted). ``outer="nesterov"``: SGD with Nesterov
momentum on θ_0 (DiLoCo's outer optimizer). With ``every=1``, ``"average"`` and plain SGD this *is* exact sync:
Σ_h (B_h / G)(θ_0 − η g_h) = θ_0 − η Σ_r (b_r / G) g_r. Inner optimizer state (momentum, Adam moments) stays per
host, as in local SGD and DiLoCo.

Only the first rank of each host ("leader") sends over the link between hosts; it broadcasts the combined delta
inside its host, so replicas stay bit-identical and every rank takes the same outer step. With ``overlap`` the
leaders' exchange is asynchronous: the next inner step trains while it crosses the link, and the outer update is
applied after that step, on top of the step's own progress (Streaming DiLoCo's overlap with a delay of one step).

torch's ``PeriodicModelAverager`` / ``HierarchicalModelAverager`` average parameters with equal weights (a host that
trained on three times the samples would count the same) and have no outer optimizer, so the weighting is written
here and the outer step is torch's ``SGD``.

Example::

    strategy = HeteroDDPStrategy(periodic_sync=PeriodicSync(every=32, outer="nesterov", outer_lr=0.7))
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_hetero.config import check, is_int, is_number
from lightning_hetero.grad.compression_config import CastCompression, NoCompression
from lightning_hetero.grad.weighting import WeightingState
from lightning_hetero.lab.groups import HeteroLab, LabGroups
from lightning_hetero.view import running_strategy

OuterName = Literal["average", "nesterov"]


@dataclass(frozen=True, kw_only=True)
class PeriodicSync:
    """Sync hosts every ``every`` optimizer steps (exact sync inside each host every step).

    Args:
        every: optimizer steps between outer steps (H).
        outer: ``"average"`` (θ ← sample-weighted mean of the hosts' parameters) or ``"nesterov"`` (DiLoCo: SGD with
            Nesterov momentum on the averaged delta).
        outer_lr: the outer learning rate (``"nesterov"`` only; ``"average"`` is a step of 1).
        outer_momentum: the outer Nesterov momentum (``"nesterov"`` only; 0: plain SGD on the delta).
        warmup_steps: optimizer steps of exact sync over all ranks before going periodic (as post-local SGD does).
        overlap: the exchange between hosts runs while the next inner step trains (Streaming DiLoCo's overlap, one
            step of delay): the outer update lands one step late, on top of that step's local progress, so the
            link's time hides behind compute; the hosts then never hold identical parameters.
    """

    every: int
    outer: OuterName = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    warmup_steps: int = 0
    overlap: bool = False

    def __post_init__(self) -> None:
        c = "PeriodicSync"
        check(c, "every", self.every, is_int(self.every) and self.every >= 1,
               "a positive integer (optimizer steps between outer steps)")
        check(c, "outer", self.outer, self.outer in ("average", "nesterov"), '"average" or "nesterov"')
        check(c, "outer_lr", self.outer_lr, is_number(self.outer_lr) and self.outer_lr > 0, "a positive finite number")
        check(c, "outer_momentum", self.outer_momentum,
               is_number(self.outer_momentum) and 0 <= self.outer_momentum < 1, "a number in [0, 1)")
        check(c, "warmup_steps", self.warmup_steps, is_int(self.warmup_steps) and self.warmup_steps >= 0,
               "a non-negative integer")
        check(c, "overlap", self.overlap, isinstance(self.overlap, bool), "True or False")

    def describe(self) -> str:
        outer = "average" if self.outer == "average" else f"nesterov lr {self.outer_lr:g} m {self.outer_momentum:g}"
        warmup = f", after {self.warmup_steps} exact" if self.warmup_steps else ""
        return f"every {self.every}{' overlapped' if self.overlap else ''}: {outer}{warmup}"


PeriodicSyncArg = Union[PeriodicSync, dict[str, Any]]


def parse_periodic_sync(value: Any) -> Optional[PeriodicSync]:
    """The typed config for ``periodic_sync`` (a :class:`PeriodicSync`, its fields as a dict, or ``None``)."""
    if value is None or isinstance(value, PeriodicSync):
        return value
    if isinstance(value, Mapping):
        accepted = [f.name for f in fields(PeriodicSync)]
        unknown = [k for k in value if k not in accepted]
        if unknown or "every" not in value:
            raise ValueError(f"`periodic_sync`={dict(value)!r}: keys must be among {accepted}, `every` required.")
        return PeriodicSync(**value)
    raise ValueError(f"`periodic_sync`={value!r} must be None, a PeriodicSync or a dict of its fields.")


_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def outer_wire_dtype(compression: Any) -> torch.dtype:
    """The dtype the hosts' deltas travel in: fp32, or the ``CastCompression`` dtype (the outer exchange's
    compression; inside a host gradients are always exact)."""
    if compression is None or isinstance(compression, NoCompression):
        return torch.float32
    if isinstance(compression, CastCompression):
        return _WIRE_DTYPES[compression.dtype]
    raise ValueError(
        f"`compression`={compression!r} with `periodic_sync`: the outer exchange takes 'none', 'fp16' or 'bf16' "
        "(a NoCompression or CastCompression)."
    )


class PeriodicCrossHostSync:
    """One rank's side of periodic cross-host sync; the strategy calls it at fixed points.

    1. :meth:`setup` once the process groups exist (one host: a warning, and it stays inactive);
    2. :meth:`process_group_for_ddp` when DDP wraps the model;
    3. :meth:`attach` once the optimizers exist; its state is saved with ``state_dict`` per rank;
    4. :meth:`weigh_step` at each training batch's start (instead of ``WeightingState.add_step``);
    5. :meth:`after_optimizer_step` after each optimizer step (may run the outer step);
    6. :meth:`finish` when training ends (applies an overlapped exchange still in flight).
    """

    def __init__(self, config: PeriodicSync, wire_dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.wire_dtype = wire_dtype
        self.active = False
        self.step = 0  # optimizer steps taken in this run (and the runs it resumes)
        self.outer_steps = 0
        self.wire_bytes_last_outer = 0  # what this rank sent between hosts in the last outer step
        self._rank = 0
        self._host_ranks: tuple[int, ...] = ()
        self._host_group: Optional[dist.ProcessGroup] = None
        self._leaders: Optional[dist.ProcessGroup] = None  # None on ranks that lead no host
        self._on_rank0_host = True
        self._pacer: Optional[Any] = None
        self._module: Optional[nn.Module] = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._params: list[Tensor] = []
        self._anchor: Optional[Tensor] = None  # θ_0: flat fp32 parameters at the last outer step
        self._outer: Optional[torch.optim.SGD] = None
        self._period = [0.0, 0.0]  # samples this host trained on in the period, samples of all hosts
        self._pending: Optional[dict[str, Any]] = None  # restored state, applied at the first training batch
        self._in_flight: Optional[dict[str, Any]] = None  # an exchange started and not yet applied (overlap)

    # -- set-up ---------------------------------------------------------------------------------------------------
    def setup(self, lab: HeteroLab, groups: LabGroups, rank: int, pacer: Optional[Any] = None) -> None:
        """Learn the hosts and this rank's groups. ``pacer``: the emulated link between hosts, if any."""
        self._rank = rank
        if len(lab.hosts) < 2:
            rank_zero_warn(f"{running_strategy()}: `periodic_sync` needs two or more hosts; with one host every step "
                           "is an exact sync and `periodic_sync` does nothing.")
            self.active = False
            return
        self.active = True
        self._host_ranks = groups.members["host"]
        self._host_group = groups.groups["host"]
        self._leaders = groups.leaders["host"]
        self._on_rank0_host = 0 in self._host_ranks
        self._pacer = pacer if rank == self._host_ranks[0] else None

    def process_group_for_ddp(self) -> Optional[dist.ProcessGroup]:
        """DDP's process group: this rank's host (``None``: the default group, when inactive)."""
        return self._host_group if self.active else None

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Start from rank 0's parameters on every host (DDP synced them only inside each host); the anchor θ_0."""
        self._module, self._optimizers = module, list(optimizers)
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self.active:
            return
        with torch.no_grad():
            flat = self._flat()
            dist.broadcast(flat, src=0)
            self._load_flat(flat)
        self._reset_anchor()

    def _reset_anchor(self) -> None:
        self._anchor = self._flat().float()
        nesterov = self.config.outer == "nesterov"
        momentum = self.config.outer_momentum if nesterov else 0.0
        self._outer = torch.optim.SGD([self._anchor], lr=self.config.outer_lr if nesterov else 1.0,
                                      momentum=momentum, nesterov=nesterov and momentum > 0)

    # -- each step ------------------------------------------------------------------------------------------------
    @property
    def periodic_now(self) -> bool:
        """Whether the current step syncs inside the host only (False in the warm-up, or inactive)."""
        return self.active and self.step >= self.config.warmup_steps

    def weigh_step(self, weighting: WeightingState, rank_sizes: Sequence[float]) -> None:
        """Count one batch's samples (``rank_sizes``: every rank's) into the step's gradient weight: b_r / G over all
        ranks in the warm-up, b_r / B_host inside the host after it."""
        self._apply_pending()
        local, total = rank_sizes[self._rank], float(sum(rank_sizes))
        if not self.periodic_now:
            weighting.process_group = None
            weighting.add_step(local, total)
            return
        host = float(sum(rank_sizes[r] for r in self._host_ranks))
        weighting.process_group = self._host_group
        # A host without samples in this batch (a short last batch) adds a zero gradient, not 1 / world.
        weighting.add_step(local, host if host > 0 else 1.0)
        self._period[0] += host
        self._period[1] += total

    def after_optimizer_step(self) -> bool:
        """Count the step; at the end of the warm-up take the anchor, every ``every`` steps after it combine the
        hosts (with ``overlap``: start the exchange now, apply it after the next step). True when an exchange
        started."""
        if not self.active:
            return False
        self.step += 1
        if self._in_flight is not None:  # overlap: the exchange started one step ago lands now
            self._finish_outer()
        warmup, every = self.config.warmup_steps, self.config.every
        if self.step == warmup:
            self._reset_anchor()  # the hosts are identical after exact sync
            return False
        if self.step > warmup and (self.step - warmup) % every == 0:
            self._start_outer()
            if not self.config.overlap:
                self._finish_outer()
            return True
        return False

    def finish(self) -> None:
        """Apply an exchange still in flight (``overlap``: the last one of a run). Every rank calls it."""
        if self._in_flight is not None:
            self._finish_outer()

    def _start_outer(self) -> None:
        """Leaders put their weighted delta on the link (asynchronously); every rank keeps its parameters as sent."""
        assert self._anchor is not None
        host_samples, total = self._period
        weight = host_samples / total if total > 0 else 1.0 / max(1, len(self._host_ranks))
        sent = self._flat()
        flight: dict[str, Any] = {"sent": sent, "work": None, "wire": None, "parts": None, "combined": None}
        if self._leaders is not None:
            wire = (self._anchor - sent).mul_(weight).to(self.wire_dtype)
            self.wire_bytes_last_outer = wire.numel() * wire.element_size()
            if self._pacer is not None:
                self._pacer.transfer(self.wire_bytes_last_outer)
            if self.wire_dtype == torch.float32:
                flight["work"] = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self._leaders, async_op=True)
            else:  # gathered and summed in fp32 in rank order: the same bits on every leader
                flight["parts"] = [torch.empty_like(wire) for _ in range(dist.get_world_size(self._leaders))]
                flight["work"] = dist.all_gather(flight["parts"], wire, group=self._leaders, async_op=True)
            flight["wire"] = wire
        self._in_flight = flight
        self._period = [0.0, 0.0]

    def _combined(self) -> Optional[Tensor]:
        """The leaders' Σ_h (S_h / S) Δ_h of the exchange in flight, waiting for it (``None`` on other ranks)."""
        flight = self._in_flight
        assert flight is not None
        if flight["work"] is not None:
            flight["work"].wait()
            flight["work"] = None
            parts = flight["parts"]
            flight["combined"] = flight["wire"] if parts is None else torch.stack([p.float() for p in parts]).sum(0)
            flight["wire"] = flight["parts"] = None
            if self._pacer is not None:
                self._pacer.settle()
        return flight["combined"]

    def _finish_outer(self) -> None:
        """The outer optimizer step on θ_0 with the combined delta; every rank of every host takes the same one.
        Local progress made while the exchange was in flight (``overlap``) is kept on top."""
        assert self._anchor is not None and self._outer is not None and self._in_flight is not None
        with torch.no_grad():
            combined = self._combined()
            delta = combined if combined is not None else torch.empty_like(self._anchor)
            dist.broadcast(delta, src=self._host_ranks[0], group=self._host_group)
            self._anchor.grad = delta
            self._outer.step()
            self._anchor.grad = None
            sent = self._in_flight["sent"]
            self._in_flight = None
            if self.config.overlap:
                self._load_flat(self._anchor + (self._flat() - sent))
            else:
                self._load_flat(self._anchor)
        self.outer_steps += 1

    def _flat(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self._params])

    def _load_flat(self, flat: Tensor) -> None:
        offset = 0
        for p in self._params:
            p.detach().copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    # -- checkpoints (per rank) -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        mid_period = self.periodic_now and (self.step - self.config.warmup_steps) % self.config.every != 0
        state: dict[str, Any] = {"step": self.step, "outer_steps": self.outer_steps, "period": list(self._period)}
        if self._anchor is not None and self._outer is not None:
            state["anchor"] = self._anchor.detach().clone()
            state["outer"] = self._outer.state_dict()
        if self._in_flight is not None:  # overlap: the exchange's result (leaders) and what this rank sent
            state["in_flight"] = {"sent": self._in_flight["sent"].clone(), "combined": self._combined()}
        # Lightning saves rank 0's model and optimizer; mid-period (always, with overlap) the other hosts' differ.
        differs = self.periodic_now and (mid_period or self.config.overlap)
        if differs and not self._on_rank0_host and self._module is not None:
            state["module"] = {k: v.detach().clone() for k, v in self._module.state_dict().items()}
            state["optimizers"] = [o.state_dict() for o in self._optimizers]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Kept until the first training batch: Lightning restores the model and optimizers after its callbacks."""
        self._pending = dict(state)

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        self.step, self.outer_steps = int(state["step"]), int(state["outer_steps"])
        self._period = [float(v) for v in state["period"]]
        if "module" in state and self._module is not None:
            self._module.load_state_dict(state["module"])
            for optimizer, saved in zip(self._optimizers, state["optimizers"]):
                optimizer.load_state_dict(saved)
        if "anchor" in state and self.active:
            self._reset_anchor()
            assert self._anchor is not None and self._outer is not None
            self._anchor.copy_(state["anchor"])
            self._outer.load_state_dict(state["outer"])
        if "in_flight" in state and self.active:
            flight = state["in_flight"]
            self._in_flight = {"sent": flight["sent"], "work": None, "wire": None, "parts": None,
                               "combined": flight["combined"]}

    # -- lab table ------------------------------------------------------------------------------------------------
    def describe(self, lab: HeteroLab) -> list[str]:
        """Per rank: what crosses hosts and how often (the lab table's "between hosts" column)."""
        if not self.active:
            return ["every step (one host)"] * lab.world_size
        wire = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.wire_dtype]
        leaders = {ranks[0] for ranks in lab.hosts.values()}
        return [f"Δ {wire} {self.config.describe()}" if r in leaders else "via host leader"
                for r in range(lab.world_size)]


def periodic_runtime(arg: Any, compression: Any, hook: Any, wrapper: Any) -> Optional[PeriodicCrossHostSync]:
    """The runtime for a strategy's ``periodic_sync`` argument (``None``: off); refuses what owns the same gradient
    path (a user comm hook)."""
    config = parse_periodic_sync(arg)
    if config is None:
        return None
    if hook is not None or wrapper is not None:
        raise ValueError("`periodic_sync` and `ddp_comm_hook`/`ddp_comm_wrapper` both own the gradient hook.")
    return PeriodicCrossHostSync(config, outer_wire_dtype(compression))
