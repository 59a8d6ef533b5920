"""Rehearsed ranks started in fresh processes, and their results collected (a rank that timed out or died included)."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional

from lightning_hetero.lab.rehearsal import REHEARSE_ENV
from lightning_hetero.rehearse.cards import card_label
from lightning_hetero.rehearse.job import RankJob, RankResult


def rank_environment(job: RankJob) -> dict[str, str]:
    """Rank ``r`` of ``N`` as Lightning sees it: its own node of one process, started from outside."""
    env = dict(os.environ, LOCAL_RANK="0", NODE_RANK=str(job.rank), WORLD_SIZE=str(len(job.lab)),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), PYTHONUNBUFFERED="1")
    env.pop(REHEARSE_ENV, None)
    if job.mode == "hetero":
        env[REHEARSE_ENV] = f"{job.rank}/{len(job.lab)}"
    return env


def launch_ranks(jobs: Sequence[RankJob], timeout: float, log: Any) -> list[RankResult]:
    """Run ranks in fresh processes, together (each in its own session: on timeout or interruption every process
    group is killed, data loader workers included)."""
    processes = []
    try:
        for job in jobs:
            cmd = [sys.executable, "-m", "lightning_hetero.rehearse.rank", json.dumps(asdict(job))]
            processes.append(subprocess.Popen(cmd, env=rank_environment(job), stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for process in processes:
            _kill_group(process)
    return [_collect(job, process, timeout if timed_out else None) for job, process in zip(jobs, processes)]


def launch_rank(job: RankJob, timeout: float, log: Any) -> RankResult:
    """Run one rank in a fresh process (see :func:`launch_ranks`)."""
    return launch_ranks([job], timeout, log)[0]


def _collect(job: RankJob, process: "subprocess.Popen[bytes]", timed_out: Optional[float]) -> RankResult:
    if timed_out is not None and process.returncode in (None, -signal.SIGKILL):
        return RankResult(job.mode, job.rank, card_label(job.lab[job.rank]), error=f"timed out after {timed_out:g} s")
    try:
        with open(job.out) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return RankResult(job.mode, job.rank, card_label(job.lab[job.rank]),
                          error=f"the rank's process exited with code {process.returncode} (see the log)")
    return RankResult(**data)


def _kill_group(process: "subprocess.Popen[bytes]") -> None:
    """End the rank's process and every child it started (data loader workers included)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
