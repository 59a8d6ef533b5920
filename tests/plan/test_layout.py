"""The hybrid layout's planning: who holds which stage, the stage split, the micro-batch count."""

import pytest

from lightning_hetero.plan.layout import HybridLayout, balanced_starts, micro_batch_count


def test_stage_groups_hold_every_copy_of_a_stage():
    layout = HybridLayout.from_pipelines([[2, 3], [4, 5]], world_size=6)
    assert layout.data_parallel == (0, 1)
    assert [layout.stage_members(s) for s in range(2)] == [(0, 1, 2, 4), (0, 1, 3, 5)]
    assert layout.stage_of(5) == 1 and layout.stage_of(0) is None
    assert layout.holder(1) == 0
    assert layout.replica_sizes([3, 3, 1, 1, 2, 0]) == [3, 3, 2, 2]


@pytest.mark.parametrize("pipelines", [[[2]], [[2, 3], [4]], [[1, 1]], [[2, 9]], []])
def test_bad_pipelines_are_refused(pipelines):
    with pytest.raises(ValueError, match="pipeline"):
        HybridLayout.from_pipelines(pipelines, world_size=6)


def test_blocks_follow_the_stage_weights():
    assert balanced_starts(8, [1, 1]) == [4]
    assert balanced_starts(8, [3, 1]) == [6]
    assert balanced_starts(3, [1, 1, 10]) == [1, 2]  # every stage keeps a block
    with pytest.raises(ValueError, match="2 blocks cannot make 3 stages"):
        balanced_starts(2, [1, 1, 1])


def test_micro_batches_divide_the_share():
    assert [micro_batch_count(b, 2) for b in (12, 10, 7, 0, 3)] == [4, 2, 1, 1, 3]
    assert micro_batch_count(12, 2, requested=6) == 6
