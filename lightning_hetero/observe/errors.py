"""A bad argument or config said in one line, not as a traceback per rank.

A wrong value in a LightningCLI config used to print its message up to 8 times in 58 to 98 lines: jsonargparse
wraps the strategy's ``ValueError`` in a union-type error with two chained tracebacks, and with the popen launcher
every rank (each a re-run of the script) raises the same error at setup, each with a traceback, the watchdog's note
and the watchdog's line. :func:`run_main` runs a script's ``main`` so that a ``ValueError`` (what this package raises
for bad input) ends the process with ``PROG: error: MESSAGE`` on global rank 0 and exit status 2; the other ranks'
own distinct errors are still named by the fault watchdog. ``LIGHTNING_HETERO_TRACEBACK=1`` shows the traceback.

Example::

    if __name__ == "__main__":
        run_main(main, "train.py")
"""

import os
import sys
from typing import Any, Callable

from lightning.pytorch.utilities.rank_zero import rank_zero_only

_UNION_ERROR = "Does not validate against any of the Union subtypes"


def user_message(error: BaseException) -> str:
    """The error's own words: for jsonargparse's union error, the reasons other than "Expected a <type>"."""
    text = str(error)
    if _UNION_ERROR in text:
        reasons = [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")]
        # A union inside a union (`rebalance: bool | Rebalancing`) repeats the union's own line: not a reason.
        reasons = [r for r in reasons if not r.startswith(("Expected a ", _UNION_ERROR))]
        if reasons:
            return "; ".join(reasons)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__


def run_main(main: Callable[[], Any], prog: str) -> Any:
    """``main()``; a ``ValueError`` becomes one line on rank 0 and exit status 2 (see the module docstring)."""
    try:
        return main()
    except ValueError as err:
        if os.environ.get("LIGHTNING_HETERO_TRACEBACK") == "1":
            raise
        if getattr(rank_zero_only, "rank", 0) == 0:
            sys.stderr.write(f"{prog}: error: {user_message(err)}\n")
            sys.stderr.flush()
        raise SystemExit(2) from None
