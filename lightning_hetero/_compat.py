"""Every private Lightning / torch name the package uses, in one place.

Each entry says which public API is missing. Nothing else in the package imports a ``_``-prefixed name from
``lightning`` or ``torch``: when an upstream release moves one of these, this file is the only one to change.
"""

from os import PathLike
from typing import Union

# Checkpoint paths: Lightning's `_PATH` alias has no public spelling.
PathType = Union[str, PathLike]

# Whether a path is on the local file system (atomic rename and fsync apply): Lightning has no public helper;
# fsspec's own protocol test is what `_is_local_file_protocol` wraps.
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol as is_local_path  # noqa: E402

# Every generator's state (torch, numpy, random, CUDA) in the layout Lightning's checkpoints use: public
# `seed_everything` sets seeds but cannot capture or restore a running state.
from lightning.fabric.utilities.seed import _collect_rng_states as collect_rng_states  # noqa: E402
from lightning.fabric.utilities.seed import _set_rng_states as set_rng_states  # noqa: E402

# The process group set-up with our own rendezvous store: `DDPStrategy.setup_distributed` builds its store inside,
# and takes none from outside.
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: E402

# The prediction loop's index-tracking batch-sampler wrapper: no public name, and a rebuilt prediction loader must
# keep it for `return_predictions` / `BasePredictionWriter` batch indices.
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper as IndexBatchSamplerWrapper  # noqa: E402

# PowerSGD's building blocks: torch exposes only the whole hook, not its orthogonalisation or the compress test.
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (  # noqa: E402
    _orthogonalize as powersgd_orthogonalize,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (  # noqa: E402
    _orthogonalize_gram_schmidt as powersgd_orthogonalize_gram_schmidt,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress as powersgd_should_compress  # noqa: E402,E501


def remove_warnings_filter(entry: tuple) -> None:
    """Remove one entry of ``warnings.filters``: the module adds filters in public (``filterwarnings``) but has no
    public call to remove one, and its per-module caches must be told that the list changed."""
    import warnings

    try:
        warnings.filters.remove(entry)
    except ValueError:  # already gone (e.g. `warnings.resetwarnings()`)
        return
    warnings._filters_mutated()  # type: ignore[attr-defined]

# Lightning's fork/spawn launcher: no public name, and its ranks run `fit` without `Strategy.on_exception` (only the
# launching process calls it), which the fault watchdog needs in every rank (see resilience/faults.py).
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher  # noqa: E402
