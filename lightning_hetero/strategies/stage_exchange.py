"""The hybrid layout's gradient exchange (:class:`~lightning_hetero.grad.stage_sync.StageSync`) as the training step
runs it: a :class:`~lightning_hetero.grad.exchange.GradExchange` the strategy owns.

The exchange ends when the optimizer step's closure returns, before ``on_before_optimizer_step`` and gradient
clipping see the gradients; an attached :class:`~lightning_hetero.observe.monitor.HeteroMonitor` times the rank's
wait for it and reads its bytes (:attr:`StageExchange.bytes_last_step`). With ``overlap_stage_exchange=True`` it
begins during the backward that the step follows (:meth:`~lightning_hetero.grad.stage_sync.StageSync.overlapped`),
unless a gradient edit after the backward is possible: a LightningModule that overrides ``backward`` or
``on_after_backward``, or a callback that overrides ``on_after_backward``, keeps the exchange after the backward for
the whole fit (Lightning's contract: those hooks see, and may change, the rank's gradients before they are
exchanged). Every rank agrees at set-up, so one run has one behaviour whatever each rank's callbacks are.

Example::

    exchange = StageExchange(sync, replica, strategy.core.step, overlap=True)
    exchange.agree_overlap(module, trainer.callbacks, device)  # at set-up, collective
    with exchange.during_backward(module):  # inside the optimizer step's closure
        loss.backward()
    exchange.finish(module)
"""

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_hetero.grad.stage_sync import StageSync
from lightning_hetero.strategies.step import StepState
from lightning_hetero.strategies.pipelined import PipelinedReplica
from lightning_hetero.view import running_strategy

# The hooks that run after the backward and before the optimizer step's closure returns: a gradient edit in one of
# them is lost on a stage whose exchange began during the backward.
MODULE_GRADIENT_HOOKS = ("backward", "on_after_backward")
CALLBACK_GRADIENT_HOOKS = ("on_after_backward",)


def gradient_edit_hooks(module: LightningModule, callbacks: Sequence[Callback]) -> list[str]:
    """``"Class.hook"`` for each hook of ``module`` and ``callbacks`` that may change the gradients after the
    backward (the rank's own, before any exchange, in Lightning's order)."""
    found = [f"{type(module).__name__}.{hook}" for hook in MODULE_GRADIENT_HOOKS if is_overridden(hook, module)]
    return found + [f"{type(c).__name__}.{hook}" for c in callbacks for hook in CALLBACK_GRADIENT_HOOKS
                    if is_overridden(hook, c, parent=Callback)]


class StageExchange:
    """The stage exchange of one rank: begun in the backward an optimizer step follows (when agreed), finished
    before the optimizer step (``replica``: this rank's pipeline stage, ``None`` on a data-parallel rank)."""

    def __init__(self, sync: StageSync, replica: Optional[PipelinedReplica], step: StepState, overlap: bool) -> None:
        self.sync = sync
        self.replica = replica
        self.step = step
        self.requested = overlap  # the constructor's option; `sync.overlap` is what every rank agreed for this fit

    def agree_overlap(self, module: LightningModule, callbacks: Sequence[Callback], device: torch.device) -> None:
        """Whether this fit's exchanges may begin during the backward: the option on and no rank with a gradient
        hook after the backward (a MAX over every rank, collective)."""
        self.sync.overlap = False
        if not self.requested:
            return
        hooks = gradient_edit_hooks(module, callbacks)
        late = torch.tensor([float(bool(hooks))], device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if late.item() == 0:
            self.sync.overlap = True
            return
        named = ", ".join(hooks) if hooks else "a hook on another rank"
        rank_zero_info(f"{running_strategy()}: the stage gradient exchange runs after the backward "
                       f"(overlap_stage_exchange is on, but {named} may change the gradients after it; change them "
                       "in `on_before_optimizer_step`, which sees the exchanged gradients, to keep the overlap).")

    def during_backward(self, module: nn.Module) -> AbstractContextManager[None]:
        """Around the backward an optimizer step follows: the stage exchanges begin during it (agreed, the stage
        split known, automatic optimization)."""
        sync = self.sync
        automatic = not isinstance(module, LightningModule) or module.automatic_optimization
        if not sync.overlap or sync.partition is None or not automatic:
            return nullcontext()
        return sync.overlapped(module)

    def finish(self, module: nn.Module) -> None:
        """Every stage's exchange complete (the monitor times the wait). The hooks that follow
        (``on_before_optimizer_step``) see the exchanged gradients: a data-parallel rank holds every stage's, a stage
        rank its own stage's alone (and placeholders for the other stages' weights), so what a stage rank logs there
        counts nowhere; the data-parallel ranks log for the model (reset when the optimizer step ends)."""
        sync = self.sync
        if sync.partition is None:
            sync.share_partition(self.replica.partition if self.replica else None, module)
        if self.step.monitor is None:
            sync.all_reduce_grads(module)
        else:  # the rank's time blocked in the exchange
            self.step.monitor.timed_exchange(sync.all_reduce_grads, module)
        self.step.logging_batch_size = 1.0 if self.replica is None else 0.0

    @property
    def bytes_last_step(self) -> Optional[int]:
        return self.sync.bytes_last_step
