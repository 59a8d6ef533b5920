"""The fault watchdog's rules: which rank is dead or stuck, which error is the job's cause, and the sentence saying so.

Pure functions of what the ranks published in the job's store (no store, no thread), so each rule is tested on
records written by hand. A rank's *state* is the mapping it publishes about once a second: ``host``, ``device``,
``pid``, ``phase``, ``step``, ``batch``, ``seq`` (its beat count), ``stalled`` (seconds without progress) and
``where`` (file:line). A *record* is what a failing rank writes once: its state plus ``kind`` (``"error"``: its own
exception; ``"peer"``: a collective that failed because of another rank; ``"stuck"``: no progress for ``timeout`` s),
``text`` and ``order`` (the job-wide order of the records: the first is the likeliest cause).

The cause is the first error recorded by a rank that was not merely a victim of a broken collective (or of a launcher
ending it: a DataLoader worker terminated from outside); else a rank that died; else the rank that made no progress
while the others failed in a collective.

Example::

    >>> timing = Timing.of(60)
    >>> state = {"host": "ws2", "device": "RTX 3090", "pid": 42, "phase": "data", "step": 12, "batch": None}
    >>> job_fault({1: {**state, "kind": "error", "text": "ValueError: bad", "order": 1}}, [], {}, 0, 2, timing)
    ('rank 1 (host ws2, device RTX 3090, pid 42) failed while in data at step 12: ValueError: bad', True)
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Timing:
    """The watchdog's clock, all derived from the job's collective ``timeout`` (seconds)."""

    timeout: float
    # Beat period.
    interval: float
    # A peer whose beat stopped this long is dead.
    dead_after: float
    # The training thread's chance to raise by itself once the job's fault is known.
    grace: float

    @classmethod
    def of(cls, timeout: float) -> "Timing":
        timeout = float(timeout)
        return cls(timeout=timeout, interval=min(1.0, max(0.1, timeout / 10)), dead_after=min(timeout, 60.0),
                   grace=min(5.0, timeout))


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because of another rank (timeout, closed connection), not this rank's own fault."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)  # gloo raises plain RuntimeErrors
    # A DataLoader worker terminated (SIGTERM, not the OOM killer's SIGKILL) was ended from outside: a launcher
    # (torchrun, srun) stopping the job after another rank failed, or this watchdog.
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                                   "Timed out waiting", "NCCL", "killed by signal: Terminated"))


def error_text(error: BaseException) -> str:
    """The error's first line, as it is recorded for the other ranks (at most 500 characters)."""
    return (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0][:500]


def pid_dead(pid: int) -> bool:
    """Whether process ``pid`` (on this host) is gone; a zombie is dead, just not reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def gone_on_host(state: Optional[Mapping], host: str) -> bool:
    """A rank on this ``host`` whose process is gone (a rank on another host shows only by its silence)."""
    return state is not None and state["host"] == host and pid_dead(int(state["pid"]))


def looks_dead(state: Mapping, last_beat: float, now: float, dead_after: float, host: str) -> bool:
    """A peer whose beat has not changed for ``dead_after`` s (``last_beat``: local time it last changed), or whose
    pid on this host is gone. (A rank that finished its run is silent on purpose: the caller asks for that.)"""
    return now - last_beat > dead_after or gone_on_host(state, host)


def describe(rank: int, state: Optional[Mapping]) -> str:
    if not state:
        return f"rank {rank}"
    return f"rank {rank} (host {state['host']}, device {state['device']}, pid {state['pid']})"


def doing(state: Optional[Mapping]) -> str:
    if not state:
        return ""
    batch = f", batch {state['batch']}" if state.get("batch") is not None else ""
    return f" while in {state['phase']} at step {state['step']}{batch}"


def own_failure(rank: int, state: Mapping, text: str) -> str:
    """This rank's own error, as the job's cause."""
    return f"{describe(rank, state)} failed{doing(state)}: {text}"


def collective_failure(rank: int, state: Mapping, text: str) -> str:
    """This rank failed in a collective and no other cause was found."""
    return f"{describe(rank, state)} failed in a collective: {text}"


def stuck(rank: int, state: Mapping, stalled: float) -> str:
    """This rank's training thread made no progress for ``stalled`` s."""
    return f"{describe(rank, state)} is stuck: no progress for {stalled:.0f} s{doing(state)}"


def store_lost(zero: Optional[Mapping], error: BaseException) -> str:
    """The job's store (rank 0's process) cannot be reached."""
    return (f"{describe(0, zero)} is unreachable: the job's store in its process is gone (rank 0 died, was killed or "
            f"its host dropped){doing(zero)}. ({type(error).__name__}: {error})")


def job_fault(records: Mapping[int, Mapping], dead: Sequence[int], peers: Mapping[int, Mapping], rank: int,
              world_size: int, timing: Timing) -> tuple[Optional[str], bool]:
    """The job's fault as a sentence naming the rank (``None`` while nothing is wrong), and whether it names the cause
    rather than only a failed collective.

    Args:
        records: each failed rank's record.
        dead: the peers that look dead (:func:`looks_dead`), in rank order.
        peers: every rank's last published state.
        rank: the rank that asks.
        world_size: the job's number of ranks.
        timing: the watchdog's clock.
    """
    own = [(rec["order"], r, rec) for r, rec in records.items() if rec["kind"] != "peer"]
    if own:
        _, r, rec = min(own)
        verb = "is stuck" if rec["kind"] == "stuck" else "failed"
        return f"{describe(r, rec)} {verb}{doing(rec)}: {rec['text']}", True
    if dead:
        r = dead[0]
        last = peers.get(r)
        said = f" (last reported: {last['phase']} at step {last['step']})" if last else ""
        return (f"{describe(r, last)} stopped responding{said}: its process died (killed, out of host memory, "
                "os._exit) or its host dropped"), True
    if not records:
        return None, False
    first_r, first = min(records.items(), key=lambda item: item[1]["order"])
    # The others failed in a collective: the likely cause is a rank that did not, stalled for long elsewhere.
    suspects = [(peers[r]["stalled"], r) for r in range(world_size)
                if r not in records and r != rank and peers[r]["stalled"] >= timing.timeout / 2]
    if suspects:
        stalled, r = max(suspects)
        state = peers[r]
        # A rank stuck outside a collective records itself at `timeout`: give it the chance to say where.
        return (f"{describe(r, state)} did not reach the collective: no progress for {stalled:.0f} s"
                f"{doing(state)} at {state['where']} (rank {first_r} failed waiting: {first['text']})",
                stalled >= timing.timeout + 2 * timing.interval)
    # Every rank failed in a collective (mismatched collectives, a network split): nothing more will show.
    everyone = len(records) == world_size
    return f"{describe(first_r, first)} failed in a collective{doing(first)}: {first['text']}", everyone
