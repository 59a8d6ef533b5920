"""How one optimizer step's gradients cross ranks, as the strategies' shared training step sees it.

:class:`GradExchange` has three members: what to do around the backward an optimizer step follows (begin
exchanges as gradients complete), what to do before the optimizer step (finish them: after it every rank holds the
gradients one device would), and the bytes the last step handed to the wire. The lifecycle
(:mod:`~lightning_hetero.strategies.lifecycle`) calls it in one place: ``during_backward`` around the backward inside
the optimizer step's closure, ``finish`` when the closure returns, before ``on_before_optimizer_step``.

- DDP's comm hook and FSDP2's reduce-scatter run inside the backward itself: :class:`InBackward` (nothing to begin
  or finish; the comm hook's byte count where one counts them);
- the hybrid layout's stage groups: :class:`~lightning_hetero.strategies.stage_exchange.StageExchange` around
  :class:`~lightning_hetero.grad.stage_sync.StageSync`.

Example::

    with exchange.during_backward(module):
        loss.backward()
    exchange.finish(module)
    optimizer.step()
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Optional, Protocol

from torch import nn


class GradExchange(Protocol):
    """One optimizer step's gradient exchange (see the module docstring)."""

    def during_backward(self, module: nn.Module) -> AbstractContextManager[None]:
        """Around the backward an optimizer step follows: exchanges may begin as gradients complete."""

    def finish(self, module: nn.Module) -> None:
        """Before the optimizer step: every exchange of the step is complete."""

    @property
    def bytes_last_step(self) -> Optional[int]:
        """Bytes this rank handed to the last step's exchange (None: nothing counts them)."""


class InBackward:
    """An exchange the backward itself runs (DDP's comm hook, FSDP2's reduce-scatter); ``counted`` reads its bytes.

    Example::

        strategy.exchange = InBackward(lambda: hook_state.bytes_last_step)
    """

    def __init__(self, counted: Optional[Callable[[], Optional[int]]] = None) -> None:
        self.counted = counted

    def during_backward(self, module: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()

    def finish(self, module: nn.Module) -> None:
        pass

    @property
    def bytes_last_step(self) -> Optional[int]:
        return self.counted() if self.counted is not None else None
