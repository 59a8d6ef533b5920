"""Where a pipeline stage's step goes: its micro-batches' compute, its point-to-point transfers, and its bubble.

A stage rank of a pipelined replica runs its part of the step inside a ``torch.distributed.pipelining`` schedule.
:class:`StageTimer` marks, on the rank's own clock (``perf_counter`` on CPU, CUDA events on GPUs, both from the
monitor), the schedule's whole step, each micro-batch's forward, backward and loss (**compute**), and each wait of
the schedule on its send/recv operations. On GPUs the marks sit on the compute stream: a wait's two marks measure
how long the stream stalled on NCCL, without a host synchronize.

A receive's wait is the transfer itself plus the time the neighbour stage had not sent yet. The two are told apart
the way the monitor tells exposed communication from waiting in a collective: the fastest receive of the pipeline
in the step found its message already on the way, so its wait is one message's **send/recv** time; every rank's
receives count that much each (:func:`split_transfers`), and the rest of its time in the schedule's waits is
**bubble**: idle, waiting for a neighbour. The default split points begin repeated blocks, so every stage boundary
carries the same activation shape and one transfer time holds for the pipeline.

Example::

    timer = StageTimer(mark=time.perf_counter, push=events.append)
    timer.begin()
    works = timer.posted(lambda: post_receive(buffer))
    for work in works:
        timer.waited(True, work.wait)
    output = timer.compute(lambda: stage_forward(buffer))
    timer.end()
"""

from collections.abc import Sequence
from typing import Any, Callable, Optional

# The monitor's event kind for one schedule step of a stage: (kind, begin, end, pieces).
STAGE_EVENT = 6
# Pieces of a stage step: (kind, begin mark, end mark).
_COMPUTE, _RECEIVE, _SEND, _POST = 0, 1, 2, 3
# Per-step fields a stage rank adds to the monitor's row (seconds, a count): the schedule's step, its micro-batch
# compute, its time posting send/recv operations and waiting for them, how many of those waits held a receive, and
# the shortest such wait.
STAGE_FIELDS = ("stage_span", "stage_compute", "p2p_post", "p2p_wait", "receives", "fastest_receive")
NO_STAGE = (0.0,) * len(STAGE_FIELDS)


class StageTimer:
    """Marks one stage rank's schedule steps into the monitor's event log (``push``), one event per step."""

    def __init__(self, mark: Callable[[], Any], push: Callable[[tuple], None]) -> None:
        self.mark = mark
        self.push = push
        self._begin: Any = None
        self._pieces: list[tuple[int, Any, Any]] = []

    def begin(self) -> None:
        self._pieces = []
        self._begin = self.mark()

    def compute(self, work: Callable[[], Any]) -> Any:
        """``work()``, one micro-batch's forward, backward or loss, timed as compute."""
        begin = self.mark()
        out = work()
        self._pieces.append((_COMPUTE, begin, self.mark()))
        return out

    def posted(self, post: Callable[[], Any]) -> Any:
        """``post()``, the schedule posting a batch of send/recv operations, timed as send/recv."""
        begin = self.mark()
        out = post()
        self._pieces.append((_POST, begin, self.mark()))
        return out

    def waited(self, receives: bool, wait: Callable[[], Any]) -> Any:
        """``wait()`` on one of the schedule's send/recv works (``receives``: it holds a receive)."""
        begin = self.mark()
        out = wait()
        self._pieces.append((_RECEIVE if receives else _SEND, begin, self.mark()))
        return out

    def end(self) -> None:
        self.push((STAGE_EVENT, self._begin, self.mark(), self._pieces))
        self._pieces = []


def stage_fields(begin: Any, end: Any, pieces: Sequence[tuple[int, Any, Any]],
                 seconds: Callable[[Any, Any], float]) -> tuple[float, ...]:
    """One schedule step's ``STAGE_FIELDS`` from its marks."""
    compute = post = wait = 0.0
    receives, fastest = 0, float("inf")
    for kind, a, b in pieces:
        span = seconds(a, b)
        if kind == _COMPUTE:
            compute += span
        elif kind == _POST:
            post += span
        else:
            wait += span
            if kind == _RECEIVE:
                receives += 1
                fastest = min(fastest, span)
    return (seconds(begin, end), compute, post, wait, float(receives), fastest if receives else 0.0)


def split_transfers(rows: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """``(send/recv, bubble)`` seconds of each stage rank of one pipeline in one step, from its ranks'
    ``STAGE_FIELDS`` (stage order): posting, and each receive's wait up to the pipeline's fastest receive, are
    send/recv; the rest of the waits is bubble."""
    fastest = [row[5] for row in rows if row[4] > 0]
    transfer = min(fastest) if fastest else 0.0
    out = []
    for _, _, post, wait, receives, _ in rows:
        moving = min(wait, receives * transfer)
        out.append((post + moving, wait - moving))
    return out


def stage_names(pipelines: Optional[Sequence[Sequence[int]]]) -> dict[int, str]:
    """``{rank: "pipeline p, stage s"}`` for every stage rank."""
    return {r: f"pipeline {p}, stage {s}" for p, ranks in enumerate(pipelines or ()) for s, r in enumerate(ranks)}


def merge_stage(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    """Two schedule steps of one optimizer step (gradient accumulation) as one: sums, and the faster receive."""
    fastest = min(a[5], b[5]) if a[4] and b[4] else a[5] if a[4] else b[5]
    return (*(x + y for x, y in zip(a[:5], b[:5])), fastest)
