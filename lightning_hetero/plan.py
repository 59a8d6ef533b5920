"""How a global batch is cut into per-rank shares: pure arithmetic, no torch.distributed.

Rank r gets b_r of every global batch of G samples, proportional to its capacity c_r, by largest-remainder
rounding, with every rank getting at least one sample and Σ b_r = G. Optional per-rank caps (what fits in memory)
are honoured by water-filling: a capped rank keeps its cap and the rest is re-split among the others.

When samples differ in cost (sequence length), :func:`split_by_cost` cuts a global batch so each rank's summed cost,
not its sample count, is proportional to its capacity.
"""

import bisect
import math
from collections.abc import Sequence
from typing import Optional


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
    return [float(w) for w in values]


def _largest_remainder(total: int, weights: Sequence[float], minimum: int) -> list[int]:
    """Integers proportional to ``weights`` summing to ``total``, each at least ``minimum``."""
    n = len(weights)
    weight_sum = sum(weights)
    quotas = [total * w / weight_sum for w in weights]
    shares = [max(minimum, math.floor(q)) for q in quotas]
    surplus = total - sum(shares)
    # Ties go to the lower rank so every rank computes the same split.
    if surplus > 0:
        order = sorted(range(n), key=lambda r: (-(quotas[r] - shares[r]), r))
        for k in range(surplus):
            shares[order[k % n]] += 1
    while surplus < 0:  # the minimum pushed some ranks above their quota: take back from the most over-served
        order = sorted((r for r in range(n) if shares[r] > minimum), key=lambda r: (quotas[r] - shares[r], r))
        shares[order[0]] -= 1
        surplus += 1
    return shares


def split_batch(total: int, capacities: Sequence[float], caps: Optional[Sequence[int]] = None) -> list[int]:
    """Cut ``total`` samples into per-rank shares proportional to ``capacities``.

    With ``total >= len(capacities)`` every rank gets at least one sample. With fewer samples than ranks (only the
    final partial global batch of an epoch can be that small) the samples go one each to the highest-capacity
    ranks and the others get 0: they run a zero-weight padding step so every rank runs the same number of steps.

    ``caps`` bounds each rank's share (e.g. by memory); what a capped rank cannot take goes to the others.
    """
    weights = validate_weights(capacities, "capacities")
    n = len(weights)
    if total < 0:
        raise ValueError(f"cannot split a negative number of samples ({total}).")
    if total < n:
        order = sorted(range(n), key=lambda r: (-weights[r], r))
        chosen = set(order[:total])
        return [1 if r in chosen else 0 for r in range(n)]
    if caps is None:
        return _largest_remainder(total, weights, minimum=1)

    limits = [int(c) for c in caps]
    if len(limits) != n:
        raise ValueError(f"`caps` has {len(limits)} entries for {n} ranks.")
    if any(c < 1 for c in limits):
        raise ValueError(f"`caps` = {limits}: every rank must fit at least one sample.")
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
            _largest_remainder(remaining, free_weights, minimum=1)
            if remaining >= len(free)
            else split_batch(remaining, free_weights)
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
    costs: Sequence[float], capacities: Sequence[float], caps: Optional[Sequence[int]] = None
) -> list[list[int]]:
    """Cut one global batch so each rank's summed cost (e.g. tokens) is proportional to its capacity.

    ``costs[i]`` is the cost of the batch's i-th sample. Returns, per rank, the positions (ascending) it trains on.
    The samples are ordered by cost and cut into contiguous runs at the cumulative capacity fractions (slowest rank
    first), so a rank's samples have similar lengths (little padding when a collate pads to the longest) and each
    cut lands within half a sample of its cumulative target. Every rank gets at least one sample when there are at
    least as many samples as ranks, and at most ``caps[r]``; fewer samples than ranks are placed like
    :func:`split_batch` places them.
    """
    weights = validate_weights(capacities, "capacities")
    values = validate_costs(costs)
    n, g = len(weights), len(values)
    total = sum(values)
    if g < n or total <= 0:  # nothing to weigh: the count split, in batch order
        counts = split_batch(g, weights, caps if g >= n else None)
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        return [list(range(bounds[r], bounds[r + 1])) for r in range(n)]
    limits = [g] * n if caps is None else [int(c) for c in caps]
    if len(limits) != n:
        raise ValueError(f"`caps` has {len(limits)} entries for {n} ranks.")
    if any(c < 1 for c in limits) or sum(limits) < g:
        split_batch(g, weights, limits)  # raises the count split's error, naming the shortfall
    order = sorted(range(g), key=lambda i: (values[i], i))  # ties by position: identical on every rank
    # Slow ranks take the cheap end: their boundaries fall among short samples, where one sample moves the
    # balance least (relative to their small targets).
    ranks = sorted(range(n), key=lambda r: (weights[r], r))
    prefix = [0.0]
    for i in order:
        prefix.append(prefix[-1] + values[i])
    weight_sum = sum(weights)
    runs: list[list[int]] = [[] for _ in range(n)]
    start, cumulative = 0, 0.0
    for k, r in enumerate(ranks):
        if k == n - 1:
            runs[r] = sorted(order[start:])
            break
        cumulative += weights[r]
        target = total * cumulative / weight_sum
        later = ranks[k + 1 :]
        lo = max(start + 1, g - sum(limits[q] for q in later))  # at least one here; the rest must fit later ranks
        hi = min(g - len(later), start + limits[r])  # at least one left for each later rank
        end = min(max(bisect.bisect_left(prefix, target, lo, hi + 1), lo), hi)
        if end > lo and abs(prefix[end - 1] - target) <= abs(prefix[end] - target):
            end -= 1  # the nearer of the two cuts around the target
        runs[r] = sorted(order[start:end])
        start = end
    return runs
