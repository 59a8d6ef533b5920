"""The hybrid layout: which ranks form each pipelined replica, the rest data-parallel; the pieces a pipeline plans.

A *replica* holds the whole model once: a data-parallel rank alone, or a pipeline of S stage ranks (stage order =
list order, which must be ascending rank order). Every pipeline has the same number of stages, so parameters fall
into S stage sets, and the set of stage s is held by every data-parallel rank and by stage s of every pipeline: one
process group per stage (:meth:`HybridLayout.stage_members`) reduces its gradient exactly.

Pure planning, no torch: which ranks form pipelines from the cards' memory and speed (:func:`choose_pipelines`),
the stage split of a block list balanced by the stage cards' weights (:func:`balanced_starts`) and a pipeline's
micro-batch count (:func:`micro_batch_count`).

Example::

    >>> layout = HybridLayout.from_pipelines([[2, 3]], world_size=4)
    >>> layout.data_parallel, layout.stage_members(1)
    ((0, 1), (0, 1, 3))
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class HybridLayout:
    """Data-parallel ranks and pipelines (each a tuple of global ranks in stage order) of one job."""

    world_size: int
    pipelines: tuple[tuple[int, ...], ...]

    @classmethod
    def from_pipelines(cls, pipelines: Sequence[Sequence[int]], world_size: int) -> "HybridLayout":
        """Checked: ranks in range, none twice, at least one pipeline, every pipeline of the same 2+ stages, each in
        ascending rank order."""
        groups = tuple(tuple(int(r) for r in p) for p in pipelines)
        flat = [r for p in groups for r in p]
        if not groups:
            raise ValueError("`pipelines` names no pipeline: use the data-parallel strategy for data parallelism "
                             "alone.")
        if any(len(p) < 2 for p in groups):
            raise ValueError(f"`pipelines`={[list(p) for p in groups]}: every pipeline has at least 2 stage ranks.")
        if len({len(p) for p in groups}) > 1:
            raise ValueError(f"`pipelines`={[list(p) for p in groups]}: every pipeline has the same number of stages "
                             "(a stage's parameters are reduced over one group per stage).")
        if len(set(flat)) != len(flat) or any(not 0 <= r < world_size for r in flat):
            raise ValueError(f"`pipelines`={[list(p) for p in groups]}: each rank in 0..{world_size - 1} at most once.")
        if any(list(p) != sorted(p) for p in groups):
            # A pipeline's process group numbers its ranks in ascending order, and torch's pipelining sends stage
            # i's activations to group rank i: stage order must be rank order.
            raise ValueError(f"`pipelines`={[list(p) for p in groups]}: list each pipeline's ranks in ascending "
                             "order (stage order is rank order).")
        return cls(world_size, groups)

    @property
    def stages(self) -> int:
        return len(self.pipelines[0])

    @property
    def data_parallel(self) -> tuple[int, ...]:
        """The ranks that hold the whole model."""
        staged = {r for p in self.pipelines for r in p}
        return tuple(r for r in range(self.world_size) if r not in staged)

    def pipeline_of(self, rank: int) -> Optional[tuple[int, ...]]:
        return next((p for p in self.pipelines if rank in p), None)

    def stage_of(self, rank: int) -> Optional[int]:
        pipeline = self.pipeline_of(rank)
        return None if pipeline is None else pipeline.index(rank)

    def stage_members(self, stage: int) -> tuple[int, ...]:
        """Every rank holding stage ``stage``'s parameters: the data-parallel ranks and that stage of each pipeline."""
        return tuple(sorted(self.data_parallel + tuple(p[stage] for p in self.pipelines)))

    def holder(self, stage: int) -> int:
        """One rank whose copy of stage ``stage``'s parameters is trained (the first data-parallel rank, else the
        stage rank of the first pipeline): the source when every rank needs the whole model."""
        return self.data_parallel[0] if self.data_parallel else self.pipelines[0][stage]

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Every replica's ranks, ordered by their first rank: a data-parallel rank alone, a pipeline's stage ranks
        together (the share plan splits a global batch over these:
        :attr:`~lightning_hetero.plan.shares.SharePlan.replicas`).

        Example::

            >>> HybridLayout.from_pipelines([[1, 3]], world_size=4).replicas
            ((0,), (1, 3), (2,))
        """
        alone = [(r,) for r in self.data_parallel]
        return tuple(sorted(alone + list(self.pipelines), key=lambda group: group[0]))

    def replica_sizes(self, rank_sizes: Sequence[float]) -> list[float]:
        """Samples per replica (data-parallel ranks in order, then pipelines) from the sampler's per-rank split: a
        pipeline trains on the union of its ranks' slices."""
        return ([rank_sizes[r] for r in self.data_parallel]
                + [sum(rank_sizes[r] for r in p) for p in self.pipelines])

    def rank_capacities(self, replica_capacities: Sequence[float]) -> list[float]:
        """Per-rank capacities that give each replica (data-parallel ranks in order, then pipelines) its capacity: a
        pipeline's spread evenly over its ranks, whose sum the sampler gives the pipeline.

        Example::

            >>> HybridLayout.from_pipelines([[2, 3]], world_size=4).rank_capacities([4.0, 3.0, 2.0])
            [4.0, 3.0, 1.0, 1.0]
        """
        if len(replica_capacities) != len(self.data_parallel) + len(self.pipelines):
            raise ValueError(f"{len(replica_capacities)} replica capacities for {len(self.data_parallel)} "
                             f"data-parallel ranks and {len(self.pipelines)} pipelines.")
        out = [0.0] * self.world_size
        for rank, rate in zip(self.data_parallel, replica_capacities):
            out[rank] = float(rate)
        for pipeline, rate in zip(self.pipelines, replica_capacities[len(self.data_parallel):]):
            for rank in pipeline:
                out[rank] = float(rate) / len(pipeline)
        return out


@dataclass(frozen=True)
class PipelineChoice:
    """The pipelines :func:`choose_pipelines` formed, and why, one line per replica."""

    pipelines: tuple[tuple[int, ...], ...]
    reasons: tuple[str, ...]


def gib(n: float) -> str:
    """``n`` bytes as GiB text ("1.5 GiB")."""
    return f"{n / 2**30:.3g} GiB"


def stage_bytes(replica_bytes: int, weight_bytes: int, part: float) -> int:
    """What a stage rank holding ``part`` of the model must fit: the whole model's weights (``weight_bytes``, which
    evaluation gathers) beside its stage's gradients and optimizer state (``part`` of the rest of ``replica_bytes``).

    Example::

        >>> stage_bytes(400, 100, 0.5)
        250
    """
    return int(weight_bytes + (replica_bytes - weight_bytes) * part)


def choose_pipelines(budgets: Sequence[int], speeds: Sequence[float], replica_bytes: int, similar: float = 1.5,
                     max_stages: int = 4, weight_bytes: int = 0) -> PipelineChoice:
    """Which ranks form pipelines: a card whose ``budgets`` (bytes it may fill) hold ``replica_bytes`` (the model,
    its gradients and optimizer state) stays data-parallel; the others are cut, in rank order, into pipelines of
    consecutive ranks (one host's cards, usually) whose ``speeds`` differ by at most ``similar``×, with the fewest
    stages (2 up to ``max_stages``, the same for every pipeline) at which each card holds its stage (the blocks are
    cut in proportion to speed, :func:`balanced_starts`, so a stage's share of the bytes is its card's share of
    the pipeline's speed) and, while it evaluates, the whole model's ``weight_bytes`` too (:func:`stage_bytes`).
    A ``ValueError`` says why no layout works.

    Example::

        >>> choice = choose_pipelines([80, 80, 24, 24], [3, 3, 1, 1], replica_bytes=40)
        >>> choice.pipelines
        ((2, 3),)
    """
    ranks = range(len(budgets))
    if len(speeds) != len(budgets):
        raise ValueError(f"{len(speeds)} speeds for {len(budgets)} memory budgets.")
    small = [r for r in ranks if budgets[r] < replica_bytes]
    if not small:
        raise ValueError(f"`pipelines`='auto': every card holds a replica ({gib(replica_bytes)}): use the "
                         "data-parallel strategy.")
    if 0 in small:
        raise ValueError(f"`pipelines`='auto': rank 0 cannot hold a replica ({gib(replica_bytes)} > "
                         f"{gib(budgets[0])}) but writes checkpoints as a data-parallel rank: give rank 0 a card "
                         "that holds one, or use the sharded strategy.")
    runs: list[list[int]] = []
    for r in small:  # maximal runs of consecutive ranks
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    why_not = []
    for stages in range(2, max_stages + 1):
        chunks = [run[i:i + stages] for run in runs for i in range(0, len(run), stages)]
        problem = next((c for c in chunks if len(c) < stages), None)
        if problem is not None:
            why_not.append(f"{stages} stages leave ranks {problem} without a pipeline")
            continue
        slow = next((c for c in chunks if max(speeds[r] for r in c) > similar * min(speeds[r] for r in c)), None)
        if slow is not None:
            why_not.append(f"{stages} stages pair ranks {slow} of speeds {[speeds[r] for r in slow]} (more than "
                           f"{similar}x apart)")
            continue
        full = next((c for c in chunks if any(
            budgets[r] < stage_bytes(replica_bytes, weight_bytes, speeds[r] / sum(speeds[q] for q in c))
            for r in c)), None)
        if full is not None:
            why_not.append(f"{stages} stages of {gib(replica_bytes)} do not fit ranks {full}")
            continue
        reasons = [f"rank {r}: data-parallel (a replica's {gib(replica_bytes)} fits its {gib(budgets[r])})"
                   for r in ranks if r not in small]
        reasons += [f"ranks {c}: a {stages}-stage pipeline (a replica's {gib(replica_bytes)} fits none of their "
                    f"{[gib(budgets[r]) for r in c]}; a stage each, in proportion to speed)" for c in chunks]
        return PipelineChoice(tuple(tuple(c) for c in chunks), tuple(reasons))
    raise ValueError(f"`pipelines`='auto': ranks {small} cannot hold a replica ({gib(replica_bytes)}) and form no "
                     f"pipeline: {'; '.join(why_not)}. Name `pipelines` yourself or use the sharded strategy.")


def balanced_starts(blocks: int, weights: Sequence[float]) -> list[int]:
    """The first block index of each stage after the first: ``blocks`` consecutive blocks cut into
    ``len(weights)`` non-empty runs whose lengths follow the weights (a faster or larger card takes more blocks).

    Example::

        >>> balanced_starts(8, [1, 1]), balanced_starts(8, [3, 1])
        ([4], [6])
    """
    stages = len(weights)
    if blocks < stages:
        raise ValueError(f"{blocks} blocks cannot make {stages} stages: give `split_points` or fewer stages.")
    if any(w <= 0 for w in weights):
        raise ValueError(f"stage weights {list(weights)} must be positive.")
    total, starts, done = float(sum(weights)), [], 0.0
    for s in range(1, stages):
        done += weights[s - 1]
        start = round(blocks * done / total)
        low = (starts[-1] if starts else 0) + 1  # every stage keeps at least one block
        starts.append(min(max(start, low), blocks - (stages - s)))
    return starts


def micro_batch_count(share: int, stages: int, requested: Optional[int] = None, least: int = 1) -> int:
    """Micro-batches for a pipelined replica's share: the largest count up to ``requested`` (default 2 × stages, so
    the bubble is at most a third of a GPipe step) that divides the share, so every micro-batch has the same size
    (a stage's receive buffers have one shape), each of at least ``least`` samples where the share allows (2 while
    BatchNorm layers train on per-micro-batch statistics). 1 for an empty share.

    Example::

        >>> micro_batch_count(12, 2), micro_batch_count(10, 2), micro_batch_count(7, 2)
        (4, 2, 1)
        >>> micro_batch_count(2, 2, least=2), micro_batch_count(8, 2, least=3)
        (1, 2)
    """
    if requested is not None and requested < 1:
        raise ValueError(f"`micro_batches`={requested} must be a positive integer or None.")
    most = min(requested or 2 * stages, max(share // max(least, 1), 1))
    return next(m for m in range(most, 0, -1) if share % m == 0) if share > 0 else 1
