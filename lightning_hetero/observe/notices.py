"""Lightning warnings that are wrong under HeteroDDPStrategy, silenced narrowly: by their message, and only while
the strategy makes them wrong.

- After a mid-epoch resume Lightning warns that the dataloader is not resumable and results may be unreliable. The
  strategy's batch sampler restores the epoch's position exactly (the same batches, in the same order, as a run that
  was never interrupted), so for its training loader the warning does not apply.
"""

import re
import warnings
from typing import Optional

from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_hetero._compat import remove_warnings_filter

INEXACT_RESUME = "You're resuming from a checkpoint that ended before the epoch ended"
_silenced: Optional[tuple] = None  # the filter in place (warning filters are per process)


def silence_inexact_resume_warning() -> None:
    """The strategy restored the training loader's position mid-epoch: Lightning's warning does not apply."""
    global _silenced
    if _silenced is None:
        warnings.filterwarnings("ignore", message=re.escape(INEXACT_RESUME), category=PossibleUserWarning)
        _silenced = warnings.filters[0]


def restore_inexact_resume_warning() -> None:
    """The run is over: the warning applies again to whatever runs next in this process."""
    global _silenced
    if _silenced is not None:
        remove_warnings_filter(_silenced)
        _silenced = None
