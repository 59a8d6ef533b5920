"""Time dilation on a GPU: each step of an emulated card is followed by a GPU idle of ``(d - 1) x`` its compute time.

A green context's SM slice is often faster than the card it stands for; dilation slows it further without ever
synchronizing the host: CUDA events bracket each step on the rank's stream, and at the step's end a spin kernel
(``torch.cuda._sleep``) of ``(d - 1) x`` the step's compute time is queued on that stream. The compute time is the
*minimum* of the last completed steps' event times: a step's events also time the waits for a slower peer's
all-reduce, which only inflate it. An event is read only once ``query()`` says it completed, so reading never blocks.

Example::
    >>> window = StepWindow(size=20)
    >>> for seconds in (0.012, 0.010, 0.031):  # the last step waited for a slower peer
    ...     window.add(seconds)
    >>> window.estimate(), spin_seconds(1.5, window.estimate()), spin_cycles(0.005, 1.9e9)
    (0.01, 0.005, 9500000)
"""

from collections import deque
from typing import Any, Optional

import torch

from lightning_hetero._compat import cuda_spin

WINDOW_STEPS = 20  # completed steps whose fastest one times the rank's compute


class StepWindow:
    """The last ``size`` completed steps' times; their minimum estimates one step's compute."""

    def __init__(self, size: int = WINDOW_STEPS) -> None:
        if size < 1:
            raise ValueError(f"`size`={size!r} must be at least 1.")
        self.size = size
        self._times: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._times.append(float(seconds))

    def estimate(self) -> Optional[float]:
        """The fastest recent step's time (``None`` before one completed)."""
        return min(self._times) if self._times else None


def spin_seconds(dilation: float, compute_seconds: Optional[float]) -> float:
    """How long the GPU idles after a step of ``compute_seconds`` for a ``dilation`` (0 before any estimate)."""
    if compute_seconds is None or dilation <= 1.0:
        return 0.0
    return (dilation - 1.0) * compute_seconds


def spin_cycles(seconds: float, cycles_per_second: float) -> int:
    """Clock cycles of a spin kernel lasting ``seconds``."""
    return max(0, int(round(seconds * cycles_per_second)))


def measure_spin_rate(device: torch.device, cycles: int = 20_000_000) -> float:
    """Spin-kernel clock cycles per second on ``device`` (synchronizes: call once, at activation)."""
    stream = torch.cuda.current_stream(device)
    cuda_spin(cycles // 10)  # warm-up: loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    cuda_spin(cycles)
    end.record(stream)
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


class GpuDilation:
    """Brackets steps with CUDA events and queues the spin after each (see the module docstring).

    ``begin(stream)`` before a step, ``end(stream)`` after it: ``end`` returns the seconds of the steps that completed
    since the last call and the seconds of idle it queued.
    """

    def __init__(self, dilation: float, cycles_per_second: float, window: int = WINDOW_STEPS) -> None:
        self.dilation = dilation
        self.cycles_per_second = cycles_per_second
        self.window = StepWindow(window)
        self._pending: deque[tuple[Any, Any]] = deque()
        self._start: Any = None

    def begin(self, stream: Any) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(stream)

    def end(self, stream: Any) -> tuple[float, float]:
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
        self._pending.append((self._start, done))
        measured = self._collect()
        pause = spin_seconds(self.dilation, self.window.estimate())
        if pause > 0:
            with torch.cuda.stream(stream):
                cuda_spin(spin_cycles(pause, self.cycles_per_second))
        return measured, pause

    def restart(self) -> None:
        """Forget every step so far (the rank's speed changed)."""
        self._pending.clear()
        self.window = StepWindow(self.window.size)

    def _collect(self) -> float:
        # Oldest first; an unfinished event stops the scan (later ones on the same stream finish after it).
        total = 0.0
        while self._pending and self._pending[0][1].query():
            start, done = self._pending.popleft()
            seconds = start.elapsed_time(done) / 1000.0
            self.window.add(seconds)
            total += seconds
        return total
