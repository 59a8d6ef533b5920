"""Where the hybrid layout's stage gradient exchange (:class:`~lightning_hetero.grad.stage_sync.StageSync`) runs in
Lightning's training step.

The exchange ends inside the optimizer step's closure, before ``on_before_optimizer_step`` and gradient clipping
see the gradients; an attached :class:`~lightning_hetero.observe.monitor.HeteroMonitor` times the rank's wait for it
and reads its bytes (:attr:`StageExchange.comm_bytes_last_step`). With ``overlap_stage_exchange=True`` it begins
during the backward that the step follows (:meth:`~lightning_hetero.grad.stage_sync.StageSync.overlapped`), unless a
gradient edit after the backward is possible: a LightningModule that overrides ``backward`` or ``on_after_backward``,
or a callback that overrides ``on_after_backward``, keeps the exchange after the backward for the whole fit
(Lightning's contract: those hooks see, and may change, the rank's gradients before they are exchanged). Every rank
agrees at set-up, so one run has one behaviour whatever each rank's callbacks are.

    class HeteroHybridStrategy(StageExchange, HeteroLifecycle, _UnwrappedDDP): ...
"""

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hetero.grad.compression import warn_double_momentum
from lightning_hetero.grad.stage_sync import StageSync
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
    """The stage exchange's place in the step: begun in the backward an optimizer step follows (when
    :attr:`overlapping`), finished in the optimizer step's closure, clipping by the whole model's norm.

    Mixed in first, before :class:`~lightning_hetero.strategies.lifecycle.HeteroLifecycle`: its backward wraps the
    lifecycle's (which puts a stage rank's pipeline gradients back in place) and Lightning's.
    """

    stage_sync: Optional[StageSync] = None
    # The constructor's option (`overlapping`: as every rank agreed it for this fit, see the module doc).
    overlap_stage_exchange: bool = False
    # Inside the optimizer step's closure, whose exchange follows its backward: a closure run elsewhere (an
    # accumulation step, a LightningModule.optimizer_step that calls it without stepping) exchanges nothing.
    stepping: bool = False
    # A stage rank holds one stage's gradients: the non-finite check agrees over every rank before it acts.
    holds_partial_gradients = True

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn == TrainerFn.FITTING and self.stage_sync is not None:
            self.stage_sync.overlap = self._agree_overlap(trainer)
            if self.stage_sync.compresses:  # on one host every stage stays exact: no momentum correction runs
                warn_double_momentum(self.stage_sync.compression, self.optimizers)  # type: ignore[attr-defined]

    @property
    def overlapping(self) -> bool:
        """Whether this fit's stage exchanges begin during the backward (agreed at set-up by every rank)."""
        return self.stage_sync is not None and self.stage_sync.overlap

    def _agree_overlap(self, trainer: Any) -> bool:
        """Whether this fit's exchanges may begin during the backward: the option on and no rank with a gradient
        hook after the backward (a MAX over every rank, collective)."""
        if not self.overlap_stage_exchange:
            return False
        hooks = gradient_edit_hooks(self.lightning_module, trainer.callbacks)  # type: ignore[attr-defined]
        late = torch.tensor([float(bool(hooks))], device=self.root_device)  # type: ignore[attr-defined]
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if late.item() == 0:
            return True
        named = ", ".join(hooks) if hooks else "a hook on another rank"
        rank_zero_info(f"{running_strategy()}: the stage gradient exchange runs after the backward "
                       f"(overlap_stage_exchange is on, but {named} may change the gradients after it; change them "
                       "in `on_before_optimizer_step`, which sees the exchanged gradients, to keep the overlap).")
        return False

    def exchange_overlapped(self) -> Any:
        """Around the backward an optimizer step follows (overlapping, the stage split known, automatic
        optimization, inside the step's closure): the stage exchanges begin during it."""
        sync, module = self.stage_sync, self.lightning_module  # type: ignore[attr-defined]
        if (sync is None or not sync.overlap or sync.partition is None or not module.automatic_optimization
                or not self.stepping):
            return nullcontext()
        return sync.overlapped(module)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        # A step's one Lightning backward (a pipeline's micro-batches ran theirs in the training step).
        with self.exchange_overlapped():
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def exchanged() -> Any:
            self.stepping = True
            try:
                out = closure()
            finally:
                self.stepping = False
            sync, module = self.stage_sync, self.lightning_module  # type: ignore[attr-defined]
            assert sync is not None
            if sync.partition is None:
                replica = self.replica  # type: ignore[attr-defined]
                sync.share_partition(replica.partition if replica else None, module)
            step = self.core.step  # type: ignore[attr-defined]
            if step.monitor is None:
                sync.all_reduce_grads(module)
            else:  # the rank's time blocked in the exchange
                step.monitor.timed_exchange(sync.all_reduce_grads, module)
            # The hooks that follow (`on_before_optimizer_step`) see the exchanged gradients: a data-parallel rank
            # holds every stage's, a stage rank its own stage's alone (and placeholders for the other stages'
            # weights), so what a stage rank logs there counts nowhere; the data-parallel ranks log for the model.
            step.logging_batch_size = 1.0 if self.replica is None else 0.0  # type: ignore[attr-defined]
            return out

        try:
            return super().optimizer_step(optimizer, exchanged, model, **kwargs)  # type: ignore[misc]
        finally:
            self.core.step.logging_batch_size = None  # type: ignore[attr-defined]

    @property
    def comm_bytes_last_step(self) -> Optional[int]:
        """Bytes this rank handed to the last optimizer step's stage exchange (None before the first)."""
        return self.stage_sync.bytes_last_step if self.stage_sync is not None else None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        """Lightning's clipping by norm, by the whole model's norm: a stage rank's own gradients are one stage's."""
        assert self.stage_sync is not None
        params = list(self.precision_plugin.main_params(optimizer))  # type: ignore[attr-defined]
        self.stage_sync.clip_grad_norm(self.lightning_module, params, float(clip_val),  # type: ignore[attr-defined]
                                       self.root_device)  # type: ignore[attr-defined]
