"""The step-time model on hand-written timelines: FSDP2's prefetch, DDP's buckets, ranks meeting at collectives."""

import pytest

from lightning_hetero.rehearse.predict import step_seconds
from lightning_hetero.rehearse.timeline import (
    buckets_of,
    no_overlap,
    replicated_step,
    ring_seconds,
    sharded_step,
    slowest,
)


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
    assert replicated_step(1.0, 2.0, all_reduce=0.4, buckets=4) == pytest.approx(3.1)
    # All-reduce longer than the backward: the stream is busy from the first bucket on.
    assert replicated_step(1.0, 2.0, all_reduce=4.0, buckets=4) == pytest.approx(1 + 0.5 + 4)
    assert replicated_step(1.0, 2.0, all_reduce=0.4, buckets=1) == pytest.approx(3.4)
    with pytest.raises(ValueError, match="buckets"):
        replicated_step(1.0, 2.0, 0.4, 0)


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
