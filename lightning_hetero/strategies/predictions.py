"""A predict's padding steps, kept out of the predictions the user receives.

Every rank runs the same number of predict steps (FSDP's forward all-gathers parameters; DDP's first forward
broadcasts buffers), so a rank with no sample left for a step re-reads another rank's sample as a *padding* step
(:meth:`~lightning_hetero.data.sampler.EvaluationBatchSampler.is_padding`), whose output the strategy returns as
``None``. Lightning's prediction loop cannot skip a step: it hands the output to every ``BasePredictionWriter`` and
stores it, with the step's batch indices (the other rank's sample), for ``return_predictions`` and epoch writers.

:class:`PaddingPredictions` keeps padding steps out of all of that, so each sample is predicted once, on one rank:
a writer's ``on_predict_batch_end`` is not called on a padding step, and a padding step's entries are taken out of
the stored predictions and batch indices before any epoch writer reads them, and out of what ``trainer.predict``
returns. (Other callbacks' and the module's ``on_predict_batch_end`` still run, with ``outputs=None``.)

Example::

    padding = PaddingPredictions()
    padding.start(trainer)  # the strategy's on_predict_start
    ...                     # the prediction loop runs
    padding.end(trainer)    # the strategy's on_predict_end
"""

import functools
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import BasePredictionWriter

import lightning_hetero._compat as _compat

# The writer hooks that are wrapped, on the instance (the class and other instances stay as they are).
_HOOKS = ("on_predict_batch_end", "on_predict_epoch_end")


class PaddingPredictions:
    """Hides one predict run's padding steps (as the strategy ran them: :meth:`step`) from the trainer's prediction
    writers and returned predictions."""

    def __init__(self) -> None:
        self._writers: list[BasePredictionWriter] = []
        self._padding: set[tuple[int, int]] = set()  # (dataloader_idx, batch_idx) of the padding steps
        self._dropped = False

    def start(self, trainer: Any) -> None:
        """Before the first predict step: wrap the writers' hooks."""
        self._unwrap()  # an earlier predict that failed before its end
        self._padding, self._dropped = set(), False
        for writer in trainer.callbacks:
            if isinstance(writer, BasePredictionWriter):
                writer.on_predict_batch_end = functools.partial(self._batch_end, writer.on_predict_batch_end)
                writer.on_predict_epoch_end = functools.partial(self._epoch_end, writer.on_predict_epoch_end)
                self._writers.append(writer)

    def step(self, indices: tuple[Optional[int], int], padding: bool, output: Any) -> Any:
        """The strategy ran the predict step at ``indices`` (batch, loader), as a padding step or not: its output as
        the trainer gets it (a padding step runs for the collectives only: its sample is another rank's prediction).

            >>> return predictions.step(step_indices(args, kwargs), padding, output)
        """
        batch_idx, dataloader_idx = indices
        if padding and batch_idx is not None:
            self._padding.add((dataloader_idx, batch_idx))
        return None if padding else output

    def end(self, trainer: Any) -> None:
        """After the prediction loop: padding entries out of the returned predictions; the writers as they were."""
        self._drop_padding(trainer)
        self._unwrap()

    def _unwrap(self) -> None:
        for writer in self._writers:
            for hook in _HOOKS:
                vars(writer).pop(hook, None)
        self._writers = []

    def _batch_end(self, hook: Callable[..., None], trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                   batch_idx: int, dataloader_idx: int = 0) -> None:
        if (dataloader_idx, batch_idx) not in self._padding:
            hook(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def _epoch_end(self, hook: Callable[..., None], trainer: Any, pl_module: Any) -> None:
        self._drop_padding(trainer)
        hook(trainer, pl_module)

    def _drop_padding(self, trainer: Any) -> None:
        """Take the padding steps' entries out of the loop's stored outputs and batch indices (once per run: the
        lists are edited in place, as ``trainer.predict`` returns the same lists)."""
        if self._dropped or not self._padding:
            return
        self._dropped = True
        for loader, stored in enumerate(_compat.prediction_records(trainer)):
            for entries in stored:
                # Entry k is step k's: the loop appends one per step, from step 0.
                entries[:] = [entry for k, entry in enumerate(entries) if (loader, k) not in self._padding]
