"""What one training step costs in each layout of a lab, subsets of its cards included: the cost model the doctor
compares layouts with and a running job checks itself against.

Every rank has a cost per sample (its forward and backward), a fixed cost per step (what its forward and backward
cost whatever the batch) and its optimizer step; the lab has one link (the slowest class of the cards in use). A
layout's step is then:

- **compute**: the global batch split so every replica ends its forward and backward together (a rank whose fixed
  cost alone outlasts the others keeps one sample), the slowest replica's time. A pipeline of S stages is one replica:
  its stages cut in proportion to speed, it runs at the sum of its cards' rates less the bubble of m = 2S
  micro-batches (m / (m + S - 1));
- **traffic**: data parallel all-reduces the gradients, 2(W-1)/W × their bytes per rank in equal 25 MiB buckets,
  overlapped with the backward but for what the backward cannot hide; sharded all-gathers every block before its
  forward and its backward and reduce-scatters its gradient, (W-1)/W of the compute-dtype weights each, overlapped
  with compute but for one gather and one scatter; the hybrid layout all-reduces each stage's gradients over the
  stage's holders after the backward. Each ring hop costs the link's latency;
- **fixed**: the slowest rank's optimizer step over the state it holds (the whole model, 1/W of it, or its stage's
  part).

Layouts are compared on the whole lab and on its fastest classes alone (the slowest class dropped, again and again):
a slow card adds its samples but also its share of every collective and a link class that may be slower, and can
cost more than it adds.

Example::

    >>> fast, slow = RankCost("A100", 1 / 1900), RankCost("3090", 1 / 400, link="ethernet")
    >>> ranked = compare([fast, fast, slow, slow], Workload(param_bytes=440_000_000, global_batch=160))
    >>> [(s.key, round(s.samples_per_s)) for s in ranked[:3]]  # the slow pair's ring costs more than it adds
    [('fsdp:0,1', 3792), ('ddp:0,1', 3790), ('fsdp:0,1,2,3', 770)]
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

# Bandwidth per link class (GB/s): measured between two H200s of one host with the emulator's NCCL settings (NVLink;
# P2P off, as PCIe cards without peer access stage through host memory; P2P and SHM off: TCP sockets).
LINK_GBYTES = {"nvlink": 275.0, "pcie": 25.0, "ethernet": 2.6}
# Per ring hop (s): not measured here; NCCL's usual small-message latencies per link class (they matter only for
# many small blocks: 20 blocks x 2 ranks on PCIe come to 1.2 ms a step).
LINK_LATENCY_S = {"nvlink": 10e-6, "pcie": 20e-6, "ethernet": 60e-6}
# The order in which a ring slows: the job's link is its slowest card's class.
LINK_ORDER = ("nvlink", "pcie", "ethernet")
# DDP's gradient bucket cap.
BUCKET_BYTES = 25 * 2**20
# Where only a step's compute is known: a third forward (the backward computes two gradients per forward product).
FORWARD_FRACTION = 1 / 3


def ring_seconds(kind: str, nbytes: float, world: int, gbytes_per_s: float, latency_s: float) -> float:
    """One ring collective of ``nbytes`` (the whole tensor: gathered, scattered or reduced) over ``world`` ranks:
    every rank sends (N-1)/N of it once (all-gather, reduce-scatter) or twice (all-reduce), in N-1 (or 2(N-1)) hops
    of ``latency_s`` each.

    Example::

        >>> round(ring_seconds("all_gather", 1e9, 2, 25.0, 1e-5) * 1e3, 3)  # half a GB at 25 GB/s, one hop
        20.01
    """
    if world <= 1:
        return 0.0
    passes = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    if kind not in passes:
        raise ValueError(f"collective {kind!r} is not one of {sorted(passes)}")
    hops = passes[kind] * (world - 1)
    return passes[kind] * (world - 1) / world * nbytes / (gbytes_per_s * 1e9) + hops * latency_s


def buckets_of(gradient_bytes: float, bucket_bytes: float = BUCKET_BYTES) -> int:
    """DDP's bucket count at its default 25 MiB cap."""
    return max(1, math.ceil(gradient_bytes / bucket_bytes))


@dataclass(frozen=True)
class RankCost:
    """One card's costs: ``sample_s`` seconds of forward + backward per sample, ``fixed_s`` of them per step whatever
    the batch, ``optimizer_s`` for the whole model's optimizer step; its ``memory_bytes`` (``None``: not checked),
    ``link`` class and whether the costs were ``measured`` (else assumed)."""

    label: str
    sample_s: float
    fixed_s: float = 0.0
    optimizer_s: float = 0.0
    memory_bytes: Optional[int] = None
    link: str = "nvlink"
    measured: bool = False

    def __post_init__(self) -> None:
        if not self.sample_s > 0 or self.fixed_s < 0 or self.optimizer_s < 0:
            raise ValueError(f"{self.label}: `sample_s`={self.sample_s!r} must be > 0, `fixed_s`={self.fixed_s!r} and "
                             f"`optimizer_s`={self.optimizer_s!r} >= 0.")
        if self.link not in LINK_GBYTES:
            raise ValueError(f"{self.label}: `link`={self.link!r} is not one of {list(LINK_ORDER)}.")

    @property
    def rate(self) -> float:
        """Samples/s of forward + backward at one sample's cost (the card's speed, for ranking)."""
        return 1.0 / self.sample_s


@dataclass(frozen=True)
class Workload:
    """The job: ``param_bytes`` of gradients reduced per step (fp32: 4 per parameter), ``global_batch`` samples,
    ``optimizer_slots`` parameter-sized state tensors, ``compute_bytes`` a sharded layout gathers per pass (the
    weights in the compute dtype; default half ``param_bytes``, bf16), ``blocks`` it gathers them in, and the link
    (``link_gbytes`` GB/s and ``link_latency_s`` a hop) where measured, else the link class's table."""

    param_bytes: int
    global_batch: int
    optimizer_slots: int = 2
    compute_bytes: Optional[int] = None
    blocks: int = 12
    link_gbytes: Optional[float] = None
    link_latency_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.param_bytes <= 0 or self.global_batch < 1 or self.optimizer_slots < 0 or self.blocks < 1:
            raise ValueError(f"Workload needs `param_bytes` > 0 (got {self.param_bytes}), `global_batch` >= 1 (got "
                             f"{self.global_batch}), `optimizer_slots` >= 0 and `blocks` >= 1.")

    @property
    def gathered_bytes(self) -> int:
        return self.compute_bytes if self.compute_bytes is not None else self.param_bytes // 2


@dataclass(frozen=True)
class LayoutPlan:
    """One way to run the job: ``layout`` ("ddp", "fsdp" or "hybrid") on the lab's ``ranks`` (a subset keeps the
    fastest classes), ``pipelines`` of the hybrid layout in the lab's rank numbers."""

    layout: str
    ranks: tuple[int, ...]
    pipelines: tuple[tuple[int, ...], ...] = ()

    @property
    def key(self) -> str:
        """``ddp:0,1``, ``fsdp:0,1,2,3``, ``hybrid:0,1,2,3:2+3`` (a pipeline's ranks joined by ``+``)."""
        base = f"{self.layout}:{','.join(map(str, self.ranks))}"
        return base + (":" + "/".join("+".join(map(str, p)) for p in self.pipelines) if self.pipelines else "")

    def local_pipelines(self) -> list[list[int]]:
        """The pipelines in the subset's own rank numbers (what ``pipelines=`` takes once the others are left out)."""
        return [[self.ranks.index(r) for r in p] for p in self.pipelines]


@dataclass(frozen=True)
class StepPrediction:
    """A layout's predicted step (seconds) in its parts, samples per second, per-rank batches (a stage rank: its
    pipeline's) and traffic."""

    plan: LayoutPlan
    samples: float
    batches: tuple[float, ...]
    compute_s: float
    comm_s: float
    exposed_s: float
    fixed_s: float
    traffic_bytes: float
    link: str

    @property
    def key(self) -> str:
        return self.plan.key

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s + self.fixed_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s


def job_link(costs: Sequence[RankCost]) -> str:
    """The slowest link class among ``costs``: a ring runs at its slowest hop."""
    return max((c.link for c in costs), key=LINK_ORDER.index)


def balanced_batches(fixed: Sequence[float], per_sample: Sequence[float], total: int) -> list[float]:
    """``total`` samples split so every replica's ``fixed + per_sample × b`` is equal; a replica whose fixed cost
    alone outlasts that keeps one sample and the rest is split again among the others.

    Example::

        >>> balanced_batches([0, 0], [1, 3], 8), balanced_batches([0, 10], [1, 1], 4)
        ([6.0, 2.0], [3.0, 1.0])
    """
    batches = [0.0] * len(fixed)
    free = list(range(len(fixed)))
    left = float(total)
    while free:
        step = (left + sum(fixed[i] / per_sample[i] for i in free)) / sum(1 / per_sample[i] for i in free)
        starved = [i for i in free if (step - fixed[i]) / per_sample[i] < 1]
        if not starved:
            for i in free:
                batches[i] = (step - fixed[i]) / per_sample[i]
            break
        for i in starved:
            batches[i] = 1.0
            left -= 1.0
        free = [i for i in free if i not in starved]
    return batches


def pipeline_cost(stages: Sequence[RankCost]) -> tuple[float, float, list[float]]:
    """(fixed s, s per sample, each stage's part of the model) of a pipeline whose stages are cut in proportion to
    speed, with m = 2S micro-batches: every stage then takes 1 / Σ rates a sample, stretched by the bubble."""
    count = len(stages)
    rates = [c.rate for c in stages]
    micro = 2 * count
    per_sample = (micro + count - 1) / micro / sum(rates)
    return max(c.fixed_s for c in stages), per_sample, [r / sum(rates) for r in rates]


def predict_step(plan: LayoutPlan, costs: Sequence[RankCost], job: Workload) -> StepPrediction:
    """The predicted step of ``plan`` on the lab ``costs`` (all ranks; the plan picks its own): see the module's
    docstring for what it counts."""
    used = [costs[r] for r in plan.ranks]
    world = len(used)
    link = job_link(used)
    gbytes = job.link_gbytes or LINK_GBYTES[link]
    latency = job.link_latency_s if job.link_latency_s is not None else LINK_LATENCY_S[link]
    staged = {r for p in plan.pipelines for r in p}
    alone = [r for r in plan.ranks if r not in staged]
    fixed = [costs[r].fixed_s for r in alone]
    per_sample = [costs[r].sample_s for r in alone]
    parts: dict[int, float] = {}
    for pipeline in plan.pipelines:
        a, c, shares = pipeline_cost([costs[r] for r in pipeline])
        fixed.append(a)
        per_sample.append(c)
        parts.update(zip(pipeline, shares))
    replica_batches = balanced_batches(fixed, per_sample, job.global_batch)
    compute = max(a + c * b for a, c, b in zip(fixed, per_sample, replica_batches))
    batches = replica_batches[:len(alone)] + [b for b, p in zip(replica_batches[len(alone):], plan.pipelines)
                                              for _ in p]
    if plan.layout == "ddp":
        buckets = buckets_of(job.param_bytes)
        comm = buckets * ring_seconds("all_reduce", job.param_bytes / buckets, world, gbytes, latency)
        forward, backward = compute * FORWARD_FRACTION, compute * (1 - FORWARD_FRACTION)
        # Bucket k is all-reduced once ready (k+1)/K into the backward and after bucket k-1: the step's compute and
        # communication end at F + max(B/K + comm, B + comm/K).
        exposed = forward + max(backward / buckets + comm, backward + comm / buckets) - compute
        traffic = 2 * (world - 1) / world * job.param_bytes
        optimizer = max(c.optimizer_s for c in used)
    elif plan.layout == "fsdp":
        gather = job.blocks * ring_seconds("all_gather", job.gathered_bytes / job.blocks, world, gbytes, latency)
        scatter = job.blocks * ring_seconds("reduce_scatter", job.gathered_bytes / job.blocks, world, gbytes, latency)
        comm = 2 * gather + scatter
        # Prefetched under the blocks' compute, but the first gather and the last scatter.
        exposed = max(0.0, comm - compute) + (gather + scatter) / job.blocks
        traffic = 3 * (world - 1) / world * job.gathered_bytes
        optimizer = max(c.optimizer_s for c in used) / world
    elif plan.layout == "hybrid":
        holders = len(alone) + len(plan.pipelines)
        stages = len(plan.pipelines[0])
        # One all-reduce per stage over its holders, after the backward; a data-parallel rank joins each of them.
        comm = ring_seconds("all_reduce", job.param_bytes, holders, gbytes, latency) + (stages - 1) * (
            2 * (holders - 1) * latency)
        exposed = comm
        traffic = 2 * (holders - 1) / holders * job.param_bytes
        optimizer = max(costs[r].optimizer_s * parts.get(r, 1.0) for r in plan.ranks)
    else:
        raise ValueError(f"`layout`={plan.layout!r} is not one of 'ddp', 'fsdp', 'hybrid'.")
    return StepPrediction(plan, sum(replica_batches), tuple(batches), compute, comm, max(exposed, 0.0), optimizer,
                          traffic, link)


def tiers(costs: Sequence[RankCost]) -> list[list[int]]:
    """The lab's ranks by card class (one label), fastest class first (by its slowest rank). One class is never
    split on measured speeds: identical cards that measured apart differ by noise or by a passing co-tenant.

    Example::

        >>> tiers([RankCost("a", 1.0), RankCost("b", 4.0), RankCost("a", 1.2), RankCost("c", 40.0)])
        [[0, 2], [1], [3]]
    """
    groups: dict[str, list[int]] = {}
    for r, cost in enumerate(costs):
        groups.setdefault(cost.label, []).append(r)
    return sorted(groups.values(), key=lambda g: max(costs[r].sample_s for r in g))


def subsets(costs: Sequence[RankCost]) -> list[tuple[int, ...]]:
    """The whole lab, then its fastest classes alone: the slowest class dropped, again and again."""
    groups = tiers(costs)
    return [tuple(sorted(r for g in groups[:keep] for r in g)) for keep in range(len(groups), 0, -1)]


def pipeline_choices(costs: Sequence[RankCost], ranks: Sequence[int],
                     max_stages: int = 4) -> list[tuple[tuple[int, ...], ...]]:
    """The hybrid layouts of ``ranks``: each class but the subset's fastest (and never its first rank, which writes
    checkpoints as a data-parallel rank) cut into pipelines of S consecutive ranks, for every S that divides it."""
    groups = tiers([costs[r] for r in ranks])
    out = []
    for group in groups[1:]:
        members = [ranks[i] for i in group if ranks[i] != ranks[0]]
        for stages in range(2, min(max_stages, len(members)) + 1):
            if len(members) % stages == 0:
                out.append(tuple(tuple(members[i:i + stages]) for i in range(0, len(members), stages)))
    return out


def candidate_plans(costs: Sequence[RankCost]) -> list[LayoutPlan]:
    """Every layout compared: on each subset, data parallel, sharded (two or more ranks) and each hybrid choice."""
    plans = []
    for ranks in subsets(costs):
        plans.append(LayoutPlan("ddp", ranks))
        if len(ranks) > 1:
            plans.append(LayoutPlan("fsdp", ranks))
        plans += [LayoutPlan("hybrid", ranks, p) for p in pipeline_choices(costs, ranks)]
    return plans


def compare(costs: Sequence[RankCost], job: Workload,
            plans: Optional[Sequence[LayoutPlan]] = None) -> list[StepPrediction]:
    """Every plan's prediction (default :func:`candidate_plans`), fastest first."""
    if len(costs) < 1:
        raise ValueError("compare needs at least one card.")
    return sorted((predict_step(p, costs, job) for p in (plans or candidate_plans(costs))),
                  key=lambda s: -s.samples_per_s)


def with_link(costs: Sequence[RankCost], link: Optional[str]) -> list[RankCost]:
    """``costs`` on one link class (``None``: as they are)."""
    return list(costs) if link is None else [replace(c, link=link) for c in costs]
