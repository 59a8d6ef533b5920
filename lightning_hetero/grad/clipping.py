"""Clipping by norm with the whole model's norm, on a rank that holds part of the gradients.

Lightning clips by norm in its precision plugin: ``LightningModule.clip_gradients`` calls the trainer's plugin's
``clip_gradients``, which calls the plugin's ``clip_grad_by_norm`` on this rank's gradients (after a loss scaler has
unscaled them, in ``MixedPrecision.optimizer_step``). Their norm is the whole model's where every rank holds every
exchanged gradient (DDP) or where the gradients are DTensors, whose norm torch reduces over the mesh (FSDP2). A
pipeline's stage rank holds plain tensors of one stage: their own norm would clip them less than one device does.

A strategy whose ranks hold parts gives Lightning a plugin of its own, :func:`clipping_by_whole_norm` of the one it
was given: a new instance of that plugin's class with :class:`WholeNormClipping` first in its method order, so only
``clip_grad_by_norm`` changes. It holds the same state (the same scaler object, the same autocast settings) under
the same class name, so ``isinstance`` checks, Lightning's checkpoint key (the class's qualified name), unscaling
before clipping and clipping by value are the given plugin's. The given plugin itself is left as it is.

Example::

    def clip(params, max_norm):  # the strategy's: the norm of every rank's part, one collective
        stage_sync.clip_grad_norm(module, params, max_norm, device)

    strategy.precision_plugin = clipping_by_whole_norm(strategy.precision_plugin, clip)
    # Trainer(gradient_clip_val=1.0) now clips by norm through `clip(the optimizer's parameters, 1.0)`
"""

from typing import Any, Callable, ClassVar, Union, cast

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

# clip(the optimizer's parameters, max_norm): their gradients scaled in place by the whole model's clip coefficient.
WholeNormClip = Callable[[list[Tensor], float], None]


class WholeNormClipping(Precision):
    """The base of the plugin classes :func:`clipping_by_whole_norm` makes: clipping by norm calls
    ``whole_norm_clip`` with the optimizer's parameters (as Lightning's own clipping reads them)."""

    given_class: ClassVar[type[Precision]] = Precision  # the class of the plugin it was made from
    whole_norm_clip: WholeNormClip

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.whole_norm_clip(list(self.main_params(optimizer)), float(clip_val))

    def __reduce__(self) -> tuple[Any, ...]:
        # Its class is made at run time and has no importable name: pickled as the given class, made again on load.
        return _empty_instance, (self.given_class,), self.__dict__


_CLASSES: dict[type[Precision], type[WholeNormClipping]] = {}


def _clipping_class(given: type[Precision]) -> type[WholeNormClipping]:
    """One class per given plugin class, named as it is (Lightning keys the plugin's checkpoint state by name)."""
    if given not in _CLASSES:
        _CLASSES[given] = cast(type[WholeNormClipping], type(given.__name__, (WholeNormClipping, given), {
            "__qualname__": given.__qualname__, "given_class": given}))
    return _CLASSES[given]


def _empty_instance(given: type[Precision]) -> WholeNormClipping:
    """An instance of ``given``'s clipping class without running any ``__init__`` (its state is copied in)."""
    made = _clipping_class(given)
    return made.__new__(made)


def clipping_by_whole_norm(plugin: Precision, clip: WholeNormClip) -> WholeNormClipping:
    """A new plugin that behaves as ``plugin`` (same class name, same state) but clips by norm with ``clip``;
    ``plugin`` is not changed. A plugin this function made is copied from the plugin it was made from.

    Example::

        >>> own = clipping_by_whole_norm(MixedPrecision("bf16-mixed", "cpu"), clip)
        >>> isinstance(own, MixedPrecision), type(own).__qualname__
        (True, 'MixedPrecision')
    """
    given = plugin.given_class if isinstance(plugin, WholeNormClipping) else type(plugin)
    own = _empty_instance(given)
    own.__dict__.update(vars(plugin))
    own.whole_norm_clip = clip
    return own
