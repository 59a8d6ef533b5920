"""The capacity-aware sampler: same step count on every rank, every index once, one global order."""

import pytest

from lightning_hetero.data.sampler import EvaluationBatchSampler, GlobalOrder, HeteroBatchSampler


def _samplers(n, g, capacities, drop_last, shuffle=True, seed=0):
    return [
        HeteroBatchSampler(GlobalOrder(n, shuffle=shuffle, seed=seed), g, capacities, rank=r, drop_last=drop_last)
        for r in range(len(capacities))
    ]


@pytest.mark.parametrize("capacities", [[1, 1], [3, 1], [5, 2, 1], [10, 1]])
@pytest.mark.parametrize("drop_last", [False, True])
def test_steps_and_sample_accounting_for_every_length(capacities, drop_last):
    b = 4
    g = b * len(capacities)
    for n in range(1, 3 * g + 2):
        samplers = _samplers(n, g, capacities, drop_last)
        per_rank = [list(s) for s in samplers]
        steps = {len(batches) for batches in per_rank}
        assert steps == {len(samplers[0])}, f"n={n}: ranks disagree on the number of steps"
        # Real (weighted) samples: what sizes_at says each rank contributes.
        used = []
        for s, batches in zip(samplers, per_rank):
            for k, batch in enumerate(batches):
                local, total = s.sizes_at(k)
                assert 1 <= len(batch)
                assert len(batch) == max(local, 1)
                assert total == sum(x.sizes_at(k)[0] for x in samplers)
                used += batch[:local]
        if drop_last:
            assert len(used) == (n // g) * g and len(set(used)) == len(used)
        else:
            assert sorted(used) == list(range(n)), f"n={n}: every index exactly once"


def test_global_batches_match_rank_slices_and_epochs_reshuffle():
    samplers = _samplers(50, 8, [3, 1], drop_last=False)
    for epoch in (0, 1):
        for s in samplers:
            s.sampler.set_epoch(epoch)
        globals_ = samplers[0].global_batches()
        per_rank = [list(s) for s in samplers]
        for k, batch in enumerate(globals_):
            assert per_rank[0][k] + per_rank[1][k] == batch
        if epoch == 0:
            first = globals_
    assert first != globals_
    assert [len(b) for b in per_rank[0]] == [6] * 6 + [1]  # the partial batch of 2 splits 1 + 1


def test_share_change_applies_from_a_batch_index():
    samplers = _samplers(64, 8, [1, 1], drop_last=False, shuffle=False)
    for s in samplers:
        s.schedule.change([3, 1], first_batch=3)
    sizes = [[len(b) for b in s] for s in samplers]
    assert sizes[0] == [4, 4, 4, 6, 6, 6, 6, 6]
    assert sizes[1] == [4, 4, 4, 2, 2, 2, 2, 2]
    assert samplers[0].sizes_at(2) == (4, 8) and samplers[0].sizes_at(3) == (6, 8)
    # A new epoch starts from the latest shares.
    samplers[1].sampler.set_epoch(1)
    assert [len(b) for b in samplers[1]] == [2] * 8


def test_global_batch_smaller_than_world_is_rejected():
    with pytest.raises(ValueError, match="global_batch_size"):
        HeteroBatchSampler(GlobalOrder(10, False), 2, [1, 1, 1], rank=0, drop_last=False)


@pytest.mark.parametrize(("n", "g", "capacities"), [(41, 10, [3, 1]), (3, 4, [3, 1]), (1, 2, [1, 3]),
                                                    (7, 9, [5, 2, 1]), (100, 16, [7, 1])])
def test_evaluation_padding_steps_are_the_empty_batches(n, g, capacities):
    """is_padding (asked at every evaluation step) names exactly the batches rank_batches leaves empty."""
    for rank in range(len(capacities)):
        sampler = EvaluationBatchSampler(GlobalOrder(n, shuffle=False), global_batch_size=g, capacities=capacities,
                                         rank=rank, drop_last=False)
        batches = sampler.rank_batches()
        assert [sampler.is_padding(k) for k in range(len(batches) + 1)] == [b[1] == 0 for b in batches] + [False]
