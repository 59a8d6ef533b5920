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

The cause is the first error recorded by a rank that was not merely a victim of a broken collective (or of a launcher
ending it: a DataLoader worker terminated from outside); else a rank that died; else the rank that made no progress
while the others failed in a collective. A rank whose collective fails looks for the cause at once (a dead pid on its
host shows within milliseconds): launchers such as ``torchrun`` or ``srun`` terminate the survivors a fraction of a
second after one rank dies, and the cause must be printed before that. Every rank ends non-zero
within ``timeout`` + 30 s: an error, or a death on the same host, in about a second; a stuck rank at ``timeout`` +
about 5 s; a rank on another host that died, or rank 0's store lost, after ``min(timeout, 60)`` s + about 5 s.

Before the process group exists, :func:`rendezvous` opens the job's store itself and has every rank announce itself,
so a rank (a host) that never joins is named after ``timeout`` instead of an anonymous "1/2 clients joined".

Example::

    >>> monitor = FaultMonitor(rank=1, world_size=2, host="ws2", device="NVIDIA RTX 3090", timeout=60)
    >>> monitor.start()                       # after init_process_group
    >>> with monitor.phase("forward/backward", step=12, batch=12):
    ...     loss = model(batch)
    >>> monitor.stop()                        # at the end of a run: peers stop watching this rank
"""

import functools
import json
import multiprocessing
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any, Optional

import torch.distributed as dist

import lightning_hetero._compat as _compat
from lightning_hetero._compat import MultiProcessingLauncher

_JOIN = "lightning_hetero/join"
_FAULTS = "lightning_hetero/faults"
# Frames that mean "waiting for the other ranks": their collective timeout, not this watchdog, ends the wait.
_PEER_WAIT_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep, os.sep + os.path.join("torch", "autograd"))
_PEER_WAIT_PHASES = ("collective",)
# A DataLoader's own frames: the rank is loading data, whatever phase it announced last.
_DATA_FILES = os.sep + os.path.join("torch", "utils", "data") + os.sep


def rendezvous(address: str, port: int, rank: int, world_size: int, timeout: float, ranks_per_node: int = 1
               ) -> dist.TCPStore:
    """The job's store (served by rank 0), once every rank has joined it; else a ``RuntimeError`` naming who is missing.

    Pass it to ``init_process_group(store=...)``.
    """
    host = socket.gethostname()
    # Under torchrun the agent already serves the store on this port; a restarted job starts a fresh namespace.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    join = f"{_JOIN}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(address, port, world_size=world_size, is_master=rank == 0 and not agent,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as err:  # DistNetworkError / DistStoreError / TimeoutError, depending on how it failed
        if rank == 0:
            raise RuntimeError(f"rank 0 ({host}) could not serve the job's store on {address}:{port}: {err}") from err
        raise RuntimeError(
            f"rank {rank} ({host}) could not reach rank 0's store at {address}:{port} within {timeout:g} s: rank 0 "
            f"(node 0, {address}) has not started, has died or is unreachable. ({err})"
        ) from err
    store.set(f"{join}/{rank}", json.dumps({"host": host, "pid": os.getpid()}))
    keys = [f"{join}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    missing = list(range(world_size))
    try:
        while True:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            if not missing:
                return store
            if store.check([f"{join}/failed"]):  # rank 0 gave up: the same message everywhere
                raise RuntimeError(f"rank {rank} ({host}): " + store.get(f"{join}/failed").decode())
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        joined = {r: json.loads(store.get(keys[r]))["host"] for r in range(world_size) if r not in missing}
    except dist.DistError as err:  # rank 0 (the store) gave up or died first
        raise RuntimeError(
            f"rank {rank} ({host}): rank 0's store at {address}:{port} closed while ranks {missing} had not joined. "
            f"({err})") from err
    nodes = sorted({r // max(1, ranks_per_node) for r in missing})
    message = (
        f"rank(s) {missing} (node(s) {nodes}) did not join the job within {timeout:g} s; joined: "
        + ", ".join(f"rank {r} on {h}" for r, h in joined.items())
        + ". Start the missing node(s) with the same MASTER_ADDR/MASTER_PORT, or check that they can reach "
        f"{address}:{port}."
    )
    if rank == 0:  # the others read it before this process (and the store) goes
        store.set(f"{join}/failed", message)
        time.sleep(0.5)
    raise RuntimeError(f"rank {rank} ({host}): {message}")


def _default_store_address() -> Optional[tuple[str, int]]:
    """Host and port of the TCPStore under the default process group (``None``: another kind of store)."""
    store: Any = _compat.default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because of another rank (timeout, closed connection), not this rank's own fault."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)  # gloo raises plain RuntimeErrors
    # A DataLoader worker terminated (SIGTERM, not the OOM killer's SIGKILL) was ended from outside: a launcher
    # (torchrun, srun) stopping the job after another rank failed, or this watchdog.
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                                   "Timed out waiting", "NCCL", "killed by signal: Terminated"))


def lightning_hooks() -> frozenset[str]:
    """Names of the Lightning hooks (module, data module, callback) that name a phase when they fail or hang; the
    ``*_step`` hooks are left to the strategy's finer phases (``forward/backward``, ``validation`` ...)."""
    try:
        from lightning.pytorch import Callback
        from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
    except ImportError:
        return frozenset()
    names = {n for c in (Callback, ModelHooks, DataHooks, CheckpointHooks) for n in vars(c) if not n.startswith("_")}
    return frozenset(names - {"state_dict", "load_state_dict", "state_key"})


def _hook_owners() -> tuple[type, ...]:
    try:
        from lightning.pytorch import Callback, LightningDataModule, LightningModule
    except ImportError:
        return ()
    return (Callback, LightningDataModule, LightningModule)


def _frames(tb: Optional[TracebackType] = None, frame: Optional[FrameType] = None) -> list[FrameType]:
    """Frames outermost first: of a traceback (down to where it was raised) or of a live stack."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    while frame is not None:
        out.insert(0, frame)
        frame = frame.f_back
    return out


def _pid_dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is dead, just not reaped
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


def _describe(rank: int, state: Optional[dict]) -> str:
    if not state:
        return f"rank {rank}"
    return f"rank {rank} (host {state['host']}, device {state['device']}, pid {state['pid']})"


def _doing(state: Optional[dict]) -> str:
    if not state:
        return ""
    batch = f", batch {state['batch']}" if state.get("batch") is not None else ""
    return f" while in {state['phase']} at step {state['step']}{batch}"


class FaultMonitor:
    """One rank's watchdog thread (see the module docstring). ``timeout``: the job's collective timeout, seconds."""

    def __init__(self, rank: int, world_size: int, host: str, device: str, timeout: float,
                 store_address: Optional[tuple[str, int]] = None, hooks: Optional[frozenset[str]] = None) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.info = {"host": host, "device": device, "pid": os.getpid()}
        self.interval = min(1.0, max(0.1, self.timeout / 10))  # beat period
        self.dead_after = min(self.timeout, 60.0)  # a peer silent this long is dead
        self.grace = min(5.0, self.timeout)  # the training thread's chance to raise by itself
        self._address = store_address
        self._store: Optional[dist.TCPStore] = None  # the watchdog thread's connection
        self._main_store: Optional[dist.TCPStore] = None  # the training thread's
        self._ns = _FAULTS
        self._phase, self._step, self._batch = "setup", 0, None
        self._hooks = lightning_hooks() if hooks is None else hooks  # names that label a phase (see `_phase_of`)
        self._hook_owners = _hook_owners()
        self._published: Optional[tuple[str, int, Optional[int]]] = None  # last state the training thread published
        self._progress = time.monotonic()
        self._trainer_thread = threading.get_ident()
        self._thread: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        self._seq = 0
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (beat seq, local time it last changed)
        self._states: dict[int, dict] = {}
        self._failed_at: Optional[float] = None  # the training thread raised (or is stuck) since then
        self._fault: Optional[str] = None  # the job's fault, once known
        self._strong = False  # the fault names its cause (not only "a collective failed")
        self._stuck = False
        self._acked = threading.Lock()  # held once this rank told rank 0 it knows of the fault

    # -- the training thread's side -----------------------------------------------------------------------------
    def start(self) -> None:
        address = self._address or _default_store_address()
        if address is None:
            return  # not a TCPStore (e.g. a file store): nothing to watch through
        self._store, self._main_store = (
            dist.TCPStore(address[0], address[1], is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=self.dead_after)) for _ in range(2))
        # One namespace per run: every rank starts the same number of monitors in a process group's life.
        generation = self._main_store.add(f"{_FAULTS}/generation/{self.rank}", 1)
        self._ns = f"{_FAULTS}/{generation}"
        self._publish(self._main_store)
        keys = [f"{self._ns}/state/{r}" for r in range(self.world_size)]
        try:  # every rank is past init_process_group: they publish within moments
            self._main_store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as err:  # noqa: BLE001
            missing = [r for r, k in enumerate(keys) if not self._main_store.check([k])]
            raise RuntimeError(f"rank(s) {missing} did not start their watchdog within {self.timeout:g} s") from err
        now = time.monotonic()
        for r, raw in enumerate(self._main_store.multi_get(keys)):
            self._states[r], self._seen[r] = json.loads(raw), (-1, now)
        self._thread = threading.Thread(target=self._watch, name="lightning-hetero-watchdog", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._stopped.is_set()

    def enter(self, phase: str, step: Optional[int] = None, batch: Optional[int] = None) -> None:
        """The training thread moved on: a new phase (and step) is progress."""
        self._phase, self._batch = phase, batch
        if step is not None:
            self._step = step
        self._progress = time.monotonic()
        if self.active and self._failed_at is None and self._published != (phase, self._step, batch):
            assert self._main_store is not None
            # Published now, not at the next beat: a rank killed the moment after is named where it truly was.
            self._published = (phase, self._step, batch)
            try:
                self._publish(self._main_store)
            except Exception:  # noqa: BLE001 - the store is gone with rank 0: the watchdog thread reports that
                pass

    @contextmanager
    def phase(self, phase: str, step: Optional[int] = None, batch: Optional[int] = None) -> Iterator[None]:
        previous = (self._phase, self._step, self._batch)
        self.enter(phase, step, batch)
        try:
            yield
        finally:
            self.enter(*previous)

    def on_exception(self, error: BaseException) -> None:
        """Record this rank's error for the others; add the job's cause to ``error`` as a note."""
        if not self.active or self._failed_at is not None:
            return
        self._failed_at = time.monotonic()
        assert self._main_store is not None
        # A fault already known (the watchdog ended this rank's loader workers, a peer failed) makes this a victim.
        victim = is_peer_failure(error) or self._fault is not None
        text = (f"{type(error).__name__}: {error}".strip().splitlines() or [type(error).__name__])[0][:500]
        self._phase = self._phase_of(_frames(tb=error.__traceback__)) or self._phase
        said_already = False
        try:
            order = self._record(self._main_store, "peer" if victim else "error", text)
            said_already = not victim and self._recorded_before(self._main_store, text, order)
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0: the watchdog names rank 0
            pass
        if victim:
            self._find_cause()
            cause = self._fault or f"{_describe(self.rank, self._state())} failed in a collective: {text}"
        else:
            cause = f"{_describe(self.rank, self._state())} failed{_doing(self._state())}: {text}"
        if hasattr(error, "add_note"):  # Python >= 3.11; the line printed below says it on every version
            error.add_note(f"lightning_hetero: {cause}")
        if not said_already:  # the same error on every rank (a bad setting): the first rank to record it says it
            _say(self.rank, f"the job failed: {cause}")
        self._ack(self._main_store)

    def stop(self) -> None:
        """End of a run (or of a failed one). Rank 0 keeps the store up until every rank has finished or seen the
        failure."""
        if not self.active:
            return
        assert self._main_store is not None
        try:
            self._main_store.set(f"{self._ns}/done/{self.rank}", "1")
            if self.rank == 0 and self._failed_at is None:  # every rank finishes before the store goes
                keys = [f"{self._ns}/done/{r}" for r in range(self.world_size)]
                deadline = time.monotonic() + self.timeout
                while time.monotonic() < deadline and self._fault is None and not self._main_store.check(keys):
                    time.sleep(0.05)
            elif self.rank == 0:  # the others read the cause from this process's store
                self._wait_for_acks(self._main_store)
        except Exception:  # noqa: BLE001 - a store gone at the very end changes nothing for this rank
            pass
        self._stopped.set()
        # A daemon thread still inside a store call when the interpreter finalizes is ended inside C++ code, which
        # aborts the process ("terminate called without an active exception"): it ends here, and its stores with it.
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 2.0)
        if self._thread is None or not self._thread.is_alive():
            self._store = self._main_store = None

    def _find_cause(self) -> None:
        """This rank failed in a collective: look for the cause now, from this thread (a dead pid on this host shows
        at once), and again every 0.1 s until the watchdog thread or this loop finds it (a peer on another host shows
        once silent for ``dead_after``; a lost store, rank 0's, only to the watchdog thread)."""
        assert self._main_store is not None
        deadline = time.monotonic() + self.dead_after + 3 * self.interval
        while time.monotonic() < deadline and not self._strong:
            try:
                cause, strong = self._diagnose(self._main_store)
                if strong:
                    self._fault, self._strong = cause, True
                    return
            except Exception:  # noqa: BLE001 - the store is gone (the watchdog thread names rank 0), or a launcher's
                pass  # signal handler raised here (Lightning's SIGTERM handler broadcasts over the broken group)
            if self._thread is None or not self._thread.is_alive():
                return
            try:
                time.sleep(0.1)
            except Exception:  # noqa: BLE001 - a signal handler raised: the launcher is ending this process (torchrun
                deadline = min(deadline, time.monotonic() + 2.0)  # kills it 30 s after its SIGTERM): a last look

    def _phase_of(self, frames: Sequence[FrameType]) -> Optional[str]:
        """The phase the stack shows, innermost frame first: a DataLoader's code is ``data``; a Lightning hook of a
        module, data module or callback is its own name (``on_train_epoch_end``)."""
        for frame in reversed(frames):
            if _DATA_FILES in frame.f_code.co_filename:
                return "data"
            name = frame.f_code.co_name
            if name in self._hooks and isinstance(frame.f_locals.get("self"), self._hook_owners):
                return name
        return None

    # -- the watchdog thread --------------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {**self.info, "phase": self._phase, "step": self._step, "batch": self._batch}

    def _where(self) -> tuple[str, bool]:
        """Where the training thread is (its innermost frame outside the standard library) and whether it waits
        for the other ranks there."""
        frame = sys._current_frames().get(self._trainer_thread)
        if frame is None:
            return "", False
        stack = traceback.extract_stack(frame)
        top = next((f for f in reversed(stack) if not _is_stdlib(f.filename)), stack[-1])
        waiting = self._phase in _PEER_WAIT_PHASES or any(s in top.filename for s in _PEER_WAIT_FILES)
        return f"{top.filename}:{top.lineno} in {top.name}" + (f": {top.line}" if top.line else ""), waiting

    def _publish(self, store: dist.TCPStore) -> None:
        self._seq += 1
        stalled = round(time.monotonic() - self._progress, 1)
        state = self._state()
        where = ""
        if stalled >= self.interval and self._failed_at is None:  # only a slow phase needs its stack
            where = self._where()[0]
            frame = sys._current_frames().get(self._trainer_thread)
            state["phase"] = self._phase_of(_frames(frame=frame)) or state["phase"]  # e.g. the first batch's fetch
        store.set(f"{self._ns}/state/{self.rank}",
                  json.dumps({**state, "seq": self._seq, "stalled": stalled, "where": where}))

    def _record(self, store: dist.TCPStore, kind: str, text: str) -> int:
        order = store.add(f"{self._ns}/errors", 1)  # the first recorded error is the likeliest cause
        store.set(f"{self._ns}/error/{self.rank}",
                  json.dumps({**self._state(), "kind": kind, "text": text, "order": order}))
        return order

    def _recorded_before(self, store: dist.TCPStore, text: str, order: int) -> bool:
        """Another rank recorded the same error before this one (its record may still be on its way: a moment's
        wait for the ranks that counted themselves earlier)."""
        deadline = time.monotonic() + 0.5
        keys = [f"{self._ns}/error/{r}" for r in range(self.world_size) if r != self.rank]
        while True:
            records = [json.loads(store.get(k)) for k in keys if store.check([k])]
            if any(rec["text"] == text and rec["kind"] == "error" and rec["order"] < order for rec in records):
                return True
            if len([rec for rec in records if rec["order"] < order]) >= order - 1 or time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def _watch(self) -> None:
        assert self._store is not None
        lost_since: Optional[float] = None
        weak_since: Optional[float] = None
        while not self._stopped.wait(self._next_wait()):
            try:
                self._publish(self._store)
                self._check_self()
                cause, strong = self._diagnose(self._store)
                lost_since = None
                if cause is not None:
                    self._ack(self._store)
            except Exception as err:  # noqa: BLE001 - the store lives in rank 0's process
                if self._stopped.is_set():
                    return
                lost_since = lost_since or time.monotonic()
                zero = self._states.get(0)
                gone = zero is not None and zero["host"] == self.info["host"] and _pid_dead(int(zero["pid"]))
                if not gone and time.monotonic() - lost_since < min(self.dead_after, 3 * self.interval + 2):
                    continue
                if self._strong:
                    cause, strong = self._fault, True  # rank 0 ended after the cause was known
                else:
                    cause, strong = (
                        f"{_describe(0, zero)} is unreachable: the job's store in its process is gone (rank 0 died, "
                        f"was killed or its host dropped){_doing(zero)}. ({type(err).__name__}: {err})", True)
            if cause is None:
                continue
            self._fault, self._strong = cause, strong
            weak_since = weak_since or time.monotonic()
            # Only "a collective failed" so far: a dead peer needs `dead_after` to show.
            if strong or time.monotonic() - weak_since > self.dead_after + self.interval:
                self._end(cause)
                return

    def _next_wait(self) -> float:
        """One beat per `interval` (a few store round trips: no noise on step times), and one right when this
        rank's progress turns `timeout` old."""
        until_stall = self._progress + self.timeout - time.monotonic()
        return until_stall if 0.0 < until_stall < self.interval else self.interval

    def _check_self(self) -> None:
        """Record this rank as stuck when its training thread has made no progress for ``timeout`` seconds."""
        stalled = time.monotonic() - self._progress
        if stalled < self.timeout or self._failed_at is not None:
            return
        where, waiting = self._where()
        # Waiting in a collective: its own timeout ends it (as a peer failure); this is the backstop.
        if waiting and stalled < self.timeout + 15.0:
            return
        frame = sys._current_frames().get(self._trainer_thread)
        stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else ""
        self._phase = self._phase_of(_frames(frame=frame)) or self._phase
        _say(self.rank, f"{_describe(self.rank, self._state())} is stuck: no progress for {stalled:.0f} s"
                        f"{_doing(self._state())}; training thread:\n{stack}")
        assert self._store is not None
        self._record(self._store, "stuck", f"no progress for {stalled:.0f} s (timeout={self.timeout:g} s) at {where}")
        self._failed_at = time.monotonic()
        self._stuck = True  # its training thread cannot raise: end the process now

    def _diagnose(self, store: dist.TCPStore) -> tuple[Optional[str], bool]:
        """The job's fault as a sentence naming the rank (``None`` while all is well), and whether it names the
        cause rather than only a failed collective. ``store``: the calling thread's connection."""
        now = time.monotonic()
        peers = [r for r in range(self.world_size) if r != self.rank]
        for r, raw in zip(peers, store.multi_get([f"{self._ns}/state/{r}" for r in peers])):
            state = json.loads(raw)
            self._states[r] = state
            if self._seen.get(r, (None,))[0] != state["seq"]:
                self._seen[r] = (state["seq"], now)
        errors = int(store.add(f"{self._ns}/errors", 0))
        dead = [r for r in peers if self._silent(store, r, now)]
        if not errors and not dead:
            return None, False
        return self._cause(store, dead)

    def _silent(self, store: dist.TCPStore, r: int, now: float) -> bool:
        state = self._states[r]
        silent = now - self._seen[r][1] > self.dead_after or (
            state["host"] == self.info["host"] and _pid_dead(int(state["pid"])))
        # A rank that finished its run is silent on purpose (asked only then: one round trip less per beat).
        return silent and not store.check([f"{self._ns}/done/{r}"])

    def _cause(self, store: dist.TCPStore, dead: Sequence[int]) -> tuple[Optional[str], bool]:
        records = []
        for r in range(self.world_size):
            key = f"{self._ns}/error/{r}"
            if store.check([key]):
                records.append((r, json.loads(store.get(key))))
        own = [(rec["order"], r, rec) for r, rec in records if rec["kind"] != "peer"]
        if own:
            _, r, rec = min(own)
            verb = "is stuck" if rec["kind"] == "stuck" else "failed"
            return f"{_describe(r, rec)} {verb}{_doing(rec)}: {rec['text']}", True
        if dead:
            r = dead[0]
            last = self._states.get(r)
            doing = f" (last reported: {last['phase']} at step {last['step']})" if last else ""
            return (f"{_describe(r, last)} stopped responding{doing}: its process died (killed, out of host memory, "
                    "os._exit) or its host dropped"), True
        if not records:
            return None, False
        failed = {r for r, _ in records}
        first_r, first = min(records, key=lambda x: x[1]["order"])
        # The others failed in a collective: the likely cause is a rank that did not, stalled for long elsewhere.
        suspects = [(self._states[r]["stalled"], r) for r in range(self.world_size)
                    if r not in failed and r != self.rank and self._states[r]["stalled"] >= self.timeout / 2]
        if suspects:
            stalled, r = max(suspects)
            state = self._states[r]
            # A rank stuck outside a collective records itself at `timeout`: give it the chance to say where.
            return (f"{_describe(r, state)} did not reach the collective: no progress for {stalled:.0f} s"
                    f"{_doing(state)} at {state['where']} (rank {first_r} failed waiting: {first['text']})",
                    stalled >= self.timeout + 2 * self.interval)
        # Every rank failed in a collective (mismatched collectives, a network split): nothing more will show.
        everyone = len(failed) == self.world_size
        return f"{_describe(first_r, first)} failed in a collective{_doing(first)}: {first['text']}", everyone

    def _end(self, cause: str) -> None:
        """Give the training thread ``grace`` seconds to raise by itself, then end the process."""
        deadline = time.monotonic() + (0.0 if self._stuck else self.grace)
        while time.monotonic() < deadline:
            if self._stopped.wait(0.05):
                return  # the training thread raised and left the run: it exits on its own
        _say(self.rank, f"the job failed: {cause}. Ending this process.")
        for child in multiprocessing.active_children():  # dataloader workers would outlive an os._exit
            child.kill()
        if self.rank == 0 and self._store is not None:  # the store lives here: let the others read the cause
            self._wait_for_acks(self._store)
        os._exit(1)

    def _ack(self, store: dist.TCPStore) -> None:
        if self._acked.acquire(blocking=False):
            try:
                store.add(f"{self._ns}/acks", 1)
            except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
                pass

    def _wait_for_acks(self, store: dist.TCPStore) -> None:
        """Rank 0: wait (briefly) until every other rank has seen the fault."""
        deadline = time.monotonic() + 3 * self.interval + 1
        try:
            while time.monotonic() < deadline and store.add(f"{self._ns}/acks", 0) < self.world_size - 1:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - gone already: nothing to wait for
            pass


class ReportingLauncher(MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, whose ranks also report their own exception to their strategy
    (``Strategy.on_exception``) before it leaves them: Lightning calls it only in the launching process, after a rank
    is gone, so a rank's watchdog never heard of the rank's own error (nor had the chance to name a dead peer before
    the launcher terminates the survivors)."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return super().launch(functools.partial(_report_exceptions, function), *args, trainer=trainer, **kwargs)


def _report_exceptions(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a rank's ``trainer._fit_impl`` (or validate/test/predict); its exception goes to the trainer's strategy
    first. Module level: the spawn launcher pickles it."""
    try:
        return function(*args, **kwargs)
    except BaseException as error:
        strategy = getattr(getattr(function, "__self__", None), "strategy", None)
        if strategy is not None:
            try:
                strategy.on_exception(error)
            except Exception:  # noqa: BLE001 - never hide the rank's own exception behind the report's
                pass
        raise


def _is_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "-packages" not in filename


_STDLIB = sysconfig.get_paths()["stdlib"]


def _say(rank: int, message: str) -> None:
    sys.stderr.write(f"[rank {rank}] lightning_hetero: {message}\n")
    sys.stderr.flush()
