"""The watchdog's rules on hand-written records: who is the cause, and what the sentence says (no store, no thread)."""

import os
import subprocess

from lightning_hetero.resilience.diagnosis import Timing, error_text, job_fault, looks_dead

TIMING = Timing.of(10)


def _state(host: str = "ws2", phase: str = "forward/backward", step: int = 7, stalled: float = 0.0) -> dict:
    return {"host": host, "device": "RTX 3090", "pid": 42, "phase": phase, "step": step, "batch": None,
            "seq": 1, "stalled": stalled, "where": "model.py:9 in training_step"}


def _record(kind: str, order: int, text: str = "RuntimeError: boom", **state) -> dict:
    return {**_state(**state), "kind": kind, "text": text, "order": order}


def test_the_clock_follows_the_timeout():
    assert Timing.of(10) == Timing(timeout=10.0, interval=1.0, dead_after=10.0, grace=5.0)
    assert Timing.of(600) == Timing(timeout=600.0, interval=1.0, dead_after=60.0, grace=5.0)
    assert Timing.of(0.5) == Timing(timeout=0.5, interval=0.1, dead_after=0.5, grace=0.5)


def test_all_is_well_without_records_or_dead_ranks():
    assert job_fault({}, [], {0: _state(), 1: _state()}, 0, 2, TIMING) == (None, False)


def test_the_first_own_error_is_the_cause_not_the_victims():
    records = {0: _record("peer", 1, "DistBackendError: closed"), 2: _record("error", 3, "ValueError: late"),
               1: _record("error", 2, "OutOfMemoryError: CUDA out of memory", phase="data", step=12)}
    cause, strong = job_fault(records, [3], {}, 0, 4, TIMING)
    assert strong
    assert cause == ("rank 1 (host ws2, device RTX 3090, pid 42) failed while in data at step 12: "
                     "OutOfMemoryError: CUDA out of memory")


def test_a_stuck_record_says_stuck():
    cause, strong = job_fault({1: _record("stuck", 1, "no progress for 10 s")}, [], {}, 0, 2, TIMING)
    assert strong and " is stuck while in forward/backward at step 7: no progress for 10 s" in cause


def test_a_dead_rank_is_named_with_what_it_last_reported():
    cause, strong = job_fault({0: _record("peer", 1)}, [1], {1: _state(phase="optimizer", step=3)}, 0, 2, TIMING)
    assert strong and cause.startswith("rank 1 (host ws2") and "(last reported: optimizer at step 3)" in cause
    assert "stopped responding" in cause


def test_a_rank_that_never_reached_the_collective_is_the_suspect():
    """Rank 0 failed waiting; rank 1 made no progress for 6 s (over timeout / 2): named, but only as a weak cause
    until it is past the time it records itself stuck (timeout + 2 beats)."""
    peers = {0: _state(), 1: _state(phase="data", stalled=6.0)}
    cause, strong = job_fault({0: _record("peer", 1, "Timed out waiting")}, [], peers, 0, 2, TIMING)
    assert not strong and cause.startswith("rank 1 (host ws2") and "did not reach the collective" in cause
    assert "at model.py:9 in training_step (rank 0 failed waiting: Timed out waiting)" in cause
    peers[1] = _state(stalled=12.0)
    assert job_fault({0: _record("peer", 1)}, [], peers, 0, 2, TIMING)[1]


def test_every_rank_failing_in_a_collective_is_final():
    records = {0: _record("peer", 2, "A"), 1: _record("peer", 1, "B")}
    cause, strong = job_fault(records, [], {0: _state(), 1: _state()}, 0, 2, TIMING)
    assert strong and cause.startswith("rank 1 ") and cause.endswith("failed in a collective while in "
                                                                      "forward/backward at step 7: B")
    assert not job_fault({0: records[0]}, [], {0: _state(), 1: _state(), 2: _state()}, 0, 3, TIMING)[1]


def test_silence_or_a_gone_pid_on_this_host_looks_dead():
    ended = subprocess.Popen(["true"])
    ended.wait()
    alive = {**_state(host="here"), "pid": os.getpid()}
    assert not looks_dead(alive, last_beat=100.0, now=105.0, dead_after=10.0, host="here")
    assert looks_dead(alive, last_beat=100.0, now=111.0, dead_after=10.0, host="here")
    assert looks_dead({**alive, "pid": ended.pid}, last_beat=100.0, now=101.0, dead_after=10.0, host="here")
    # On another host a pid says nothing: only the silence counts.
    assert not looks_dead({**alive, "pid": ended.pid}, last_beat=100.0, now=101.0, dead_after=10.0, host="elsewhere")


def test_an_error_is_recorded_as_its_first_line():
    assert error_text(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert error_text(KeyboardInterrupt()) == "KeyboardInterrupt:"
    assert len(error_text(RuntimeError("x" * 1000))) == 500


class _GoneBoard:
    """Rank 0's store, gone: every call fails (its process ended once every rank had told it of the fault)."""

    def __getattr__(self, name):
        def gone(*args, **kwargs):
            raise ConnectionError("Broken pipe")

        return gone


class _Alive:
    def is_alive(self):
        return True


def _monitor_with_store_gone(fault):
    import threading

    from lightning_hetero.resilience.watchdog import FaultMonitor

    monitor = FaultMonitor(1, 2, "vm", "cpu", timeout=0.5)  # a short clock: the search for a cause gives up soon
    monitor._board, monitor._thread = _GoneBoard(), _Alive()
    monitor.record.fault = fault
    assert isinstance(monitor.record.acked, type(threading.Lock()))
    return monitor


def test_a_bad_setting_said_by_a_peer_first_is_not_said_again_when_the_store_is_gone(capsys):
    """The same error on both ranks: rank 1's watchdog read rank 0's record (and told rank 0, which ended with its
    store); rank 1's own error then finds the store gone. It said its own line too (the message 3 times, not 2)."""
    error = ValueError("`capacities` has 3 weights but the job has 2 ranks: give one per rank.")
    peer = f"rank 0 (host vm, device cpu, pid 1) failed while in setup at step 0: {error_text(error)}"
    _monitor_with_store_gone(peer).on_exception(error)
    assert "the job failed" not in capsys.readouterr().err
    # Another error than the peer's, or no peer's cause known: this rank says its own.
    other = ValueError("`global_batch_size` must be positive")
    _monitor_with_store_gone(peer).on_exception(other)
    assert "the job failed" in capsys.readouterr().err
    monitor = _monitor_with_store_gone(None)
    monitor.on_exception(error)
    assert "rank 1" in capsys.readouterr().err and not monitor.record.acked.acquire(blocking=False)  # told once


def test_rank_0_counts_only_the_other_ranks_word():
    """Rank 0 waits (briefly) for every other rank to know of the fault before its store goes; its own failure
    counted as one of those words, so on two ranks it never waited."""
    from lightning_hetero.resilience.watchdog import FaultMonitor, acknowledge

    class Board:
        acks = 0

        def ack(self):
            Board.acks += 1

    for rank in (0, 1):
        acknowledge(FaultMonitor(rank, 2, "vm", "cpu", timeout=0.5).record, Board())
    assert Board.acks == 1

