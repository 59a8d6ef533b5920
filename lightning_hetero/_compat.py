"""Every private Lightning / torch name the package uses, in one place.

Each entry says which public API is missing. Nothing else in the package imports a ``_``-prefixed name from
``lightning`` or ``torch``: when an upstream release moves one of these, this file is the only one to change.
"""

import inspect
from os import PathLike
from typing import Any, Callable, Optional, Union

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


def weights_only_argument(load: Callable[..., Any], weights_only: Optional[bool]) -> dict[str, Optional[bool]]:
    """``{"weights_only": weights_only}`` when ``load`` takes that argument, else ``{}``.

    Lightning 2.6 added ``weights_only`` to ``Strategy.load_checkpoint`` and ``CheckpointIO.load_checkpoint``; 2.5 has
    it on neither (and never passes it), so an override that forwards it must leave it out there.
    """
    return {"weights_only": weights_only} if "weights_only" in inspect.signature(load).parameters else {}
