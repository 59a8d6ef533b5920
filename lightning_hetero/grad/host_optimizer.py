"""The optimizer step of the parameters that live in host memory (offloaded blocks): torch's fused CPU Adam/AdamW
kernel, multi-threaded, started for each block as soon as its gradient is on the host.

An offloaded block's shard, gradient and Adam moments sit in host memory, so its update runs on the CPU. torch's
default for a parameter list that is not all on the GPU is the per-parameter loop (``foreach`` needs every tensor on
one accelerator); its fused CPU kernel (``fused=True``, torch >= 2.4) does the same math in one pass over the memory.
The user's optimizer stays what ``configure_optimizers`` returned: its class, param groups, hyperparameters,
``state`` and ``state_dict`` are untouched and an LR scheduler bound to it keeps working. Only its ``step`` is wrapped
(:func:`install_host_step`):

1. the closure (forward and backward) runs; with ``overlap`` a worker thread meanwhile steps each offloaded block
   whose gradient has arrived in host memory (FSDP2 assigns it after the reduce-scatter and the copy to the host),
   while the GPU works on the blocks still to come;
2. the blocks not stepped yet are stepped (all of them without ``overlap``), each by a *shadow* optimizer of the
   user's class with ``fused=True`` over that block's parameters, sharing the user's ``state`` dict and reading its
   group's hyperparameters (``lr`` ...) at that moment, so the state it creates is the user's format;
3. the user's own ``step`` runs for every other parameter, the host ones hidden (``grad = None``: skipped).

Exactness. The math is torch's Adam/AdamW on the same values in a different summation order (fp32 reordering).
The overlap updates a block before the step's remaining hooks run, so it is on only where nothing can change or veto
the gradients after the backward (:func:`overlap_blockers`): no gradient clipping (the clip factor needs the global
norm, known only after the last gradient), no loss scaler and no ``resilience.nonfinite`` skip/stop (either may drop
the step after the backward), automatic optimization, and a LightningModule that overrides none of
``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``. Elsewhere the fused step runs
after the closure, as the plain step does. The overlap is armed only inside the optimizer's ``step``, which Lightning
calls on the last micro-step of an accumulation window only, so accumulating micro-steps never update.

Example::

    >>> host = install_host_step(optimizer, model, HostStepConfig(mode="overlap", threads=16), blockers=[])
    >>> optimizer.step(closure)   # as before; host.stats: seconds, overlapped, waited, ns per parameter
"""

import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import lightning_hetero._compat as _compat
from lightning_hetero.plan.memory import HostStepConfig

# The optimizers whose fused CPU kernel is torch's; a subclass may change `step`, so the exact class only.
FUSED_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
# Group entries that say how the step runs, not what it computes: the shadows keep their own.
_HOW_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")
# How often the overlap's worker looks for newly arrived gradients while none is ready (seconds).
POLL_S = 0.0005


@dataclass
class HostStepStats:
    """The last optimizer step's host update, measured (wall seconds of this process)."""

    steps: int = 0
    parameters: int = 0  # elements stepped on the host
    seconds: float = 0.0  # time in the fused updates, either thread
    overlapped: float = 0.0  # of which before the backward ended
    waited: float = 0.0  # the training thread's time from the end of the closure to the host updates' end
    threads: int = 0  # intra-op threads the host update ran with (as observed in the thread that ran it)
    blocks_overlapped: int = 0
    blocks: int = 0
    polls: int = 0  # the overlap worker's looks for newly arrived gradients

    @property
    def ns_per_parameter(self) -> Optional[float]:
        return self.seconds / self.parameters * 1e9 if self.parameters else None


def overlap_blockers(trainer: Any, module: Any) -> list[str]:
    """Why stepping a block before the backward has ended would not be the plain step (empty: it would be)."""
    from lightning.pytorch import LightningModule

    from lightning_hetero.grad.nonfinite import NonFiniteCheck

    why = []
    if trainer.gradient_clip_val:
        why.append("gradient clipping (its factor needs every gradient's norm)")
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        why.append("a loss scaler (it may skip the step after the backward)")
    modes = {cb.mode for cb in trainer.callbacks if isinstance(cb, NonFiniteCheck) and cb.mode != "ignore"}
    why += [f"resilience.nonfinite={m!r} (it may drop the step's gradients after the backward)" for m in sorted(modes)]
    if not module.automatic_optimization:
        why.append("manual optimization")
    why += [f"the module's `{hook}`" for hook in ("on_after_backward", "on_before_optimizer_step",
                                                   "configure_gradient_clipping")
            if is_overridden(hook, module, LightningModule)]
    return why


@dataclass
class _Unit:
    """One FSDP2 module's parameters in host memory: the shadow optimizer that steps them, and how to wait for each
    one's gradient."""

    params: list[Tensor]
    waits: list[Callable[[], None]]
    shadow: torch.optim.Optimizer
    groups: list[int]  # the user's param group of each shadow group
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        # This rank's elements: a sharded parameter's `numel()` is the whole tensor's.
        self.numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.params)


class HostStep:
    """The wrapped ``step`` of one optimizer (see the module's docstring); built by :func:`install_host_step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[_Unit], overlap: bool, threads: int) -> None:
        self.optimizer, self.units, self.overlap, self.threads = optimizer, units, overlap, threads
        self.stats = HostStepStats()
        self._previous = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, or None: the class's
        self._host = [p for u in units for p in u.params]

    def _sync(self, unit: _Unit) -> None:
        # After `load_state_dict` the user's optimizer holds new `state` and group dicts: read them at every step.
        unit.shadow.state = self.optimizer.state
        for shadow_group, index in zip(unit.shadow.param_groups, unit.groups):
            shadow_group.update({k: v for k, v in self.optimizer.param_groups[index].items() if k not in _HOW_KEYS})

    def _update(self, unit: _Unit) -> float:
        self._sync(unit)
        for wait in unit.waits:
            wait()
        started = time.perf_counter()
        unit.shadow.step()
        return time.perf_counter() - started

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        # The step's own record from its start: the worker fills it in while the backward runs.
        self.stats = stats = HostStepStats(steps=self.stats.steps + 1, threads=torch.get_num_threads())
        done: set[int] = set()
        loss = None
        if closure is not None:
            worker = _Overlap(self, stats, done) if self.overlap else None
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                if worker is not None:
                    worker.finish()
        ended = time.perf_counter()
        threads = torch.get_num_threads()
        if threads != self.threads:
            torch.set_num_threads(self.threads)
        try:
            for index, unit in enumerate(self.units):
                if index not in done and any(p.grad is not None for p in unit.params):
                    stats.seconds += self._update(unit)
                    stats.parameters += unit.numel
                    stats.blocks += 1
                    stats.threads = self.threads
        finally:
            if threads != self.threads:
                torch.set_num_threads(threads)
        stats.waited = time.perf_counter() - ended
        grads = [p.grad for p in self._host]
        for p in self._host:
            p.grad = None  # the user's step skips them
        try:
            self._user_step()
        finally:
            for p, grad in zip(self._host, grads):
                p.grad = grad
        return loss

    def _user_step(self) -> Any:
        if self._previous is not None:
            return self._previous()
        return type(self.optimizer).step(self.optimizer)

    def uninstall(self) -> None:
        if self._previous is not None:
            self.optimizer.step = self._previous  # type: ignore[method-assign]
        else:
            self.optimizer.__dict__.pop("step", None)
        self.optimizer.__dict__.pop("_hetero_host_step", None)


class _Overlap:
    """The worker thread of one step: steps each unit once every gradient of it has arrived (a new ``grad``
    object), until :meth:`finish`; the units left are stepped after the closure."""

    def __init__(self, host: HostStep, stats: HostStepStats, done: set[int]) -> None:
        self.host, self.stats, self.done = host, stats, done
        # A gradient that exists before the backward (not set to None by `zero_grad`) is accumulated into in place:
        # its arrival cannot be seen, so its unit waits for the end of the closure.
        self.before = [[p.grad for p in u.params] for u in host.units]
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="hetero-host-step", daemon=True)
        self.thread.start()

    def _arrived(self, index: int) -> bool:
        unit = self.host.units[index]
        return all(p.grad is not None and p.grad is not old for p, old in zip(unit.params, self.before[index]))

    def _run(self) -> None:
        try:
            torch.set_num_threads(self.host.threads)  # per thread: OpenMP's thread count is a per-thread setting
            self.stats.threads = torch.get_num_threads()
            pending = list(range(len(self.host.units) - 1, -1, -1))  # the backward meets the last block first
            while pending and not self.stop.is_set():
                self.stats.polls += 1
                ready = [i for i in pending if self._arrived(i)]
                if not ready:
                    time.sleep(POLL_S)
                    continue
                for index in ready:
                    seconds = self.host._update(self.host.units[index])
                    self.stats.seconds += seconds
                    self.stats.overlapped += seconds
                    self.stats.parameters += self.host.units[index].numel
                    self.stats.blocks += 1
                    self.stats.blocks_overlapped += 1
                    self.done.add(index)
                    pending.remove(index)
        except BaseException as err:  # noqa: BLE001 - raised again in the training thread
            self.error = err

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise self.error


def host_units(module: nn.Module) -> Optional[list[tuple[list[Tensor], list[Callable[[], None]]]]]:
    """Per FSDP2 module in module order: its parameters in host memory and the waits for their gradients' copies
    (:func:`~lightning_hetero._compat.host_gradient_waits`); ``None`` where this torch keeps no record of the copies."""
    units = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        waits = _compat.host_gradient_waits(m)
        if waits is None:
            return None
        if waits:
            units.append(([p for p, _ in waits], [w for _, w in waits]))
    return units


def fused_unsupported(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why torch's fused kernel cannot take this optimizer's host step (``None``: it can)."""
    if type(optimizer) not in FUSED_CLASSES:
        return f"{type(optimizer).__name__} has no fused CPU step in torch (Adam and AdamW have)"
    if "cpu" not in _compat.fused_optimizer_devices():
        return f"torch {torch.__version__} has no fused CPU Adam kernel"
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return "a param group with differentiable=True or capturable=True"
    return None


def _shadow(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> tuple[torch.optim.Optimizer, list[int]]:
    """A fused optimizer of the user's class over ``params``, one group per user group holding some of them."""
    wanted = {id(p) for p in params}
    groups, indices = [], []
    for index, group in enumerate(optimizer.param_groups):
        mine = [p for p in group["params"] if id(p) in wanted]
        if mine:
            groups.append({**{k: v for k, v in group.items() if k not in _HOW_KEYS}, "params": mine})
            indices.append(index)
    shadow = type(optimizer)(groups, fused=True, foreach=False)
    shadow.state = optimizer.state
    return shadow, indices


def install_host_step(optimizer: torch.optim.Optimizer, module: nn.Module, config: HostStepConfig,
                      blockers: Sequence[str]) -> tuple[Optional[HostStep], str]:
    """Wrap ``optimizer.step`` so that its parameters in host memory take the fused (and, with no ``blockers``,
    overlapped) step; returns the installed step (``None``: left as it is) and a one-line note saying what runs."""
    if config.mode == "plain":
        return None, "host step: plain (the optimizer's own)"
    units = host_units(module)
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if units is None:
        return None, f"host step: plain (torch {torch.__version__}'s FSDP2 keeps no record of the gradient copies)"
    units = [(ps, ws) for ps, ws in units if all(id(p) in mine for p in ps)]
    if not units:
        return None, "host step: no parameters in host memory"
    why = fused_unsupported(optimizer)
    if why is None:
        try:
            built = [(*_shadow(optimizer, ps), ps, ws) for ps, ws in units]
        except (RuntimeError, ValueError) as err:
            why = f"torch refused a fused optimizer: {err}"
    if why is not None:
        return None, f"host step: plain ({why})"
    overlap = config.mode == "overlap" and not blockers
    threads = config.threads or torch.get_num_threads()
    host = HostStep(optimizer, [_Unit(ps, ws, shadow, idx) for shadow, idx, ps, ws in built], overlap, threads)
    optimizer._hetero_host_step = host  # type: ignore[attr-defined]
    # A method of the optimizer (an LR scheduler built later wraps `step.__func__` and binds it to the optimizer).
    optimizer.step = types.MethodType(_wrapped_step, optimizer)  # type: ignore[method-assign]
    params = sum(u.numel for u in host.units)
    how = "fused, overlapped with the backward" if overlap else "fused, after the backward"
    if config.mode == "overlap" and blockers:
        how += f" (no overlap: {'; '.join(blockers)})"
    return host, f"host step: {how}; {len(host.units)} blocks, {params / 1e6:.1f}M parameters, {threads} threads"


def _wrapped_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    return optimizer._hetero_host_step.step(closure)  # type: ignore[attr-defined]


def install_host_steps(optimizers: Sequence[torch.optim.Optimizer], trainer: Any, module: Any,
                       config: HostStepConfig) -> tuple[list[HostStep], str]:
    """:func:`install_host_step` on each optimizer (one wrapped before is unwrapped first), with the blockers of
    the overlap read from ``trainer`` and ``module``; returns the installed steps and one line saying what runs."""
    blockers = overlap_blockers(trainer, module)
    steps, notes = [], []
    for optimizer in optimizers:
        old = optimizer.__dict__.get("_hetero_host_step")
        if old is not None:
            old.uninstall()
        host, note = install_host_step(optimizer, module, config, blockers)
        steps += [host] if host is not None else []
        notes.append(note)
    return steps, "; ".join(dict.fromkeys(notes))
