"""Fail fast, everywhere, with the cause: a watchdog on every rank, independent of the training collectives.

A collective timeout ends only the ranks that wait in it, says nothing about *why*, and leaves a rank that is stuck
elsewhere (a dataloader that never returns, a hung kernel) running forever, holding its GPU. Here every rank runs a
daemon thread that talks to the job's rendezvous store (the TCPStore in rank 0's process), not to the process group:

- it publishes the rank's state: host, device, pid, phase (``"data"``, ``"forward/backward"``, ``"optimizer"``,
  ``"collective"``, ``"validation"``, ``"checkpoint"``, or the Lightning hook that runs, e.g. ``"on_train_epoch_end"``),
  step and batch, how long the training thread has been in that phase and where (file:line). The training thread
  publishes each phase change itself (one store write, about 10 µs on one host), so a rank killed the moment after is
  still named with its true step and phase; the thread beats about once a second besides;
- a rank whose training thread raises records the error (``on_exception``) before it exits, with the phase read off
  the error's traceback (a DataLoader's frames: ``data``; a Lightning hook's: its name);
- a rank whose training thread makes no progress for ``timeout`` seconds outside a collective records itself as
  stuck, with its stack (inside a collective the collective's own timeout fires first; it is the backstop);
- every watchdog reads the others: a recorded error, a beat that stopped for ``min(timeout, 60)`` s (or a pid gone
  on the same host) or a lost store (rank 0 died or its host dropped) is a fault of the job. The training thread
  gets a few seconds to raise by itself (its exception then carries the cause as a note); otherwise the watchdog
  prints the cause, kills the rank's own child processes (dataloader workers) and ends the process with
  ``os._exit(1)``, which is how a rank blocked in C code ends and no orphan is left.

Which fault is the cause, and how it is said, are the rules of :mod:`~lightning_hetero.resilience.diagnosis`. A rank
whose collective fails looks for the cause at once (a dead pid on its host shows within milliseconds): launchers such
as ``torchrun`` or ``srun`` terminate the survivors a fraction of a second after one rank dies, and the cause must be
printed before that. Every rank ends non-zero within ``timeout`` + 30 s: an error, or a death on the same host, in
about a second; a stuck rank at ``timeout`` + about 5 s; a rank on another host that died, or rank 0's store lost,
after ``min(timeout, 60)`` s + about 5 s.

The shape is torch elastic's agent: the two threads share one small :class:`RankRecord`; :class:`FaultMonitor` is the
training thread's side (phases, its own error, the end of a run) and :class:`Watchdog` the monitor loop of the other
thread. Each side talks to the store through its own connection, a :class:`FaultBoard` (the keys of one run).

Example::

    >>> monitor = FaultMonitor(rank=1, world_size=2, host="ws2", device="NVIDIA RTX 3090", timeout=60)
    >>> monitor.start()                       # after init_process_group
    >>> with monitor.phase("forward/backward", step=12, batch=12):
    ...     loss = model(batch)
    >>> monitor.stop()                        # at the end of a run: peers stop watching this rank
"""

import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

import lightning_hetero._compat as _compat
from lightning_hetero.resilience import diagnosis
from lightning_hetero.resilience.diagnosis import Timing
from lightning_hetero.resilience.stacks import PhaseReader, frames, last_lines, thread_frame, where

_FAULTS = "lightning_hetero/faults"


class FaultBoard:
    """One run's fault keys in the job's store, through one connection (each thread has its own): every rank's
    state, the failed ranks' records, who finished, who has seen the fault."""

    def __init__(self, store: dist.TCPStore, namespace: str, rank: int, world_size: int) -> None:
        self.store, self.ns, self.rank, self.world_size = store, namespace, rank, world_size

    def publish(self, state: dict) -> None:
        self.store.set(f"{self.ns}/state/{self.rank}", json.dumps(state))

    def wait_for_states(self, timeout: float) -> dict[int, dict]:
        """Every rank's first state, once all have published (within ``timeout`` s, else a ``RuntimeError``)."""
        keys = [f"{self.ns}/state/{r}" for r in range(self.world_size)]
        try:  # every rank is past init_process_group: they publish within moments
            self.store.wait(keys, timedelta(seconds=timeout))
        except Exception as err:  # noqa: BLE001
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise RuntimeError(f"rank(s) {missing} did not start their watchdog within {timeout:g} s") from err
        return {r: json.loads(raw) for r, raw in enumerate(self.store.multi_get(keys))}

    def peer_states(self) -> dict[int, dict]:
        peers = [r for r in range(self.world_size) if r != self.rank]
        return {r: json.loads(raw) for r, raw in zip(peers, self.store.multi_get(
            [f"{self.ns}/state/{r}" for r in peers]))}

    def record(self, state: dict, kind: str, text: str) -> int:
        """This rank's failure (``kind``: see :mod:`~lightning_hetero.resilience.diagnosis`); its job-wide order."""
        order = int(self.store.add(f"{self.ns}/errors", 1))  # the first recorded error is the likeliest cause
        self.store.set(f"{self.ns}/error/{self.rank}",
                       json.dumps({**state, "kind": kind, "text": text, "order": order}))
        return order

    def error_count(self) -> int:
        return int(self.store.add(f"{self.ns}/errors", 0))

    def records(self, ranks: Optional[Sequence[int]] = None) -> dict[int, dict]:
        out = {}
        for r in ranks if ranks is not None else range(self.world_size):
            key = f"{self.ns}/error/{r}"
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def recorded_before(self, text: str, order: int) -> bool:
        """Another rank recorded the same error before this one (its record may still be on its way: a moment's
        wait for the ranks that counted themselves earlier)."""
        deadline = time.monotonic() + 0.5
        others = [r for r in range(self.world_size) if r != self.rank]
        while True:
            records = list(self.records(others).values())
            if any(rec["text"] == text and rec["kind"] == "error" and rec["order"] < order for rec in records):
                return True
            if len([rec for rec in records if rec["order"] < order]) >= order - 1 or time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def finish(self) -> None:
        self.store.set(f"{self.ns}/done/{self.rank}", "1")

    def finished(self, rank: int) -> bool:
        return self.store.check([f"{self.ns}/done/{rank}"])

    def all_finished(self) -> bool:
        return self.store.check([f"{self.ns}/done/{r}" for r in range(self.world_size)])

    def ack(self) -> None:
        self.store.add(f"{self.ns}/acks", 1)

    def acks(self) -> int:
        return int(self.store.add(f"{self.ns}/acks", 0))


@dataclass
class RankRecord:
    """What the two sides of one rank's watchdog share. The training thread writes the phase and its progress; either
    side may be the first to record a failure (``failed_at``) or to learn the job's fault (``fault``)."""

    rank: int
    world_size: int
    # host, device, pid: fixed for the run.
    info: dict
    timing: Timing
    reader: PhaseReader
    trainer_thread: int
    phase: str = "setup"
    step: int = 0
    batch: Optional[int] = None
    # Local time of the training thread's last progress (a new phase).
    progress: float = field(default_factory=time.monotonic)
    # This rank raised (or was found stuck) at this local time.
    failed_at: Optional[float] = None
    # The job's fault once known, and whether it names the cause (not only "a collective failed").
    fault: Optional[str] = None
    strong: bool = False
    # The watchdog found the training thread stuck: it cannot raise, the watchdog ends the process.
    stuck: bool = False
    # The beats this rank published. Both threads publish, so the count moves under its lock (`+=` is not atomic).
    seq: int = 0
    seq_lock: threading.Lock = field(default_factory=threading.Lock)
    # Every rank's last read state, and each peer's (beat seq, local time it last changed).
    peers: dict[int, dict] = field(default_factory=dict)
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    stopped: threading.Event = field(default_factory=threading.Event)
    # Held once this rank told rank 0 it knows of the fault.
    acked: threading.Lock = field(default_factory=threading.Lock)

    def state(self) -> dict:
        return {**self.info, "phase": self.phase, "step": self.step, "batch": self.batch}


def publish(record: RankRecord, board: FaultBoard) -> None:
    """One beat: the rank's state, with the training thread's stack position when its phase is slow."""
    with record.seq_lock:
        record.seq += 1
        seq = record.seq
    stalled = round(time.monotonic() - record.progress, 1)
    state = record.state()
    place = ""
    if stalled >= record.timing.interval and record.failed_at is None:  # only a slow phase needs its stack
        frame = thread_frame(record.trainer_thread)
        place = where(frame, record.phase)[0]
        state["phase"] = record.reader.phase_of(frames(frame=frame)) or state["phase"]  # e.g. the first batch's fetch
    board.publish({**state, "seq": seq, "stalled": stalled, "where": place})


def diagnose(record: RankRecord, board: FaultBoard) -> tuple[Optional[str], bool]:
    """The job's fault (:func:`~lightning_hetero.resilience.diagnosis.job_fault`) from what the board holds now;
    ``board``: the calling thread's connection."""
    now = time.monotonic()
    for r, state in board.peer_states().items():
        record.peers[r] = state
        if record.seen.get(r, (None,))[0] != state["seq"]:
            record.seen[r] = (state["seq"], now)
    errors = board.error_count()
    host, dead_after = record.info["host"], record.timing.dead_after
    # A rank that finished its run is silent on purpose (asked only then: one round trip less per beat).
    dead = [r for r in range(record.world_size) if r != record.rank
            and diagnosis.looks_dead(record.peers[r], record.seen[r][1], now, dead_after, host)
            and not board.finished(r)]
    if not errors and not dead:
        return None, False
    return diagnosis.job_fault(board.records(), dead, record.peers, record.rank, record.world_size, record.timing)


def acknowledge(record: RankRecord, board: FaultBoard) -> None:
    """Tell rank 0 (once) that this rank knows of the fault. Rank 0 itself tells nobody: counted, its own word let
    it end (and its store with it) at once on two ranks, before the other could read the fault there."""
    if record.rank != 0 and record.acked.acquire(blocking=False):
        try:
            board.ack()
        except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
            pass


def wait_for_acks(record: RankRecord, board: FaultBoard) -> None:
    """Rank 0: wait (briefly) until every other rank has seen the fault."""
    deadline = time.monotonic() + 3 * record.timing.interval + 1
    try:
        while time.monotonic() < deadline and board.acks() < record.world_size - 1:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - gone already: nothing to wait for
        pass


class Watchdog:
    """The watchdog thread's side: beats, records its own rank stuck, reads the others, ends the process on a fault."""

    def __init__(self, record: RankRecord, board: FaultBoard) -> None:
        self.record, self.board = record, board

    def run(self) -> None:
        record, timing = self.record, self.record.timing
        lost_since: Optional[float] = None
        weak_since: Optional[float] = None
        while not record.stopped.wait(self._next_wait()):
            try:
                publish(record, self.board)
                self._check_self()
                cause, strong = diagnose(record, self.board)
                lost_since = None
                if cause is not None:
                    # Known here before rank 0 is told: once told, its store may go, and this rank's training
                    # thread then reads the cause from the record (``on_exception``).
                    record.fault, record.strong = cause, strong
                    acknowledge(record, self.board)
            except Exception as err:  # noqa: BLE001 - the store lives in rank 0's process
                if record.stopped.is_set():
                    return
                lost_since = lost_since or time.monotonic()
                zero = record.peers.get(0)
                gone = diagnosis.gone_on_host(zero, record.info["host"])
                if not gone and time.monotonic() - lost_since < min(timing.dead_after, 3 * timing.interval + 2):
                    continue
                # Rank 0 ended after the cause was known, or it is the cause.
                cause, strong = (record.fault, True) if record.strong else (diagnosis.store_lost(zero, err), True)
            if cause is None:
                continue
            record.fault, record.strong = cause, strong
            weak_since = weak_since or time.monotonic()
            # Only "a collective failed" so far: a dead peer needs `dead_after` to show.
            if strong or time.monotonic() - weak_since > timing.dead_after + timing.interval:
                self._end(cause)
                return

    def _next_wait(self) -> float:
        """One beat per interval (a few store round trips: no noise on step times), and one right when this rank's
        progress turns ``timeout`` old."""
        timing = self.record.timing
        until_stall = self.record.progress + timing.timeout - time.monotonic()
        return until_stall if 0.0 < until_stall < timing.interval else timing.interval

    def _check_self(self) -> None:
        """Record this rank as stuck when its training thread has made no progress for ``timeout`` seconds."""
        record, timeout = self.record, self.record.timing.timeout
        stalled = time.monotonic() - record.progress
        if stalled < timeout or record.failed_at is not None:
            return
        frame = thread_frame(record.trainer_thread)
        place, waiting = where(frame, record.phase)
        # Waiting in a collective: its own timeout ends it (as a peer failure); this is the backstop.
        if waiting and stalled < timeout + 15.0:
            return
        record.phase = record.reader.phase_of(frames(frame=frame)) or record.phase
        say(record.rank, f"{diagnosis.stuck(record.rank, record.state(), stalled)}; training thread:\n"
                         f"{last_lines(frame)}")
        self.board.record(record.state(), "stuck",
                          f"no progress for {stalled:.0f} s (timeout={timeout:g} s) at {place}")
        record.failed_at = time.monotonic()
        record.stuck = True

    def _end(self, cause: str) -> None:
        """Give the training thread ``grace`` seconds to raise by itself, then end the process."""
        record = self.record
        deadline = time.monotonic() + (0.0 if record.stuck else record.timing.grace)
        while time.monotonic() < deadline:
            if record.stopped.wait(0.05):
                return  # the training thread raised and left the run: it exits on its own
        say(record.rank, f"the job failed: {cause}. Ending this process.")
        for child in multiprocessing.active_children():  # dataloader workers would outlive an os._exit
            child.kill()
        if record.rank == 0:  # the store lives here: let the others read the cause
            wait_for_acks(record, self.board)
        os._exit(1)


class FaultMonitor:
    """One rank's fault watchdog, seen from the training thread (see the module docstring). ``timeout``: the job's
    collective timeout, seconds; ``store_address``: the job's TCPStore (default: the default process group's)."""

    def __init__(self, rank: int, world_size: int, host: str, device: str, timeout: float,
                 store_address: Optional[tuple[str, int]] = None, hooks: Optional[frozenset[str]] = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timing = Timing.of(timeout)
        self.record = RankRecord(rank, world_size, {"host": host, "device": device, "pid": os.getpid()}, self.timing,
                                 PhaseReader.of_lightning(hooks), threading.get_ident())
        self._address = store_address
        self._board: Optional[FaultBoard] = None  # the training thread's connection
        self._watchdog: Optional[Watchdog] = None  # holds the other thread's connection
        self._thread: Optional[threading.Thread] = None
        self._published: Optional[tuple[str, int, Optional[int]]] = None  # last state the training thread published

    def start(self) -> None:
        address = self._address or _default_store_address()
        if address is None:
            return  # not a TCPStore (e.g. a file store): nothing to watch through
        watcher_store, main_store = (
            dist.TCPStore(address[0], address[1], is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=self.timing.dead_after)) for _ in range(2))
        # One namespace per run: every rank starts the same number of monitors in a process group's life.
        generation = main_store.add(f"{_FAULTS}/generation/{self.rank}", 1)
        namespace = f"{_FAULTS}/{generation}"
        self._board = FaultBoard(main_store, namespace, self.rank, self.world_size)
        record = self.record
        publish(record, self._board)
        record.peers.update(self._board.wait_for_states(self.timing.timeout))
        now = time.monotonic()
        record.seen.update({r: (-1, now) for r in record.peers})
        self._watchdog = Watchdog(record, FaultBoard(watcher_store, namespace, self.rank, self.world_size))
        self._thread = threading.Thread(target=self._watchdog.run, name="lightning-hetero-watchdog", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None and not self.record.stopped.is_set()

    def enter(self, phase: str, step: Optional[int] = None, batch: Optional[int] = None) -> None:
        """The training thread moved on: a new phase (and step) is progress."""
        record = self.record
        record.phase, record.batch = phase, batch
        if step is not None:
            record.step = step
        record.progress = time.monotonic()
        if self.active and record.failed_at is None and self._published != (phase, record.step, batch):
            assert self._board is not None
            # Published now, not at the next beat: a rank killed the moment after is named where it truly was.
            self._published = (phase, record.step, batch)
            try:
                publish(record, self._board)
            except Exception:  # noqa: BLE001 - the store is gone with rank 0: the watchdog thread reports that
                pass

    @contextmanager
    def phase(self, phase: str, step: Optional[int] = None, batch: Optional[int] = None) -> Iterator[None]:
        record = self.record
        previous = (record.phase, record.step, record.batch)
        self.enter(phase, step, batch)
        try:
            yield
        finally:
            self.enter(*previous)

    def on_exception(self, error: BaseException) -> None:
        """Record this rank's error for the others; add the job's cause to ``error`` as a note."""
        record = self.record
        if not self.active or record.failed_at is not None:
            return
        record.failed_at = time.monotonic()
        assert self._board is not None
        # Rank 0 is told this rank knows of the fault only once this rank's line is decided: told by a watchdog beat
        # meanwhile, rank 0 could end (its store with it) before this rank found its error recorded there.
        telling = record.acked.acquire(blocking=False)
        try:
            # A fault already known (the watchdog ended this rank's loader workers, a peer failed) makes this a victim.
            victim = diagnosis.is_peer_failure(error) or record.fault is not None
            text = diagnosis.error_text(error)
            record.phase = record.reader.phase_of(frames(tb=error.__traceback__)) or record.phase
            said_already = False
            try:
                order = self._board.record(record.state(), "peer" if victim else "error", text)
                said_already = not victim and self._board.recorded_before(text, order)
            except Exception:  # noqa: BLE001 - the store may be gone with rank 0: the watchdog names rank 0
                pass
            # The watchdog read a peer's fault first (rank 0's store may be gone since it was told): where that cause
            # holds this error's own words (a bad setting fails every rank alike), the peer said it.
            fault = record.fault
            if not diagnosis.is_peer_failure(error) and text and fault is not None and text in fault:
                said_already = True
            if victim:
                self._find_cause()
                cause = record.fault or diagnosis.collective_failure(self.rank, record.state(), text)
            else:
                cause = diagnosis.own_failure(self.rank, record.state(), text)
            if hasattr(error, "add_note"):  # Python >= 3.11; the line printed below says it on every version
                error.add_note(f"lightning_hetero: {cause}")
            if not said_already:  # the same error on every rank (a bad setting): the first rank to record it says it
                say(self.rank, f"the job failed: {cause}")
        finally:
            if telling:
                record.acked.release()
        acknowledge(record, self._board)

    def stop(self) -> None:
        """End of a run (or of a failed one). Rank 0 keeps the store up until every rank has finished or seen the
        failure."""
        if not self.active:
            return
        assert self._board is not None
        record = self.record
        try:
            self._board.finish()
            if self.rank == 0 and record.failed_at is None:  # every rank finishes before the store goes
                deadline = time.monotonic() + self.timing.timeout
                while time.monotonic() < deadline and record.fault is None and not self._board.all_finished():
                    time.sleep(0.05)
            elif self.rank == 0:  # the others read the cause from this process's store
                wait_for_acks(record, self._board)
        except Exception:  # noqa: BLE001 - a store gone at the very end changes nothing for this rank
            pass
        record.stopped.set()
        # A daemon thread still inside a store call when the interpreter finalizes is ended inside C++ code, which
        # aborts the process ("terminate called without an active exception"): it ends here, and its stores with it.
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timing.interval + 2.0)
        if self._thread is None or not self._thread.is_alive():
            self._board = self._watchdog = None

    def _find_cause(self) -> None:
        """This rank failed in a collective: look for the cause now, from this thread (a dead pid on this host shows
        at once), and again every 0.1 s until the watchdog thread or this loop finds it (a peer on another host shows
        once silent for ``dead_after``; a lost store, rank 0's, only to the watchdog thread)."""
        assert self._board is not None
        record, timing = self.record, self.timing
        deadline = time.monotonic() + timing.dead_after + 3 * timing.interval
        while time.monotonic() < deadline and not record.strong:
            try:
                cause, strong = diagnose(record, self._board)
                if strong:
                    record.fault, record.strong = cause, True
                    return
            except Exception:  # noqa: BLE001 - the store is gone (the watchdog thread names rank 0), or a launcher's
                pass  # signal handler raised here (Lightning's SIGTERM handler broadcasts over the broken group)
            if self._thread is None or not self._thread.is_alive():
                return
            try:
                time.sleep(0.1)
            except Exception:  # noqa: BLE001 - a signal handler raised: the launcher is ending this process (torchrun
                deadline = min(deadline, time.monotonic() + 2.0)  # kills it 30 s after its SIGTERM): a last look


def _default_store_address() -> Optional[tuple[str, int]]:
    """Host and port of the TCPStore under the default process group (``None``: another kind of store)."""
    store: Any = _compat.default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def say(rank: int, message: str) -> None:
    sys.stderr.write(f"[rank {rank}] lightning_hetero: {message}\n")
    sys.stderr.flush()
