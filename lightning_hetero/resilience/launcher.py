"""Lightning's fork/spawn launcher, with each rank's own exception reported to its strategy before the rank ends.

Lightning calls ``Strategy.on_exception`` only in the launching process, after a rank is gone, so a rank's fault
watchdog (:mod:`lightning_hetero.resilience.watchdog`) would never hear of the rank's own error, nor have the chance to
name a dead peer before the launcher terminates the survivors.

Example::

    >>> strategy._launcher = ReportingLauncher(strategy, start_method="fork")
"""

import functools
from typing import Any

from lightning_hetero._compat import MultiProcessingLauncher


class ReportingLauncher(MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, whose ranks also report their own exception to their strategy
    (``Strategy.on_exception``) before it leaves them."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return super().launch(functools.partial(_report_exceptions, function), *args, trainer=trainer, **kwargs)


def _report_exceptions(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a rank's ``trainer._fit_impl`` (or validate/test/predict); its exception goes to the trainer's strategy
    first. Module level: the spawn launcher pickles it."""
    try:
        return function(*args, **kwargs)
    except BaseException as error:
        strategy = getattr(getattr(function, "__self__", None), "strategy", None)
        if strategy is not None:
            try:
                strategy.on_exception(error)
            except Exception:  # noqa: BLE001 - never hide the rank's own exception behind the report's
                pass
        raise
