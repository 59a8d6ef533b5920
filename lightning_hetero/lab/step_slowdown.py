"""The pause that makes a rank's steps ``slowdown`` times slower: after each step the rank waits ``(slowdown - 1) ×``
the compute the step took, collectives left out.

On CPU there are no SMs to cap: the compute is the CPU time the rank's training thread spent in the step (Lightning's
launchers give each CPU rank cores / ranks intra-op threads; with more than one, work on the other threads is not
counted). CPU time, not wall time: a rank blocked waiting for a slower rank's all-reduce would otherwise sleep for
that wait too, and slowed ranks would inflate each other. The CPU that collectives inside the step burn (the
strategy's weighted ``reduce``; DDP's wait for the gradient all-reduce after the last bucket) is left out too: a slower
card computes slower, its communication is not slowed. The pause sleeps except for its last millisecond, which is
busy-waited: a core that slept comes back cold and slow, and that would be multiplied by the slowdown again (a 3x
rank measured 5-6x on a millisecond step). On a GPU (a profile's ``slowdown`` there) the step's wall time is the
compute, after a synchronization.

Example::
    >>> times = EmulatedTime()
    >>> with StepSlowdown(3.0, torch.device("cpu"), times).step():
    ...     training_step()
    >>> times.slept_seconds / times.compute_seconds   # about 2
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

# The last stretch of every emulated pause is a busy wait: a core that sleeps between steps comes back with cold
# caches and a low clock (measured on a 2-core VM: a 0.25 ms MLP step took 0.5-0.9 ms right after a sleep), which the
# slowdown would multiply again; a pause of a millisecond or less is busy-waited entirely.
_BUSY_WAIT_S = 0.001


def _pause(seconds: float) -> None:
    """Let ``seconds`` pass, sleeping all but the last millisecond."""
    deadline = time.perf_counter() + seconds
    if seconds > _BUSY_WAIT_S:
        time.sleep(seconds - _BUSY_WAIT_S)
    while time.perf_counter() < deadline:
        pass


@dataclass
class EmulatedTime:
    """What an emulated rank's steps measured and what the emulation added after them (a CPU pause or a GPU idle)."""

    compute_seconds: float = 0.0  # measured step time (CPU: thread CPU time) before the slowdown
    slept_seconds: float = 0.0


class StepSlowdown:
    """Pauses one rank ``factor`` times slower after each :meth:`step`, counting into ``times``.

    ``factor`` may change between steps (a throttle). The collective hooks act only on a CPU rank with ``factor`` > 1
    (:attr:`slows_cpu`), inside a step.
    """

    def __init__(self, factor: float, root_device: torch.device, times: EmulatedTime) -> None:
        self.factor = factor
        self.root_device = root_device
        self.times = times
        self._in_step = False
        self._collective_cpu = 0.0  # this step's CPU seconds inside collectives
        self._bucket_cpu: Optional[float] = None  # the clock when the last gradient bucket went to the comm hook

    @property
    def slows_cpu(self) -> bool:
        """This rank pauses after each step in proportion to its CPU time (a CPU rank with ``slowdown`` > 1)."""
        return self.factor > 1.0 and self.root_device.type != "cuda"

    @contextmanager
    def step(self) -> Iterator[None]:
        """Measure the enclosed step, then pause what it owes (nothing at ``factor`` 1)."""
        slowed = self.factor > 1.0
        start = self._clock() if slowed else 0.0  # the clock synchronizes on CUDA: only when it is needed
        self._collective_cpu, self._bucket_cpu = 0.0, None
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        if slowed:
            elapsed = max(self._clock() - start - self._collective_cpu, 0.0)
            self.times.compute_seconds += elapsed
            # Every step pauses what it owes. A late wake-up (a busy host) is host noise, as on any rank; credited
            # against later steps it would leave those unslowed, and the fastest of a few profiled steps would
            # then time the emulated card at full speed.
            begin = time.perf_counter()
            _pause((self.factor - 1.0) * elapsed)
            self.times.slept_seconds += time.perf_counter() - begin

    def collective_began(self) -> Optional[float]:
        """Before a collective issued inside a step: the CPU clock when a CPU slowdown must leave it out, else
        ``None``. Pass it to :meth:`collective_ended`. A slower card does not slow its collectives (on GPUs NCCL runs
        outside the green context too), yet gloo burns CPU in each one (70-170 us per small all-reduce on a 2-core VM,
        the more the further apart the ranks arrive): slowed, that would turn every shift in arrival times into
        pause."""
        return time.thread_time() if self.slows_cpu and self._in_step else None

    def collective_ended(self, began: Optional[float]) -> None:
        if began is not None:
            self._collective_cpu += time.thread_time() - began

    def bucket_ready(self) -> None:
        """A gradient bucket went to the comm hook (a bucket observer of the strategy's weighting hook): the
        backward's compute is done when the last one does; what follows until :meth:`backward_returned` is DDP
        waiting for the gradient all-reduce."""
        if self.slows_cpu and self._in_step:
            self._bucket_cpu = time.thread_time()

    def backward_returned(self) -> None:
        if self._bucket_cpu is not None:
            self._collective_cpu += time.thread_time() - self._bucket_cpu
            self._bucket_cpu = None

    @contextmanager
    def slowed_in_place(self) -> Iterator[None]:
        """Inside a step: pause for the enclosed piece of work as it ends rather than at the step's end, where a
        pipeline stage's neighbour waits for each micro-batch of a slower card. Its CPU time, pause included, then
        leaves the step's own count."""
        if not (self.slows_cpu and self._in_step):
            yield
            return
        begin = time.thread_time()
        yield
        elapsed = time.thread_time() - begin
        self.times.compute_seconds += elapsed
        paused = time.perf_counter()
        _pause((self.factor - 1.0) * elapsed)
        self.times.slept_seconds += time.perf_counter() - paused
        # Paid here: the step's end pauses for the rest of its CPU time only (as for a collective's).
        self._collective_cpu += time.thread_time() - begin

    def _clock(self) -> float:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)
            return time.perf_counter()
        # CPU time of the training thread: a blocking wait for a slower rank's all-reduce is not compute, so slowed
        # ranks do not inflate each other.
        return time.thread_time()
