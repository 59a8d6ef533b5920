"""Which layout fits a lab: data parallel, sharded or hybrid, from the model's size, optimizer and the cards."""

import json

import pytest

from lightning_hetero.__main__ import main
from lightning_hetero.plan.layout_choice import Card, compare_layouts

GIB = 2**30
LAB = [Card("A100", 80 * GIB, 312), Card("A100", 80 * GIB, 312), Card("3090", 24 * GIB, 71), Card("3090", 24 * GIB, 71)]


def _by_layout(comparison):
    return {v.layout: v for v in comparison.verdicts}


def test_a_model_that_fits_every_card_trains_data_parallel():
    comparison = compare_layouts(300_000_000 * 4, 2, LAB)  # 4.5 GiB of AdamW state: fits a 3090
    assert comparison.pick == "data parallel"
    assert _by_layout(comparison)["data parallel"].rate == pytest.approx(2 * 312 + 2 * 71)
    assert "every card holds a replica" in _by_layout(comparison)["hybrid"].note


def test_a_model_too_large_for_the_small_cards_pairs_them_and_shards_faster():
    comparison = compare_layouts(2_000_000_000 * 4, 2, LAB)  # 30 GiB: fits an A100, not a 3090, half fits one
    verdicts = _by_layout(comparison)
    # Both fit; sharding runs every card at its speed, a pipeline at its slowest card's less the bubble (and on one
    # host the sharded layout measured the faster).
    assert comparison.pick == "sharded" and "higher rate (766 against 737.6" in comparison.why
    assert verdicts["data parallel"].fits == (True, True, False, False) and verdicts["data parallel"].rate is None
    # A stage rank: half the gradients and AdamW state, and the whole weights (evaluation gathers them).
    weights = 2_000_000_000 * 4
    assert verdicts["hybrid"].needed_bytes[2] == weights + (verdicts["hybrid"].needed_bytes[0] - weights) // 2
    # The 2-stage pipeline runs at 2 × 71 less the bubble of 4 micro-batches (4/5).
    assert verdicts["hybrid"].rate == pytest.approx(2 * 312 + 2 * 71 * 4 / 5)
    assert all(verdicts["sharded"].fits)


def test_only_sharding_fits_then_nothing_does():
    assert compare_layouts(5_000_000_000 * 4, 2, LAB).pick == "sharded"  # 75 GiB: no A100 holds it, a quarter fits
    comparison = compare_layouts(40_000_000_000 * 4, 2, LAB)
    assert comparison.pick is None and "no layout fits" in comparison.why


def test_the_doctor_compares_layouts_for_a_lab(capsys):
    main(["doctor", "--compare-layouts", "--params", "2e9", "--lab", "A100-80GB,A100-80GB,RTX3090,RTX3090",
          "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["pick"] == "sharded"
    with pytest.raises(SystemExit):
        main(["doctor", "--compare-layouts", "--lab", "A100-80GB,RTX3090"])  # no --params
    assert "--params" in capsys.readouterr().err
    # The hybrid layout is rehearsed (its ranks together, tests/rehearse/test_together.py): only the missing config
    # is refused here.
    with pytest.raises(SystemExit):
        main(["doctor", "--model", "missing.yaml", "--lab", "A100-80GB,RTX3090", "--strategy", "hetero_hybrid"])
    assert "`--model`='missing.yaml' is not a file" in capsys.readouterr().err
