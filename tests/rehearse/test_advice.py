"""The advice a user can paste: capacities from the rehearsal's measured speeds, the memory plan, the cards that
cannot hold a useful share; and `capacities: profile`, predicted from the measured speeds rather than the
rehearsal's fallback split."""

import pytest
import yaml

from lightning_hetero.plan.split import split_batch
from lightning_hetero.rehearse.advice import advice_yaml, advise, useless_cards
from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.notes import notes
from lightning_hetero.rehearse.predict import predict


def _rank(r, card, batch, step, modes=None, asked=None, ok=True, oom=False):
    return RankResult("hetero", r, card, ok=ok, oom=oom, batch=batch, global_batch=24, plan="keep" if modes else None,
                      step_seconds=[1.0, 1.0] + ([step] * 4 if step else []), memory_modes=modes,
                      capacities_asked=asked, capacity_source="equal" if asked else None, split=[8, 8, 8],
                      param_bytes=4000, compute_bytes=4000)


def test_capacities_come_from_the_measured_speeds_and_paste_as_yaml():
    modes = ["keep", "checkpoint", "checkpoint"]
    # 8 samples in 0.1 s (80/s), and two identical cards at 20/s and 16/s (a loaded host slowed the second).
    lab = [_rank(0, "A100-80GB", 8, 0.1, modes), _rank(1, "RTX3090", 8, 0.4, modes), _rank(2, "RTX3090", 8, 0.5, modes)]
    advice = advise(lab, sharded=True)
    assert advice["capacities"] == [4.0, 1.0, 1.0] and advice["rates"] == [80.0, 20.0, 20.0]  # twins: the fastest
    assert advice["split"] == split_batch(24, [4.0, 1.0, 1.0]) == [16, 4, 4] and advice["cannot"] == []
    pasted = yaml.safe_load(advice_yaml(advice))["trainer"]["strategy"]["init_args"]
    assert pasted == {"capacities": [4.0, 1.0, 1.0], "memory": {"rank:0": "keep", "rank:1": "checkpoint",
                                                                 "rank:2": "checkpoint"}}
    assert "memory" not in yaml.safe_load(advice_yaml(advise(lab, sharded=False)))["trainer"]["strategy"]["init_args"]


def test_a_card_that_cannot_hold_a_useful_share_is_named():
    # 24 samples: the two fast cards take 12 each in 0.1 s; one sample takes the slow card 0.2 s.
    assert useless_cards(24, [120.0, 120.0, 5.0]) == [2]
    assert useless_cards(24, [120.0, 120.0, 60.0]) == []
    slow = advise([_rank(0, "A100-80GB", 8, 8 / 120), _rank(1, "A100-80GB", 8, 8 / 120), _rank(2, "T4", 8, 8 / 5)],
                  sharded=False)
    assert len(slow["cannot"]) == 1 and slow["cannot"][0].startswith("rank 2 (T4) is too slow to hold a useful share")
    oom = advise([_rank(0, "A100-80GB", 8, 0.1), _rank(1, "RTX3090", 8, None, ok=False, oom=True)], sharded=False)
    assert oom["capacities"] is None and advice_yaml(oom) is None
    assert oom["cannot"] == ["rank 1 (RTX3090) ran out of memory with batch 8: it cannot hold its share of this job: "
                             "rehearse `--strategy hetero_fsdp` (its shards and memory plan), or leave it out of the "
                             "lab"]


def test_profiled_capacities_are_predicted_from_the_measured_speeds():
    """Each rehearsed rank ran alone on the fallback (equal) split; a real `profile` run splits by the speeds, and so
    does the prediction, each rank timed at its measured rate."""
    lab = [_rank(0, "A100-80GB", 8, 0.1, asked="profile"), _rank(1, "RTX3090", 8, 0.4, asked="profile"),
           _rank(2, "RTX3090", 8, 0.4, asked="profile")]
    prediction = predict(lab, [], [], "", "pcie")
    assert prediction["profiled_split"] == [16, 4, 4]
    ours = prediction["strategies"]["hetero_ddp"]
    assert ours["batches"] == [16, 4, 4] and ours["estimated"] == [0, 1, 2]
    assert ours["compute_seconds"] == pytest.approx([0.2, 0.2, 0.2])
    said = [n for n in notes(lab, "cpu", prediction) if n.startswith("capacities ['profile']")]
    assert said and "ran alone on the 'equal' split [8, 8, 8], at the speeds (samples/s) 80.0, 20.0, 20.0: a real " \
                    "run would split the batch [16, 4, 4] by them, and the prediction uses that split" in said[0]
    # Without profiling, the rehearsed batches and their measured times stand.
    fixed = predict([_rank(0, "A100-80GB", 8, 0.1), _rank(1, "RTX3090", 8, 0.4)], [], [], "", "pcie")
    assert "profiled_split" not in fixed and fixed["strategies"]["hetero_ddp"]["estimated"] == []


def test_the_laptop_config_is_small():
    """configs/rehearse_cpu.yaml (docs/plan-your-lab.md: rehearsed on a CPU in under a minute) builds a model of
    well under a million parameters, with our strategy measuring its capacities."""
    import importlib
    import os

    root = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    with open(os.path.join(root, "configs", "rehearse_cpu.yaml")) as f:
        config = yaml.safe_load(f)
    module, _, name = config["model"]["class_path"].rpartition(".")
    model = getattr(importlib.import_module(module), name)(**config["model"]["init_args"])
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert config["trainer"]["strategy"]["init_args"]["capacities"] == "profile"
