"""A step's time from its compute and its collectives, with the overlap the strategies achieve: pure functions of
per-block times (seconds), so they are tested on hand-written timelines.

- Sharded (FSDP2, ours and Lightning's): one communication stream, issued in the order FSDP2 issues it. Forward:
  block i+1's all-gather is issued when block i starts (prefetch), block i starts once its own all-gather is done.
  Backward (reverse order): block j-1's all-gather is issued when block j starts, block j's reduce-scatter when it
  ends. Exposed: the first all-gather, the backward's first all-gather where the forward's last block outran it, the
  last reduce-scatter, and any block whose collectives outlast its compute.
- Replicas (DDP): gradient buckets, each all-reduced once every rank has produced it (at its own point of its own
  backward), one after the other on the communication stream: only what the backwards cannot hide (at least the last
  bucket) is exposed.

Ranks meet at every collective, so each block's compute is the slowest rank's (:func:`slowest`). The optimizer step
follows the last collective and hides none of them; each rank's is its own, and the step ends with the slowest rank's
(a per-step collective after it, e.g. the stop check, holds every rank to that end). So a step is composed from each
rank's :class:`RankPhases`, not its total: a rank with a small share on a slow card can be the slowest in its
optimizer step while another is the slowest in its forward and backward.

Example::

    >>> sharded_step([1, 1], [2, 2], gather=[0.5, 0.5], scatter=[0.5, 0.5])  # 0.5 exposed at each end and the turn
    7.5
    >>> no_overlap([1, 1], [2, 2], [0.5, 0.5], [0.5, 0.5])  # and the bound that overlaps nothing: +2 x 0.5 gathers
    9.0
"""

from collections.abc import Sequence
from dataclasses import dataclass

# Where only a rank's total step time is known, its forward's share (the layouts' cost model's); no optimizer apart.
from lightning_hetero.plan.step_cost import FORWARD_FRACTION


@dataclass(frozen=True)
class RankPhases:
    """One rank's step in its phases (seconds): forward (the step's start to its loss), backward (to the last
    gradient), optimizer (the rest: the optimizer step and what follows it); ``ready``: for replicas, the fraction of
    the backward at which each gradient bucket was ready (empty: equal buckets at equal intervals)."""

    forward: float
    backward: float
    optimizer: float = 0.0
    ready: tuple[float, ...] = ()

    @classmethod
    def split(cls, total: float) -> "RankPhases":
        """A total step time with no phases measured, split as :data:`FORWARD_FRACTION` says."""
        return cls(total * FORWARD_FRACTION, total * (1 - FORWARD_FRACTION))

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per block, the slowest rank's time: the collective after a block waits for every rank to reach it."""
    return [max(times) for times in zip(*per_rank)]


def sharded_step(forward: Sequence[float], backward: Sequence[float], gather: Sequence[float],
                 scatter: Sequence[float], optimizer: float = 0.0) -> float:
    """The step's end under FSDP2's prefetching (see the module's docstring): per block (in module order) its forward
    and backward compute, its all-gather and its reduce-scatter; then the optimizer step."""
    n = len(forward)
    if not (len(backward) == len(gather) == len(scatter) == n) or n == 0:
        raise ValueError("forward, backward, gather and scatter need one time per block each")
    stream = [0.0]  # when the communication stream is next free

    def issue(at: float, seconds: float) -> float:
        stream[0] = max(at, stream[0]) + seconds
        return stream[0]

    gathered = [0.0] * n
    gathered[0] = issue(0.0, gather[0])
    now = 0.0
    for i in range(n):
        start = max(now, gathered[i])
        if i + 1 < n:
            gathered[i + 1] = issue(start, gather[i + 1])
        now = start + forward[i]
    regathered = [0.0] * n
    regathered[n - 1] = issue(now, gather[n - 1])
    scattered = 0.0
    for j in reversed(range(n)):
        start = max(now, regathered[j])
        if j > 0:
            regathered[j - 1] = issue(start, gather[j - 1])
        now = start + backward[j]
        scattered = issue(now, scatter[j])
    return max(now, scattered) + optimizer


def replicated_step(ranks: Sequence[RankPhases], reduces: Sequence[float]) -> float:
    """The step's end under DDP, the ranks starting together: bucket ``k`` (``reduces[k]`` seconds to all-reduce) is
    all-reduced once the slowest rank has produced it (at ``ready[k]`` of its backward, or ``(k+1)/K`` when not
    measured) and the bucket before is done; each rank then steps its optimizer.

    Example::

        >>> replicated_step([RankPhases(1.0, 2.0)], [0.1] * 4)  # hidden but the last bucket's 0.1
        3.1
        >>> replicated_step([RankPhases(1.0, 2.0, 0.1), RankPhases(0.5, 1.0, 1.0)], [0.1] * 4)  # the slow optimizer
        4.1
    """
    if not reduces:
        raise ValueError("reduces needs one time per bucket, got none")
    count = len(reduces)
    for phases in ranks:
        if phases.ready and len(phases.ready) != count:
            raise ValueError(f"ready has {len(phases.ready)} buckets, reduces {count}")
    end = 0.0
    for k, seconds in enumerate(reduces):
        produced = max(p.forward + p.backward * (p.ready[k] if p.ready else (k + 1) / count) for p in ranks)
        end = max(end, produced) + seconds
    return max(max(end, p.forward + p.backward) + p.optimizer for p in ranks)


def no_overlap(forward: Sequence[float], backward: Sequence[float], gather: Sequence[float],
               scatter: Sequence[float], optimizer: float = 0.0) -> float:
    """The bound where no collective overlaps compute: every time added (a sharded step gathers each block twice)."""
    return sum(forward) + sum(backward) + 2 * sum(gather) + sum(scatter) + optimizer
