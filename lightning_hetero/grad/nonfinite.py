"""A non-finite loss or gradient, named and acted on before it reaches the weights.

One NaN loss on one rank turns every rank's weights to NaN: DDP sums it into everyone's gradient. Here:

- each loss that goes into ``backward`` is tested on the device (``isfinite``: no host sync) and the results kept;
- once per optimizer step, after the gradient all-reduce and before the update (Lightning's
  ``on_before_optimizer_step``: gradients are unscaled there when a loss scaler runs), one pass over the gradients
  (their 2-norm, ``torch.nn.utils.get_total_norm``) and one host read say whether they are finite. The all-reduced
  gradients are the same on every rank, so every rank reaches the same verdict without a collective (the hybrid
  layout's stage ranks hold one stage's gradients each: there the ranks agree on the verdict with one small MIN);
- only then, on the rare step that is not finite, the ranks gather their loss verdicts (one ``all_gather``) to name
  the rank(s) whose loss was non-finite, and act as ``nonfinite`` says, identically everywhere:

  - ``"stop"``: raise :class:`NonFiniteError` on every rank, naming rank(s), host(s) and step; the weights were not
    touched, so the last checkpoint and the module are clean;
  - ``"skip"`` (the default, as a loss scaler does): drop the step's gradients on every rank (``grad = None``: the
    optimizer leaves those parameters and their state alone), warn naming the rank(s), and go on; replicas stay
    identical;
  - ``"ignore"``: no check at all (plain DDP's behaviour, no cost).

With a loss scaler (``16-mixed``, or ``precision_policy`` with an fp16 rank) non-finite gradients with every loss finite
are the scaler's ordinary overflow: it skips the step and lowers its scale by itself, so that case is left to it. A
non-finite *loss* is not an overflow: it is named and handled as above (``"skip"`` then leaves the skipping to the
scaler, which skips every inf step already).

The cost per optimizer step is one reduction over the gradients and one device-to-host read (as in gradient clipping),
plus one ``isfinite`` per backward. Only the module's parameters are checked: DDP all-reduces their gradients, so the
verdict is the same on every rank (a tensor trained outside the module, or a parameter DDP ignores, has a rank-local
gradient that one rank alone could see non-finite).

Example::

    >>> trainer = Trainer(callbacks=[NonFiniteCheck("skip")])  # resilience={"nonfinite": "skip"} adds it itself
"""

from collections.abc import Sequence
from typing import Any, Literal, Optional, get_args

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hetero.view import observed

NonFinite = Literal["stop", "skip", "ignore"]
NONFINITE_MODES: tuple[str, ...] = get_args(NonFinite)


class NonFiniteError(FloatingPointError):
    """Training stopped before a non-finite loss or gradient reached the weights (``nonfinite="stop"``)."""


def validate_nonfinite(value: Any) -> str:
    if value not in NONFINITE_MODES:
        raise ValueError(f"`nonfinite`={value!r} is not one of {NONFINITE_MODES}.")
    return value


def gradients_finite(grads: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``grads`` is finite. The 2-norm (fused over tensors on GPUs, and on CPU eight times
    faster than the max-norm, measured) carries any NaN or inf; only when it is not finite does an exact pass tell
    a non-finite element from a norm that overflowed on huge finite values. One host read on the common path."""
    if not grads:
        return True
    if bool(torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=2.0)).item()):
        return True
    return all(bool(torch.isfinite(g).all()) for g in grads)


class NonFiniteCheck(Callback):
    """The check described in the module docstring. ``hosts``: each global rank's host, for the messages."""

    def __init__(self, mode: NonFinite = "skip", hosts: Optional[Sequence[str]] = None) -> None:
        self.mode = validate_nonfinite(mode)
        self.hosts = list(hosts) if hosts is not None else None
        self.skipped = 0  # steps this check skipped (or saw the loss scaler skip for a non-finite loss)
        self.messages: list[str] = []  # what was said about each of them
        self._losses_finite: Optional[torch.Tensor] = None  # since the last optimizer step, on the device
        self._partial_gradients = False  # this rank holds one pipeline stage's gradients (read once per fit)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Once per fit, after the strategy's set-up: a runtime Protocol check reads every member, too much per step.
        strategy = observed(trainer.strategy)
        self._partial_gradients = strategy is not None and strategy.holds_partial_gradients

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.mode == "ignore":
            return
        finite = torch.isfinite(loss.detach()).all()
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.mode == "ignore":
            return
        losses_finite, self._losses_finite = self._losses_finite, None
        # The module's parameters: DDP all-reduces their gradients, so every rank reaches the same verdict. (Tensors
        # trained outside the module, or parameters DDP is told to ignore, are rank-local: not checked.)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        finite = gradients_finite(grads)
        if self._partial_gradients:
            # A stage rank of the hybrid layout holds one stage's gradients: a non-finite one in another stage is not
            # in its view, so the ranks agree (one MIN over a flag) before any of them acts alone.
            flag = torch.tensor([float(finite)], device=pl_module.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            finite = bool(flag.item())
        if finite:
            return
        # Rare: every rank is here at once (the reduced gradients agree), so one collective names the culprits.
        own = torch.tensor([1.0 if losses_finite is None or bool(losses_finite) else 0.0],
                           device=pl_module.device)
        verdicts = trainer.strategy.all_gather(own).reshape(-1).tolist()
        bad = [r for r, ok in enumerate(verdicts) if ok < 0.5]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if not bad and scaler is not None:
            return  # the loss scaler's overflow: it skips the step and lowers the scale
        step = trainer.global_step
        if bad:
            named = ", ".join(f"rank {r}" + (f" (host {self.hosts[r]})" if self.hosts else "") for r in bad)
            what = f"non-finite loss on {named} at step {step}"
        else:
            what = (f"non-finite gradient at step {step} with every rank's loss finite (an inf/NaN made in backward, "
                    "or a sum that overflowed in the all-reduce)")
        if self.mode == "stop":
            raise NonFiniteError(
                f"lightning_hetero: {what}; training stopped before the update, the weights are untouched "
                "(nonfinite='stop'; 'skip' drops such steps on every rank and goes on)."
            )
        self.skipped += 1
        if scaler is None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # the optimizer skips parameters without a gradient: the step is a no-op
        by = "the loss scaler" if scaler is not None else "nonfinite='skip'"
        self.messages.append(f"lightning_hetero: {what}; the step was skipped on every rank by {by} "
                             f"({self.skipped} skipped so far).")
        rank_zero_warn(self.messages[-1])
