"""Every GPU test leaves the test process as it found it: a Trainer run in-process (one device) keeps its process
group and sets ``MASTER_PORT`` and the rank variables, which the next in-process test (init twice) and the next
worker subprocess (its store's port taken) would inherit.

Each test's outcome, seconds and (on failure) traceback are printed as soon as it ends: a run cut by its command's
time limit keeps them, where pytest's own summary comes only at the end (a lane cut at its limit once left an empty
log with two failures in it)."""

import os
import sys
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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One line per test as it ends (``[gpu-test] passed 52.3 s tests/gpu/...``), its traceback at once if it
    failed."""
    if report.when == "call" or report.failed:
        sys.stderr.write(f"\n[gpu-test] {report.outcome} {report.duration:.1f} s ({report.when}) {report.nodeid}\n")
        if report.failed:
            sys.stderr.write(report.longreprtext[-6000:] + "\n")
        sys.stderr.flush()
