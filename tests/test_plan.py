"""The split arithmetic: proportional, complete, at least one sample per rank, caps honoured."""

import math

import pytest

from lightning_hetero.plan import split_batch


@pytest.mark.parametrize("capacities", [[1, 1], [3, 1], [5, 2, 1], [10, 1], [1, 2, 3, 4, 5, 6, 7]])
@pytest.mark.parametrize("total", [7, 8, 13, 64, 1000])
def test_split_sums_and_is_proportional(capacities, total):
    if total < len(capacities):
        pytest.skip("covered by the padding test")
    shares = split_batch(total, capacities)
    assert sum(shares) == total
    assert min(shares) >= 1
    quotas = [total * c / sum(capacities) for c in capacities]
    # Largest remainder: within one sample of the exact quota, except where the minimum of 1 lifted a rank.
    for share, quota in zip(shares, quotas):
        assert share == 1 or abs(share - quota) < 1 + 1e-9


def test_known_splits():
    assert split_batch(8, [3, 1]) == [6, 2]
    assert split_batch(12, [5, 2, 1]) == [8, 3, 1]
    assert split_batch(22, [10, 1]) == [20, 2]
    assert split_batch(4, [100, 1, 1, 1]) == [1, 1, 1, 1]  # tiny ranks still get a sample


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
