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
from lightning_hetero.rehearse.job import REAL_MODES, RankJob, RankResult

# The longest error a rank's output gives its result (the whole output is in the log).
ERROR_CHARS = 400
# Ranks run together end within moments of each other: their collectives fail once one has gone. A rank that never
# joined the process group (its rendezvous failed) leaves the others waiting for it, for as long as the group's
# timeout (30 min): this long after the first rank has ended, the others are stopped.
TOGETHER_GRACE_S = 120.0


def rank_environment(job: RankJob) -> dict[str, str]:
    """Rank ``r`` of ``N`` as Lightning sees it: its own node of one process, started from outside."""
    env = dict(os.environ, LOCAL_RANK="0", NODE_RANK=str(job.rank), WORLD_SIZE=str(len(job.lab)),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), PYTHONUNBUFFERED="1")
    env.pop(REHEARSE_ENV, None)
    if job.mode == "hetero":
        env[REHEARSE_ENV] = f"{job.rank}/{len(job.lab)}"
    gpu = job.rank if job.mode in REAL_MODES and job.gpu is None else job.gpu
    if gpu is not None:
        # Rank r alone on this machine's GPU r (of those visible), as its own node would have it.
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if gpu < len(visible) else str(gpu)
    return env


def launch_ranks(jobs: Sequence[RankJob], timeout: float, log: Any) -> list[RankResult]:
    """Run ranks in fresh processes, together (each in its own session: on timeout or interruption every process
    group is killed, data loader workers included). Each rank's output goes to ``log`` once it has ended."""
    processes, outputs = [], []
    try:
        for job in jobs:
            cmd = [sys.executable, "-m", "lightning_hetero.rehearse.rank", json.dumps(asdict(job))]
            outputs.append(open(job.out + ".log", "w+"))
            processes.append(subprocess.Popen(cmd, env=rank_environment(job), stdout=outputs[-1],
                                              stderr=subprocess.STDOUT, start_new_session=True))
        stopped = _wait_together(processes, jobs, timeout)
    finally:
        for process in processes:
            _kill_group(process)
        texts = []
        for job, output in zip(jobs, outputs):
            output.seek(0)
            texts.append(output.read())
            output.close()
            if len(jobs) > 1:
                log.write(f"\n----- {job.mode} rank {job.rank} -----\n")
            log.write(texts[-1])
        log.flush()
    return [_collect(job, process, text, stopped) for job, process, text in zip(jobs, processes, texts)]


def _wait_together(processes: Sequence["subprocess.Popen[bytes]"], jobs: Sequence[RankJob], timeout: float
                   ) -> Optional[str]:
    """Wait for every process, at most ``timeout`` seconds, and :data:`TOGETHER_GRACE_S` after the first has ended;
    why the ones still running then are stopped (``None``: every one ended)."""
    deadline = time.monotonic() + timeout
    stopped = f"timed out after {timeout:g} s"
    while any(p.poll() is None for p in processes):
        now = time.monotonic()
        if now >= deadline:
            return stopped
        ended = next((job for job, p in zip(jobs, processes) if p.poll() is not None), None)
        if ended is not None and now + TOGETHER_GRACE_S < deadline:
            deadline = now + TOGETHER_GRACE_S
            stopped = f"still running {TOGETHER_GRACE_S:g} s after rank {ended.rank} ended: stopped"
        time.sleep(0.1)
    return None


def launch_rank(job: RankJob, timeout: float, log: Any) -> RankResult:
    """Run one rank in a fresh process (see :func:`launch_ranks`)."""
    return launch_ranks([job], timeout, log)[0]


def _collect(job: RankJob, process: "subprocess.Popen[bytes]", output: str, stopped: Optional[str]) -> RankResult:
    if stopped is not None and process.returncode in (None, -signal.SIGKILL):
        return RankResult(job.mode, job.rank, card_label(job.lab[job.rank]), error=stopped)
    try:
        with open(job.out) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        said = exit_error(output)
        code = f"the rank's process exited with code {process.returncode}"
        return RankResult(job.mode, job.rank, card_label(job.lab[job.rank]),
                          error=f"{said} ({code})" if said else f"{code} (see the log)")
    return RankResult(**data)


_UNION = "Does not validate against any of the Union subtypes"


def exit_error(output: str) -> Optional[str]:
    """The error a process that ended without a result said last (``PROG: error: ...`` of argparse, jsonargparse or
    :func:`~lightning_hetero.observe.errors.run_main`, with its indented lines), as one line. Of jsonargparse's union
    errors the reasons are kept; a union none of whose types gave one more than "Expected a <type>" says what it takes
    and what it was given."""
    lines = output.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if "error:" in line and not line.startswith((" ", "\t"))]
    if not starts:
        return None
    first = lines[starts[-1]]
    said = [first[first.index("error:") + len("error:"):].strip()]
    said += [line.strip() for line in lines[starts[-1] + 1:] if line.startswith((" ", "\t"))]
    parts: list[str] = []
    unions: list[dict[str, Any]] = []  # the unions being read, innermost last (they nest in each other's reasons)
    for part in said:
        if part == _UNION:
            unions.append({"takes": None, "reason": False})
        elif part.startswith("Subtypes:") and unions:
            unions[-1]["takes"] = part.removeprefix("Subtypes:").strip()
        elif part.startswith("Given value:") and unions:
            union = unions.pop()
            if not union["reason"] and union["takes"]:
                parts.append(f"expected one of {union['takes']}, given {part.removeprefix('Given value:').strip()}")
        elif part.startswith("- ") and not part.startswith("- Expected a "):
            for union in unions:
                union["reason"] = True
            parts.append(part.removeprefix("- "))
        elif part and not part.startswith(("Errors:", "Given value type:", "- Expected a ")):
            parts.append(part)
    text = " ".join(parts)
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def _kill_group(process: "subprocess.Popen[bytes]") -> None:
    """End the rank's process and every child it started (data loader workers included)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def free_port() -> int:
    """A free port whose next one is free too (ranks run together rendezvous on ``port + 1``)."""
    import socket

    while True:
        with socket.socket() as s, socket.socket() as after:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            try:
                after.bind(("127.0.0.1", port + 1))
            except (OSError, OverflowError):  # taken, or past the last port
                continue
            return port
