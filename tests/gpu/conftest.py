"""Every GPU test leaves the test process as it found it: a Trainer run in-process (one device) keeps its process
group and sets ``MASTER_PORT`` and the rank variables, which the next in-process test (init twice) and the next
worker subprocess (its store's port taken) would inherit."""

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_or_rank_environment_left() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
