"""How a global batch is cut into per-rank shares: pure arithmetic, no torch.distributed.

Rank r gets b_r of every global batch of G samples, proportional to its capacity c_r (its samples per second),
with every rank getting at least one sample and Σ b_r = G. Whole samples are rounded so the slowest rank's b_r / c_r,
the step time, is as short as it can be. Optional per-rank caps (what fits in memory) are honoured by water-filling:
a capped rank keeps its cap and the rest is re-split among the others.

When samples differ in cost (sequence length), :func:`split_by_cost` cuts a global batch so each rank's summed cost,
not its sample count, is proportional to its capacity.

Ranks that train one replica together (a pipeline's stage ranks, which train on the union of their slices) are split
as one by :func:`split_replicas` and :func:`split_replicas_by_cost`: the least share is per replica, not per rank.
"""

import math
from collections.abc import Sequence
from typing import Any, Optional


def validate_weights(weights: Sequence[float], name: str) -> list[float]:
    """Positive finite numbers, or a ``ValueError`` that names ``name``."""
    values = list(weights)
    if not values:
        raise ValueError(f"`{name}` is empty: give one positive weight per rank.")
    for i, w in enumerate(values):
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"`{name}[{i}]` = {w!r} is not a number.")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"`{name}[{i}]` = {w!r}: every weight must be a positive finite number.")
    if not math.isfinite(sum(values)):  # e.g. [1e308, 1e308]: the shares would be inf / inf = NaN
        raise ValueError(f"`{name}` = {values!r} sum to more than a float holds: weights are relative, scale them "
                         "down (e.g. [1, 1]).")
    return [float(w) for w in values]


def _shortest_step(total: int, weights: Sequence[float], minimum: int) -> list[int]:
    """Integers summing to ``total``, each at least ``minimum``, that make the slowest rank's time b_r / w_r as short
    as possible (w_r: samples per second), i.e. the step of a synchronous job.

    Every optimum gives each rank at least the floor of its quota G·w_r/Σw (unless the minimum lifts others), so the
    floors are kept and each remaining sample goes to the rank that would finish it first (the classic greedy, exact
    for this min-max). Ties go to the larger remainder, then the lower rank, so every rank computes the same split.
    Largest-remainder rounding is not the same: at speeds 2.5:1 it cuts 16 samples 11/5, a step of
    max(11 / 2.5, 5 / 1) = 5, where 12/4 takes 4.8.
    """
    n = len(weights)
    weight_sum = sum(weights)
    quotas = [total * w / weight_sum for w in weights]
    shares = [max(minimum, math.floor(q)) for q in quotas]
    for _ in range(total - sum(shares)):
        r = min(range(n), key=lambda r: ((shares[r] + 1) / weights[r], shares[r] - quotas[r], r))
        shares[r] += 1
    for _ in range(sum(shares) - total):  # the minimum lifted some ranks: take back where the last sample ends latest
        lifted = (r for r in range(n) if shares[r] > minimum)
        r = max(lifted, key=lambda r: (shares[r] / weights[r], shares[r] - quotas[r], r))
        shares[r] -= 1
    return shares


def split_batch(total: int, capacities: Sequence[float], caps: Optional[Sequence[int]] = None,
                minimum: int = 1) -> list[int]:
    """Cut ``total`` samples into per-rank shares proportional to ``capacities``, rounded for the shortest step.

    With ``total >= minimum * len(capacities)`` every rank gets at least ``minimum`` samples. With fewer (only the
    final partial global batch of an epoch can be that small) the samples go ``minimum`` each to the
    highest-capacity ranks (the last of them taking any remainder) and the others get 0: they run a zero-weight
    padding step so every rank runs the same number of steps. ``minimum=2`` is for BatchNorm layers that train on
    each rank's own statistics, which cannot train on one sample.

    ``caps`` bounds each rank's share (e.g. by memory); what a capped rank cannot take goes to the others.
    """
    weights = validate_weights(capacities, "capacities")
    n = len(weights)
    if total < 0:
        raise ValueError(f"cannot split a negative number of samples ({total}).")
    if total < minimum * n:
        order = sorted(range(n), key=lambda r: (-weights[r], r))
        chosen = sorted(order[: max(1, total // minimum)]) if total else []
        shares = [0] * n
        parts = _shortest_step(total, [weights[r] for r in chosen], minimum=min(minimum, total)) if chosen else []
        for r, s in zip(chosen, parts):
            shares[r] = s
        return shares
    if caps is None:
        return _shortest_step(total, weights, minimum=minimum)

    limits = [int(c) for c in caps]
    if len(limits) != n:
        raise ValueError(f"`caps` has {len(limits)} entries for {n} ranks.")
    if any(c < minimum for c in limits):
        raise ValueError(f"`caps` = {limits}: every rank must fit at least {minimum} sample(s).")
    if sum(limits) < total:
        raise ValueError(
            f"a global batch of {total} samples does not fit: the ranks hold at most {sum(limits)} "
            f"({limits}), {total - sum(limits)} too few. Lower the batch size or add memory/ranks."
        )
    shares = [0] * n
    free = list(range(n))
    remaining = total
    while free:
        free_weights = [weights[r] for r in free]
        trial = (
            _shortest_step(remaining, free_weights, minimum=minimum)
            if remaining >= minimum * len(free)
            else split_batch(remaining, free_weights, minimum=minimum)
        )
        over = [r for r, s in zip(free, trial) if s > limits[r]]
        if not over:
            for r, s in zip(free, trial):
                shares[r] = s
            return shares
        for r in over:
            shares[r] = limits[r]
            remaining -= limits[r]
        free = [r for r in free if r not in over]
    return shares


def validate_costs(costs: Sequence[float], name: str = "sample cost") -> list[float]:
    """Non-negative finite numbers, or a ``ValueError`` that names ``name``."""
    values = []
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"{name} of sample {i} is {c!r}: it must be a non-negative finite number.")
        values.append(float(c))
    return values


def split_by_cost(
    costs: Sequence[float], capacities: Sequence[float], caps: Optional[Sequence[int]] = None, padded: bool = False,
    minimum: int = 1,
) -> list[list[int]]:
    """Cut one global batch so each rank's cost (e.g. tokens) over its capacity is as even as possible.

    ``costs[i]`` is the cost of the batch's i-th sample. Returns, per rank, the positions (ascending) it trains on.
    The samples are ordered by cost and cut into contiguous runs, slowest rank first, so a rank's samples have
    similar lengths; the cuts minimise the largest cost_r / c_r (a binary search on that step time, each rank taking
    the longest run that fits it). A run's cost is the sum of its samples' costs, or with ``padded`` its length times
    its largest cost: what a collate that pads to the longest sample computes. Every rank gets at least ``minimum``
    samples when there are at least ``minimum`` x as many samples as ranks, and at most ``caps[r]``; fewer samples are
    placed like :func:`split_batch` places them (``minimum`` as there).
    """
    weights = validate_weights(capacities, "capacities")
    values = validate_costs(costs)
    n, g = len(weights), len(values)
    if g < minimum * n or sum(values) <= 0:  # nothing to weigh: the count split, in batch order
        counts = split_batch(g, weights, caps if g >= minimum * n else None, minimum)
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        return [list(range(bounds[r], bounds[r + 1])) for r in range(n)]
    limits = [g] * n if caps is None else [int(c) for c in caps]
    if len(limits) != n:
        raise ValueError(f"`caps` has {len(limits)} entries for {n} ranks.")
    if any(c < minimum for c in limits) or sum(limits) < g:
        split_batch(g, weights, limits, minimum)  # raises the count split's error, naming the shortfall
    order = sorted(range(g), key=lambda i: (values[i], i))  # ties by position: identical on every rank
    ranked = [values[i] for i in order]
    prefix = [0.0]
    for v in ranked:
        prefix.append(prefix[-1] + v)
    # Slow ranks take the cheap end, where one sample more or less moves their small share least.
    ranks = sorted(range(n), key=lambda r: (weights[r], r))

    def run_cost(a: int, b: int) -> float:
        return (b - a) * ranked[b - 1] if padded else prefix[b] - prefix[a]

    def cut(step: float) -> Optional[list[int]]:
        """Run ends when every rank takes the longest run within ``step`` (None: the samples do not all fit)."""
        ends, start = [], 0
        for k, r in enumerate(ranks):
            rest = ranks[k + 1 :]
            lo = max(start + minimum, g - sum(limits[q] for q in rest))
            hi = min(g - minimum * len(rest), start + limits[r])
            if lo > hi or run_cost(start, lo) > step * weights[r]:
                return None
            end, top = lo, hi  # the longest run within `step`: run costs grow with the run
            while end < top:
                mid = (end + top + 1) // 2
                if run_cost(start, mid) <= step * weights[r]:
                    end = mid
                else:
                    top = mid - 1
            ends.append(end)
            start = end
        return ends if start == g else None

    low, high = 0.0, max(run_cost(0, g) / min(weights), 1e-300)
    best = cut(high)
    for _ in range(60):  # to float precision on the step time; every rank runs the same arithmetic
        mid = (low + high) / 2
        ends = cut(mid)
        if ends is None:
            low = mid
        else:
            high, best = mid, ends
    assert best is not None
    runs: list[list[int]] = [[] for _ in range(n)]
    start = 0
    for r, end in zip(ranks, best):
        runs[r] = sorted(order[start:end])
        start = end
    return runs


def check_replicas(replicas: Sequence[Sequence[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """``replicas`` as tuples, checked to cover ranks 0..world_size-1 each once, each replica in ascending order and
    the replicas ordered by their first rank (so a replica's slices keep the rank order of a plain split)."""
    groups = tuple(tuple(int(r) for r in g) for g in replicas)
    flat = sorted(r for g in groups for r in g)
    if (flat != list(range(world_size)) or any(not g or list(g) != sorted(g) for g in groups)
            or [g[0] for g in groups] != sorted(g[0] for g in groups)):
        raise ValueError(f"`replicas`={[list(g) for g in groups]}: each of ranks 0..{world_size - 1} once, every "
                         "replica's ranks ascending, replicas in the order of their first rank.")
    return groups


def _over_members(counts: Sequence[int], replicas: Sequence[Sequence[int]], weights: Sequence[float],
                  caps: Optional[Sequence[int]], world_size: int) -> list[int]:
    """Per-rank counts from per-replica ``counts``: each cut over its ranks by :func:`split_batch` (one sample
    each while there are enough, else the highest-capacity ranks first and the others 0)."""
    shares = [0] * world_size
    for count, group in zip(counts, replicas):
        member_caps = None if caps is None or count < len(group) else [caps[r] for r in group]
        for r, s in zip(group, split_batch(count, [weights[r] for r in group], member_caps)):
            shares[r] = s
    return shares


def _summed(values: Optional[Sequence[Any]], replicas: Sequence[Sequence[int]]) -> Optional[list[Any]]:
    return None if values is None else [sum(values[r] for r in g) for g in replicas]


def split_replicas(total: int, capacities: Sequence[float], replicas: Sequence[Sequence[int]],
                   caps: Optional[Sequence[int]] = None, minimum: int = 1) -> list[int]:
    """Per-rank shares when ranks form replicas that train on the union of their slices (a pipeline's stage ranks):
    :func:`split_batch` over the replicas (a replica's capacity and cap are its ranks' sums; ``minimum`` per
    replica, not per rank), then each replica's count over its ranks, where a rank may get 0 (a padding step; the
    replica's union is what trains).

    Example::

        >>> split_batch(12, [6, 0.5, 0.5]), split_replicas(12, [6, 0.5, 0.5], [[0], [1, 2]])
        ([10, 1, 1], [11, 1, 0])
    """
    weights = validate_weights(capacities, "capacities")
    groups = check_replicas(replicas, len(weights))
    counts = split_batch(total, _summed(weights, groups), _summed(caps, groups), minimum)  # type: ignore[arg-type]
    return _over_members(counts, groups, weights, caps, len(weights))


def split_replicas_by_cost(costs: Sequence[float], capacities: Sequence[float], replicas: Sequence[Sequence[int]],
                           caps: Optional[Sequence[int]] = None, padded: bool = False,
                           minimum: int = 1) -> list[list[int]]:
    """:func:`split_by_cost` over replicas (as :func:`split_replicas`), each replica's positions then cut into
    consecutive runs over its ranks by count."""
    weights = validate_weights(capacities, "capacities")
    groups = check_replicas(replicas, len(weights))
    runs = split_by_cost(costs, _summed(weights, groups), _summed(caps, groups), padded,  # type: ignore[arg-type]
                         minimum)
    counts = _over_members([len(r) for r in runs], groups, weights, caps, len(weights))
    out: list[list[int]] = [[] for _ in weights]
    for run, group in zip(runs, groups):
        start = 0
        for r in group:
            out[r] = run[start:start + counts[r]]
            start += counts[r]
    return out
