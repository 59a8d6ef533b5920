"""The split arithmetic: proportional, complete, the shortest step, at least one sample per rank, caps honoured."""

import itertools
import math
import random

import pytest

from lightning_hetero.plan.split import split_batch


@pytest.mark.parametrize("capacities", [[1, 1], [3, 1], [5, 2, 1], [10, 1], [1, 2, 3, 4, 5, 6, 7]])
@pytest.mark.parametrize("total", [7, 8, 13, 64, 1000])
def test_split_sums_and_is_proportional(capacities, total):
    if total < len(capacities):
        pytest.skip("covered by the padding test")
    shares = split_batch(total, capacities)
    assert sum(shares) == total
    assert min(shares) >= 1
    quotas = [total * c / sum(capacities) for c in capacities]
    lifted = any(q < 1 for q in quotas)
    for share, quota in zip(shares, quotas):
        # No rank falls a whole sample below its quota unless the minimum of 1 lifted another; the fastest rank may
        # take more than quota + 1 when several slow ones round down (that is what keeps their step short).
        assert share == 1 or lifted or share > quota - 1


def _step(shares, capacities):
    return max(b / c for b, c in zip(shares, capacities))


def _shortest_step_by_search(total, capacities, caps):
    n, best = len(capacities), math.inf
    for head in itertools.product(range(1, total + 1), repeat=n - 1):
        shares = [*head, total - sum(head)]
        if shares[-1] >= 1 and all(b <= c for b, c in zip(shares, caps)):
            best = min(best, _step(shares, capacities))
    return best


def test_split_gives_the_shortest_step_of_all_splits():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.choice([2, 3])
        capacities = [rng.choice([0.3, 1.0, 2.5, 3.0, 10.0]) * rng.uniform(0.8, 1.25) for _ in range(n)]
        total = rng.randint(n, 24)
        caps = [rng.randint(1, total) for _ in range(n)] if rng.random() < 0.3 else [total] * n
        if sum(caps) < total:
            continue
        shares = split_batch(total, capacities, caps)
        assert sum(shares) == total and all(1 <= b <= c for b, c in zip(shares, caps)), (total, capacities, caps)
        best = _shortest_step_by_search(total, capacities, caps)
        assert _step(shares, capacities) == pytest.approx(best, rel=1e-12), (total, capacities, caps, shares)


def test_known_splits():
    assert split_batch(8, [3, 1]) == [6, 2]
    assert split_batch(12, [5, 2, 1]) == [8, 3, 1]
    assert split_batch(22, [10, 1]) == [20, 2]
    assert split_batch(4, [100, 1, 1, 1]) == [1, 1, 1, 1]  # tiny ranks still get a sample
    # Largest-remainder rounding would give 11/5: a step of max(11 / 2.5, 5 / 1) = 5 against 4.8 for 12/4.
    assert split_batch(16, [2.5, 1]) == [12, 4]


def test_fewer_samples_than_ranks_go_to_fastest():
    assert split_batch(1, [1, 3]) == [0, 1]
    assert split_batch(2, [5, 1, 3]) == [1, 0, 1]
    assert split_batch(0, [1, 1]) == [0, 0]


def test_ties_break_identically():
    assert split_batch(3, [1, 1]) == [2, 1]
    assert split_batch(5, [1, 1, 1, 1]) == [2, 1, 1, 1]


def test_caps_water_fill():
    assert split_batch(100, [3, 1], caps=[60, 100]) == [60, 40]
    shares = split_batch(90, [8, 1, 1], caps=[30, 100, 100])
    assert shares[0] == 30 and sum(shares) == 90 and shares[1] == shares[2] == 30


def test_caps_too_small_says_by_how_much():
    with pytest.raises(ValueError, match="does not fit.*5 too few"):
        split_batch(25, [1, 1], caps=[10, 10])


@pytest.mark.parametrize("bad", [[], [1, 0], [1, -2], [1, math.nan], [1, math.inf], [1, "x"], [True, 1]])
def test_bad_capacities_name_the_argument(bad):
    with pytest.raises(ValueError, match="capacities"):
        split_batch(10, bad)
