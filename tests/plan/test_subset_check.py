"""Never slower than the best subset of cards: the cost model's pick on numbers, the doctor's printed Trainer and
YAML, and the warning a profiled fit gives when a slow rank costs it more than it adds."""

import json
import os

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.__main__ import main
from lightning_hetero.plan import profile_run
from lightning_hetero.plan.layout_choice import compare_layouts
from lightning_hetero.plan.step_cost import LayoutPlan, RankCost, Workload, predict_step, subsets
from lightning_hetero.plan.subset_check import slow_ranks
from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.layouts import rehearsed_layouts
from tests.helpers import TinyModel, free_port

BERT = Workload(param_bytes=440_000_000, global_batch=160)


def _lab(slow_rate: float, slow_link: str = "pcie", slow_fixed: float = 0.0) -> list[RankCost]:
    fast = RankCost("A100", 1 / 1900, optimizer_s=0.002, link="nvlink")
    slow = RankCost("3090", 1 / slow_rate, slow_fixed, optimizer_s=0.004, link=slow_link)
    return [fast, fast, slow, slow]


def test_subsets_drop_the_slowest_class_again_and_again():
    lab = [RankCost("A100", 1e-3), RankCost("T4", 1e-1), RankCost("3090", 1e-2), RankCost("A100", 1e-3)]
    assert subsets(lab) == [(0, 1, 2, 3), (0, 2, 3), (0, 3)]


def test_a_slow_class_that_costs_more_than_it_adds_is_left_out():
    # 3090s at a tenth of an A100's rate on a PCIe ring: 2 x 190 samples/s gained, the all-reduce crosses PCIe.
    comparison = compare_layouts(BERT, _lab(190, "ethernet"))
    assert comparison.pick is not None and comparison.pick.plan.ranks == (0, 1)
    assert "ranks [2, 3] (2x 3090) cost more than they add" in comparison.why
    keys = {v.key for v in comparison.verdicts}
    assert {"ddp:0,1,2,3", "fsdp:0,1,2,3", "hybrid:0,1,2,3:2+3", "ddp:0,1", "fsdp:0,1"} <= keys


def test_a_slow_class_that_adds_is_kept():
    comparison = compare_layouts(BERT, _lab(900, "nvlink"))
    assert comparison.pick is not None and comparison.pick.plan.ranks == (0, 1, 2, 3)


def test_traffic_changes_the_pick():
    # The same cards: over NVLink the slow pair adds, over Ethernet its ring costs more than it adds.
    assert compare_layouts(BERT, _lab(600, "nvlink")).pick.plan.ranks == (0, 1, 2, 3)
    assert compare_layouts(BERT, _lab(600, "ethernet")).pick.plan.ranks == (0, 1)
    every = predict_step(LayoutPlan("ddp", (0, 1, 2, 3)), _lab(600, "ethernet"), BERT)
    pair = predict_step(LayoutPlan("ddp", (0, 1)), _lab(600, "ethernet"), BERT)
    assert every.compute_s < pair.compute_s and every.exposed_s > 10 * pair.exposed_s
    assert every.traffic_bytes == pytest.approx(2 * 3 / 4 * BERT.param_bytes)
    assert pair.traffic_bytes == pytest.approx(BERT.param_bytes)


def test_fixed_costs_change_the_pick():
    # A slow card's fixed cost per step (launches, a slow host) holds every step whatever its share.
    assert compare_layouts(BERT, _lab(600, "nvlink")).pick.plan.ranks == (0, 1, 2, 3)
    assert compare_layouts(BERT, _lab(600, "nvlink", slow_fixed=0.08)).pick.plan.ranks == (0, 1)
    slow_optimizer = [*_lab(600, "nvlink")[:2], *[RankCost("3090", 1 / 600, optimizer_s=0.05)] * 2]
    assert compare_layouts(BERT, slow_optimizer).pick.plan.layout in ("fsdp", "hybrid") or \
        compare_layouts(BERT, slow_optimizer).pick.plan.ranks == (0, 1)


def test_the_warning_names_the_ranks_only_when_they_cost_the_job():
    found = slow_ranks(_lab(190, "ethernet"), BERT, "ddp", rate=1536.0)
    assert found is not None and found.dropped == (2, 3) and found.measured
    message = found.message()
    assert message.startswith("ranks 2, 3 (3090) cost this job ")
    assert "1536 samples/s measured" in message and "CUDA_VISIBLE_DEVICES=0,1" in message
    assert 'HeteroDDPStrategy(capacities="profile")' in message  # the job's own layout on the rest
    assert slow_ranks(_lab(900, "nvlink"), BERT, "ddp") is None
    equal = [RankCost("A100", 1 / 1900)] * 4  # one class: nothing to drop
    assert slow_ranks(equal, BERT, "ddp", rate=10.0) is None


def test_the_doctor_prints_the_pick_with_its_trainer_and_yaml(capsys):
    main(["doctor", "--compare-layouts", "--params", "110e6", "--tokens", "128", "--global-batch", "160",
          "--lab", "A100-80GB,A100-80GB,RTX3090,RTX3090", "--link", "ethernet", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["pick"] in ("ddp:0,1", "fsdp:0,1")
    assert {"ddp:0,1", "ddp:0,1,2,3", "fsdp:0,1,2,3", "hybrid:0,1,2,3:2+3"} <= set(report["layouts"])
    assert report["trainer"].startswith("# CUDA_VISIBLE_DEVICES=0,1")
    assert "devices=2" in report["trainer"] and "devices: 2" in report["yaml"]
    assert "class_path: lightning_hetero.Hetero" in report["yaml"]
    assert report["assumed"] == ["A100-80GB", "RTX3090"] and report["measured"] == []
    main(["doctor", "--compare-layouts", "--params", "110e6", "--tokens", "128", "--global-batch", "160",
          "--lab", "A100-80GB,A100-80GB,RTX3090,RTX3090", "--solo", "A100-80GB=1900,RTX3090=900", "--link", "nvlink"])
    text = capsys.readouterr().out
    assert "pick: ddp:0,1,2,3" in text or "pick: fsdp:0,1,2,3" in text
    assert "measured: per-sample costs of A100-80GB, RTX3090" in text
    assert "trainer:\n  accelerator: gpu\n  devices: 4\n  strategy:\n    class_path: lightning_hetero." in text
    with pytest.raises(SystemExit):
        main(["doctor", "--compare-layouts", "--params", "1e8", "--lab", "A100-80GB,RTX3090", "--solo", "H100=5"])
    assert "`--solo` names ['H100']" in capsys.readouterr().err


def test_the_rehearsal_compares_every_layout_from_its_measured_ranks():
    def rank(r, card, forward, backward, batch):
        return RankResult("hetero", r, card, ok=True, batch=batch, global_batch=64, param_bytes=440_000_000,
                          card_memory_bytes=(80 if card == "A100-80GB" else 24) * 2**30,
                          phase_seconds=[[forward, backward, 0.002]] * 6, device="cuda")

    lab = ["A100-80GB", "A100-80GB", "RTX3090", "RTX3090"]
    # The 3090s measured 30x slower per sample than the A100s: they cost more than they add over PCIe.
    hetero = [rank(0, lab[0], 0.005, 0.01, 30), rank(1, lab[1], 0.005, 0.01, 30), rank(2, lab[2], 0.075, 0.15, 2),
              rank(3, lab[3], 0.075, 0.15, 2)]
    report = rehearsed_layouts(hetero, lab)
    assert report["pick"] in ("ddp:0,1", "fsdp:0,1") and report["trainer"].startswith("# CUDA_VISIBLE_DEVICES=0,1")
    assert "measured: per-sample costs of A100-80GB, RTX3090" in report["text"]
    assert rehearsed_layouts([rank(0, lab[0], 0.005, 0.01, 30), RankResult("hetero", 1, lab[1], oom=True)],
                             lab[:2]) is None


def _fit(emulate, monkeypatch):
    # The forked ranks' warnings go to pytest's record in each child, which the test cannot read: print them.
    monkeypatch.setattr(profile_run, "rank_zero_warn", rank_zero_only(lambda message: print(f"WARNING {message}")))
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = HeteroDDPStrategy(start_method="fork", capacities="profile", emulate=emulate,
                                 observation={"print_table": False}, resilience={"timeout": 120})
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(TinyModel(batch_size=8, n=64))


def test_a_fit_warns_once_naming_a_rank_that_costs_it_more_than_it_adds(capfd, monkeypatch):
    _fit([None, {"slowdown": 30}], monkeypatch)
    out = capfd.readouterr().out
    assert out.count("cost this job") == 1, out
    assert "rank 1 (" in out and "at 1/30 speed" in out and "predicted without it; drop it with" in out
    assert 'Trainer(accelerator="cpu", devices=1, strategy=HeteroDDPStrategy(capacities="profile"))' in out


def test_a_balanced_fit_does_not_warn(capfd, monkeypatch):
    _fit(None, monkeypatch)
    assert "cost this job" not in capfd.readouterr().out


def test_the_seed_lab_predictions_script_writes_every_layout(tmp_path, capsys):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks"))
    import doctor_layouts

    table = doctor_layouts.main(["--out", str(tmp_path), "--solo", "bert=A100-80GB=1900,RTX3090=420"])
    assert set(table) == {"bert", "gpt124m", "gpt1.6b"}
    assert table["gpt1.6b"]["ddp4"] is None  # a 3090 cannot hold the 1.64B GPT's replica
    assert all(table["bert"][k] for k in ("pair", "ddp4", "fsdp4", "hybrid4"))
    saved = json.loads((tmp_path / "doctor_predictions.json").read_text())
    assert saved["bert"]["pick"] == table["bert"]["pick"] and "measured" in (tmp_path / "doctor_bert.txt").read_text()
    assert "workload      pair" in capsys.readouterr().out
