"""Several ranks on one GPU: an emulation mode for developing and testing a mixed lab where there is one GPU.

Give the strategy ``parallel_devices`` that repeat a CUDA index (:func:`one_gpu`) and cap each rank's memory with
``emulate`` (``memory_gib`` or a preset): each rank is its own process with its own caching allocator, capped by
``torch.cuda.set_per_process_memory_fraction``, so a rank capped at 22 GiB runs out of memory where a 22 GiB card
would. The ranks take turns on the GPU's compute: this mode shows memory and correctness, not speed.

What the mode changes, because NCCL cannot put two ranks on one device:

- the process group is gloo (it takes CUDA tensors for all-reduce, all-gather and reduce-scatter); asking for NCCL is
  an error;
- the device is not bound to the process group (Lightning passes ``device_id`` to ``init_process_group``): with a bound
  device, gloo's ``new_group`` and ``init_device_mesh`` need ``perform_nocolor_split``, which ``ProcessGroupGloo``
  lacks (torch 2.11); the sharded strategy's 1-D mesh is built from the world group instead.

Example::

    >>> from lightning_hetero import HeteroFSDPStrategy
    >>> from lightning_hetero.lab.shared_gpu import one_gpu
    >>> strategy = HeteroFSDPStrategy(capacities=[3, 1], parallel_devices=one_gpu(2),
    ...                               emulate=[{"memory_gib": 52}, {"memory_gib": 22}])
    >>> Trainer(accelerator="gpu", devices=1, strategy=strategy)   # two processes on cuda:0
"""

from collections.abc import Sequence
from typing import Optional

import torch


def one_gpu(ranks: int, index: int = 0) -> list[torch.device]:
    """``parallel_devices`` for ``ranks`` ranks sharing CUDA device ``index``."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"`ranks`={ranks!r} must be a positive integer.")
    return [torch.device("cuda", index)] * ranks


def shares_a_device(devices: Optional[Sequence[torch.device]]) -> bool:
    """Whether two ranks of ``devices`` sit on the same CUDA device (CPU ranks always share the host: not counted)."""
    cuda = [(d.index or 0) for d in devices or () if isinstance(d, torch.device) and d.type == "cuda"]
    return len(set(cuda)) < len(cuda)


def shared_device_backend(devices: Optional[Sequence[torch.device]], backend: Optional[str]) -> Optional[str]:
    """The process-group backend for ``devices``: gloo where ranks share a GPU (``ValueError`` for NCCL, which cannot
    put two ranks on one device), else ``backend`` unchanged."""
    if not shares_a_device(devices):
        return backend
    if backend is not None and "nccl" in backend:
        raise ValueError(
            f"`process_group_backend`={backend!r} cannot run several ranks on one GPU ({list(devices or ())}): NCCL "
            "needs a device per rank. Leave it None (gloo is chosen) or pass 'gloo'."
        )
    return backend or "gloo"


def binds_device(devices: Optional[Sequence[torch.device]], root: torch.device) -> bool:
    """Whether the process group may be bound to ``root`` (``init_process_group(device_id=...)``): an accelerator that
    no other rank shares."""
    return root.type != "cpu" and not shares_a_device(devices)
