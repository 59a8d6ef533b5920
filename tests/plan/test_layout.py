"""The hybrid layout's planning: who holds which stage, the stage split, the micro-batch count."""

import pytest

from lightning_hetero.plan.layout import HybridLayout, balanced_starts, choose_pipelines, micro_batch_count


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


def test_stage_order_is_rank_order():
    with pytest.raises(ValueError, match=r"`pipelines`=\[\[3, 2\]\]: list each pipeline's ranks in ascending"):
        HybridLayout.from_pipelines([[3, 2]], world_size=4)


def test_blocks_follow_the_stage_weights():
    assert balanced_starts(8, [1, 1]) == [4]
    assert balanced_starts(8, [3, 1]) == [6]
    assert balanced_starts(3, [1, 1, 10]) == [1, 2]  # every stage keeps a block
    with pytest.raises(ValueError, match="2 blocks cannot make 3 stages"):
        balanced_starts(2, [1, 1, 1])


def test_micro_batches_divide_the_share():
    assert [micro_batch_count(b, 2) for b in (12, 10, 7, 0, 3)] == [4, 2, 1, 1, 3]
    assert micro_batch_count(12, 2, requested=6) == 6


GIB = 2**30


def test_cards_that_hold_a_replica_stay_data_parallel_the_others_pair():
    # Two 80 GiB cards, four 24 GiB cards; a replica of 40 GiB: the small ones pair in rank order.
    choice = choose_pipelines([80 * GIB] * 2 + [24 * GIB] * 4, [3, 3, 1, 1, 1, 1], 40 * GIB)
    assert choice.pipelines == ((2, 3), (4, 5))
    assert choice.reasons[0].startswith("rank 0: data-parallel") and "2-stage pipeline" in choice.reasons[-1]


def test_more_stages_when_two_cards_are_too_small():
    assert choose_pipelines([80 * GIB, 16 * GIB, 16 * GIB, 16 * GIB], [3, 1, 1, 1], 40 * GIB).pipelines == ((1, 2, 3),)


def test_a_faster_card_takes_a_larger_stage():
    # 30 + 10 GiB of a 40 GiB replica: rank 1 (3x faster) holds 3/4 of it.
    assert choose_pipelines([80 * GIB, 31 * GIB, 11 * GIB], [4, 3, 1], 40 * GIB, similar=4).pipelines == ((1, 2),)
    with pytest.raises(ValueError, match=r"do not fit ranks \[1, 2\]"):
        choose_pipelines([80 * GIB, 29 * GIB, 11 * GIB], [4, 3, 1], 40 * GIB, similar=4, max_stages=2)


def test_a_stage_card_also_holds_the_whole_weights():
    # 10 of a 40 GiB replica are weights: a stage of two equal cards needs 10 + 30 / 2 = 25 GiB, not 20.
    budgets, speeds = [80 * GIB, 22 * GIB, 22 * GIB], [3, 1, 1]
    assert choose_pipelines(budgets, speeds, 40 * GIB).pipelines == ((1, 2),)
    with pytest.raises(ValueError, match=r"do not fit ranks \[1, 2\]"):
        choose_pipelines(budgets, speeds, 40 * GIB, max_stages=2, weight_bytes=10 * GIB)


@pytest.mark.parametrize(("budgets", "speeds", "match"), [
    ([80, 80], [1, 1], "every card holds a replica"),
    ([24, 80, 24], [1, 3, 1], "rank 0 cannot hold a replica"),
    ([80, 24, 80, 24], [3, 1, 3, 1], r"leave ranks \[1\] without a pipeline"),
    ([80, 24, 24], [3, 1, 2], r"speeds \[1, 2\] \(more than 1.5x apart\)"),
])
def test_no_layout_says_why(budgets, speeds, match):
    with pytest.raises(ValueError, match=match):
        choose_pipelines([b * GIB for b in budgets], speeds, 40 * GIB)
