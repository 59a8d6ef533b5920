"""The step-time model on hand-written timelines: FSDP2's prefetch, DDP's buckets, ranks meeting at collectives."""

import pytest

from lightning_hetero.plan.step_cost import buckets_of, ring_seconds
from lightning_hetero.rehearse.predict import step_seconds
from lightning_hetero.rehearse.timeline import RankPhases, no_overlap, replicated_step, sharded_step, slowest


def test_compute_bound_blocks_expose_the_first_gather_the_turn_and_the_last_scatter():
    # Collectives of 0.5 under blocks of 1 (forward) and 2 (backward): all hidden but the first all-gather, the
    # backward's first all-gather (the last block was resharded after its forward) and the last reduce-scatter.
    assert sharded_step([1, 1, 1], [2, 2, 2], [0.5] * 3, [0.5] * 3) == pytest.approx(9 + 3 * 0.5)
    assert no_overlap([1, 1, 1], [2, 2, 2], [0.5] * 3, [0.5] * 3) == pytest.approx(9 + 6 * 0.5 + 3 * 0.5)


def test_communication_bound_blocks_wait_for_their_gathers():
    # Gathers of 3 over forwards of 1: each forward waits for its block's gather; in the backward the stream carries
    # a gather and a reduce-scatter per block (worked by hand, see the module's docstring for the order).
    forward, backward, gather, scatter = [1, 1, 1], [2, 2, 2], [3, 3, 3], [1, 1, 1]
    assert sharded_step(forward, backward, gather, scatter) == pytest.approx(23)
    assert no_overlap(forward, backward, gather, scatter) == pytest.approx(30)
    assert sharded_step(forward, backward, gather, scatter, optimizer=0.5) == pytest.approx(23.5)


def test_no_communication_is_the_compute_alone():
    assert sharded_step([1, 2], [3, 4], [0, 0], [0, 0]) == pytest.approx(10)


def test_the_slowest_rank_sets_each_block():
    assert slowest([[1, 5, 1], [2, 1, 2]]) == [2, 5, 2]


def test_ddp_hides_all_but_the_last_bucket_when_the_backward_is_long():
    one = [RankPhases(1.0, 2.0)]
    assert replicated_step(one, [0.1] * 4) == pytest.approx(3.1)
    # All-reduce longer than the backward: the stream is busy from the first bucket on.
    assert replicated_step(one, [1.0] * 4) == pytest.approx(1 + 0.5 + 4)
    assert replicated_step(one, [0.4]) == pytest.approx(3.4)
    with pytest.raises(ValueError, match="reduces"):
        replicated_step(one, [])
    with pytest.raises(ValueError, match="ready has 2 buckets"):
        replicated_step([RankPhases(1.0, 2.0, ready=(0.5, 1.0))], [0.1] * 3)


def test_ddp_reduces_a_bucket_once_every_rank_produced_it_and_steps_the_optimizer_after():
    # Two ranks starting together: rank 0 (a large share on a fast card) is the slower in its backward, rank 1 (one
    # sample on a slow card) in its optimizer step. Totals 2.2 and 2.0; the step is 1 + 1.6 + 0.1 (last bucket)
    # + 0.9 = 3.6, not the slower total plus a bucket.
    fast_big, slow_small = RankPhases(0.6, 1.6, 0.0), RankPhases(0.3, 0.8, 0.9)
    assert replicated_step([fast_big, slow_small], [0.1] * 4) == pytest.approx(0.6 + 1.6 + 0.1 + 0.9)
    # The optimizer hides no all-reduce: a backward of 0.8 under 2.0 of all-reduce exposes it all but 0.3 + 0.2.
    alone = RankPhases(0.3, 0.8, 0.9)
    assert replicated_step([alone], [0.5] * 4) == pytest.approx(0.3 + 0.2 + 2.0 + 0.9)
    # A bucket measured ready only at the backward's end (a tied embedding's gradient) is exposed whole.
    late = RankPhases(1.0, 2.0, 0.0, ready=(0.3, 0.6, 0.9, 1.0))
    assert replicated_step([late], [0.1, 0.1, 0.1, 0.5]) == pytest.approx(3.5)


def test_a_rank_slowest_in_one_phase_and_another_in_the_next_compose_by_phase():
    # The 7 + 1 split of issue 37 in shape: rank 0 has the longer forward and backward, rank 1 (one sample on a
    # slow card) the longer optimizer step, and the collectives outlast rank 1's blocks. Composed from the totals
    # alone (the earlier model) the step was the slower total, 0.22, plus a little; by phase it is at least
    # 0.15 + 0.13, and more where the collectives are exposed.
    ranks = [RankPhases(0.05, 0.10, 0.02), RankPhases(0.03, 0.06, 0.13)]
    totals = [p.total for p in ranks]
    by_total, _, _ = step_seconds("hetero_fsdp", totals, 20, 4_000_000_000, 2_000_000_000, "pcie")
    by_phase, bound, comm = step_seconds("hetero_fsdp", ranks, 20, 4_000_000_000, 2_000_000_000, "pcie")
    assert by_total < 0.24
    assert by_phase >= 0.05 + 0.10 + 0.13 + 0.5 * comm / 40 and by_phase <= bound
    ddp_total, _, _ = step_seconds("hetero_ddp", totals, 1, 1_000_000_000, 500_000_000, "pcie")
    ddp_phase, _, reduce = step_seconds("hetero_ddp", ranks, 1, 1_000_000_000, 500_000_000, "pcie")
    assert ddp_total < 0.24
    # 1 GB of gradients over PCIe (0.04 s) under rank 0's backward: the last bucket then rank 1's optimizer.
    assert ddp_phase == pytest.approx(0.15 + reduce / 39 + 0.13, rel=0.02)


def test_ring_collectives():
    assert ring_seconds("all_gather", 1e9, 1, 25.0, 1e-5) == 0.0
    assert ring_seconds("all_gather", 1e9, 4, 25.0, 0.0) == pytest.approx(0.75 * 1e9 / 25e9)
    assert ring_seconds("all_reduce", 1e9, 2, 25.0, 1e-5) == pytest.approx(2 * 0.5 * 1e9 / 25e9 + 2 * 1e-5)
    with pytest.raises(ValueError, match="broadcast"):
        ring_seconds("broadcast", 1, 2, 1.0, 0.0)
    assert buckets_of(100 * 2**20) == 4 and buckets_of(1) == 1


def test_mismatched_timelines_are_refused():
    with pytest.raises(ValueError, match="one time per block"):
        sharded_step([1, 1], [2], [0.1, 0.1], [0.1, 0.1])


def test_a_large_sharded_step_is_predicted_with_overlap_between_compute_and_the_bound():
    # The 1.1B GPT on 2 ranks over PCIe (20 blocks, 2.2 GB of bf16 parameters), the ranks' rehearsed compute.
    step, bound, comm = step_seconds("hetero_fsdp", [0.1766, 0.2073], 20, 4444962816, 2222481408, "pcie")
    assert 0.2073 < step < 0.2073 + comm / 4 and bound == pytest.approx(0.2073 + comm)
    ddp, ddp_bound, reduce = step_seconds("ddp", [0.1, 0.1], 1, 500_000_000, 250_000_000, "nvlink")
    assert 0.1 < ddp < ddp_bound == pytest.approx(0.1 + reduce)
