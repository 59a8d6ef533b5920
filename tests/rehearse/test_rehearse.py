"""`doctor --lab`: the rehearsed plan and shares equal those of a real multi-process CPU run of the same job."""

import os
import tempfile

import pytest

from benchmarks.rehearse_check import honesty_check
from lightning_hetero.rehearse.cards import parse_lab

CONFIG = """seed_everything: 0
model:
  class_path: tests.helpers.TinyModel
  init_args: {batch_size: 8, n: 200}
trainer:
  strategy:
    class_path: lightning_hetero.HeteroFSDPStrategy
    init_args:
      capacities: {A100: 3, "3090": 1}
"""


def test_parse_lab_names_the_flag():
    assert parse_lab("A100-80GB,RTX3090,RTX3090") == ["A100-80GB", "RTX3090", "RTX3090"]
    with pytest.raises(ValueError, match="--lab"):
        parse_lab("A100-80GB")
    with pytest.raises(ValueError, match="not a preset"):
        parse_lab("A100-80GB,GTX9999")


@pytest.mark.slow
def test_rehearsed_plan_and_shares_equal_a_real_cpu_run(tmp_path, monkeypatch):
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # this process's scratch, and the ranks' (TMPDIR)
    monkeypatch.setenv("TMPDIR", str(scratch))
    report = honesty_check(str(config), "A100-80GB,RTX3090,RTX3090", steps=4, out_dir=str(tmp_path / "out"))
    rows = report["check"]["rows"]
    # Every run's own record is kept (for looking into a disagreement later); no scratch folder is left behind.
    shared, solo = report["check"]["shared"], report["check"]["solo"]
    assert [run["rank"] for run in shared] == [0, 1, 2] and [run["mode"] for run in solo] == ["solo"] * 3
    assert all(len(run["step_seconds"]) == 4 for run in shared + solo), (shared, solo)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("hetero-rehearse")]
    assert len(rows) == 3
    for row in rows:
        rehearsed_plan, real_plan = row["plan"]
        rehearsed_split, real_split = row["split"]
        assert rehearsed_plan == real_plan and rehearsed_plan is not None
        assert rehearsed_split == real_split and sum(rehearsed_split) == 24
    assert rows[0]["split"][0][0] > rows[1]["split"][0][1]


def test_a_switched_strategy_keeps_the_options_it_takes(capsys):
    from jsonargparse import Namespace

    from lightning_hetero.rehearse.rank import carried_options

    ddp = Namespace(class_path="lightning_hetero.HeteroDDPStrategy",
                    init_args=Namespace(capacities={"A100": 3, "3090": 1}, ddp_kwargs={"bucket_cap_mb": 50}))
    assert carried_options(ddp, "lightning_hetero.HeteroFSDPStrategy") == {"capacities": {"A100": 3, "3090": 1}}
    assert "['ddp_kwargs']: left out" in capsys.readouterr().out
    assert carried_options(Namespace(class_path="lightning.pytorch.strategies.DDPStrategy"),
                           "lightning_hetero.HeteroFSDPStrategy") == {}
    # Rebalancing, which the sharded strategy refuses, is left out of it (and kept when it is off).
    ddp.init_args.rebalance = {"every": 50}
    assert "rebalance" not in carried_options(ddp, "lightning_hetero.HeteroFSDPStrategy")
    assert "refuses the config's strategy options ['rebalance'] as set: left out" in capsys.readouterr().out
    assert carried_options(ddp, "lightning_hetero.HeteroDDPStrategy")["rebalance"] == {"every": 50}
    ddp.init_args.rebalance = Namespace()  # `rebalance: {}`: on, with the defaults
    assert "rebalance" not in carried_options(ddp, "lightning_hetero.HeteroFSDPStrategy")
    ddp.init_args.rebalance = False
    assert carried_options(ddp, "lightning_hetero.HeteroFSDPStrategy")["rebalance"] is False
    ddp.init_args.capacities = "profile"  # refused as well: the sharded strategy takes its default
    assert "capacities" not in carried_options(ddp, "lightning_hetero.HeteroFSDPStrategy")
    assert carried_options(ddp, "lightning_hetero.HeteroDDPStrategy")["capacities"] == "profile"


def test_a_card_run_alone_keeps_its_speed_in_the_lab():
    from benchmarks.rehearse_check import solo_card
    from lightning_hetero.lab.cards import training_speed

    lab = ["A100-40GB", "RTX3090"]
    # CPU slowdowns are relative to the lab's fastest card (published training speed): alone, the 3090 keeps the
    # lab's, not 1.
    card = solo_card(lab, 1, "cpu")
    in_lab = training_speed("A100-40GB") / training_speed("RTX3090")
    assert card["preset"] == "RTX3090" and card["slowdown"] == pytest.approx(in_lab) and in_lab > 1.5
    assert solo_card(lab, 0, "cpu")["slowdown"] == 1.0
    assert solo_card(lab, 1, "gpu") == "RTX3090"  # an SM share is the card's own already


def _result(mode, rank, batch, step, ok=True, oom=False, modes=None):
    from lightning_hetero.rehearse.job import RankResult

    return RankResult(mode, rank, "card", ok=ok, oom=oom, batch=batch, global_batch=8,
                      step_seconds=[9.0, 9.0] + ([step] * 3 if step else []), param_bytes=4_000_000,
                      compute_bytes=2_000_000, memory_modes=modes)


def test_prediction_times_every_strategy_on_its_own_steps_and_extrapolates_only_what_did_not_run():
    from lightning_hetero.rehearse.predict import predict

    ours = [_result("hetero", 0, 6, 0.060, modes=["keep", "keep"]), _result("hetero", 1, 2, 0.050)]
    ddp = [_result("ddp", 0, 4, 0.045), _result("ddp", 1, 4, None, ok=False, oom=True)]
    fsdp = [_result("fsdp", 0, 4, 0.045), _result("fsdp", 1, 4, 0.080)]
    out = predict(ours, ddp, fsdp, "hetero_fsdp", "pcie")
    strategies = out["strategies"]
    assert strategies["fsdp"]["compute_seconds"] == pytest.approx([0.045, 0.080])  # measured, not 4/rate
    assert strategies["fsdp"]["estimated"] == [] and strategies["ddp"]["estimated"] == [1]
    assert strategies["ddp"]["compute_seconds"][1] == pytest.approx(4 / (2 / 0.050))  # our 3090 rate, linear
    assert strategies["ddp"]["samples_per_s"] is None and strategies["ddp"]["oom_ranks"] == [1]
    # Solo rates: each card's best measured (the 3090 is faster per sample at batch 4 than at 2).
    assert out["solo_samples_per_s"] == pytest.approx([6 / 0.060, 4 / 0.080])
    comm = strategies["hetero_fsdp"]["communication_seconds"]
    assert strategies["hetero_fsdp"]["step_seconds"] == pytest.approx(0.060 + comm)


def test_prediction_composes_the_measured_phases_and_buckets_of_each_rank():
    """Issue 37's 7 + 1 split in shape: rank 0 (6 samples) is the slower in its forward and backward, rank 1 (2
    samples on a slow card) in its optimizer step; the step is composed phase by phase, and DDP's buckets reduce when
    both ranks measured them ready (the last one at the backward's end)."""
    from lightning_hetero.rehearse.predict import predict

    ours = [_result("hetero", 0, 6, 0.060), _result("hetero", 1, 2, 0.065)]
    for rank, phases in zip(ours, ([0.015, 0.040, 0.005], [0.005, 0.015, 0.045])):
        rank.phase_seconds = [[1.0, 1.0, 1.0]] * 2 + [phases] * 3
        rank.bucket_bytes, rank.bucket_ready = [1_000_000, 1_000_000, 2_000_000], [0.3, 0.6, 1.0]
    out = predict(ours, [], [], "hetero_ddp", "pcie", measured_link=(1.0, 0.0))
    ddp = out["strategies"]["hetero_ddp"]
    assert [pytest.approx(p) for p in ([0.015, 0.040, 0.005], [0.005, 0.015, 0.045])] == ddp["phase_seconds"]
    # 2 MB (2 ms at 1 GB/s over two ranks' ring) after rank 0's backward (0.055), then rank 1's optimizer (0.045).
    assert ddp["step_seconds"] == pytest.approx(0.055 + 0.002 + 0.045)
    assert ddp["step_seconds"] > max(ddp["compute_seconds"]) + 0.03  # the slower total plus a bucket, no longer
    # Without phases (an older record) the totals are split as before: the slower total, then its one 4 MB bucket.
    for rank in ours:
        rank.phase_seconds = []
    older = predict(ours, [], [], "hetero_ddp", "pcie", (1.0, 0.0))["strategies"]["hetero_ddp"]
    assert older["step_seconds"] == pytest.approx(0.065 + 0.004)


def test_lightnings_sharded_baseline_is_timed_over_the_blocks_it_wraps():
    # Ours replicated (no memory plan, so no blocks of its own): Lightning's FSDP is gathered block by block all the
    # same, not as one block whose gathers nothing hides.
    from lightning_hetero.rehearse.predict import predict

    ours = [_result("hetero", 0, 6, 0.060), _result("hetero", 1, 2, 0.050)]
    fsdp = [_result("fsdp", 0, 4, 0.045), _result("fsdp", 1, 4, 0.080)]
    whole = predict(ours, [], fsdp, "hetero_ddp", "pcie", (0.1, 0.0))["strategies"]["fsdp"]
    for rank in fsdp:
        rank.blocks = 8
    blocked = predict(ours, [], fsdp, "hetero_ddp", "pcie", (0.1, 0.0))["strategies"]["fsdp"]
    assert blocked["step_seconds"] < whole["step_seconds"] - 0.01


def test_measured_capacities_are_named_as_not_rehearsed():
    from lightning_hetero.rehearse.notes import notes

    rank = _result("hetero", 0, 6, 0.06)
    rank.capacities_asked, rank.capacity_source = "auto", "peak"
    assert any("capacities ['auto'] are measured across the ranks" in n for n in notes([rank], "gpu"))
    rank.capacities_asked = "peak"
    assert not any("measured across" in n for n in notes([rank], "gpu"))


def test_a_step_that_waits_on_the_host_is_named_host_bound():
    """The device's wait at each step's end tells a host-bound step (the time measures this machine's CPU, not the
    card) from a device-bound one; the rank table, the notes and the honesty check's disagreements say which."""
    from benchmarks.rehearse_check import compare_rank, format_check
    from lightning_hetero.rehearse.job import RankResult
    from lightning_hetero.rehearse.notes import notes

    steps = [2.0, 2.0, 0.150, 0.130, 0.170, 0.160, 0.140, 0.150]  # two warm-up steps, then 0.15 s ± 0.02
    host = RankResult("hetero", 0, "A100-40GB", ok=True, device="NVIDIA H100", step_seconds=steps,
                      peak_allocated_bytes=2**30, device_wait_seconds=[0.5, 0.5] + [0.0001] * 6)
    device = RankResult("hetero", 1, "RTX3090", ok=True, device="NVIDIA H100", step_seconds=steps,
                        peak_allocated_bytes=2**30, device_wait_seconds=[0.5, 0.5] + [0.006] * 6)
    cpu = RankResult("hetero", 0, "A100-40GB", ok=True, device="cpu", step_seconds=steps,
                     device_wait_seconds=[0.0] * 8)
    assert (host.host_bound, device.host_bound, cpu.host_bound) == (True, False, None)
    assert host.step_spread == pytest.approx((0.1625 - 0.1375) / 0.150)  # quartiles of the six timed steps
    assert RankResult("hetero", 0, "x", step_seconds=steps[:5]).step_spread is None  # too few timed steps
    said = notes([host, device], "gpu")
    assert [n for n in said if "host-bound" in n] == [n for n in said if n.startswith("rank 0 (A100-40GB)")]
    assert "waited 0.1 ms of 150.0 ms" in said[0]
    # The honesty check's words for a step beyond the agreement name the cause where the step is host-bound.
    solo = RankResult("solo", 0, "A100-40GB", ok=True, device="NVIDIA H100", step_seconds=[s * 0.8 for s in steps],
                      device_wait_seconds=[0.0001] * 8)
    row, differs = compare_rank(0, host, host, solo, cuda=True)
    assert row["step_error"] == pytest.approx(0.25) and row["host_bound"] == [True, True]
    assert differs == [("rank 0: rehearsed step 150.0 ms ±8% vs emulated solo 120.0 ms ±8% (+25.0%); host-bound "
                        "(rehearsed/solo: host/host): the times are this machine's CPU speed, which varies with its "
                        "load")]
    row, differs = compare_rank(1, device, device, solo, cuda=True)
    assert differs and "host-bound (rehearsed/solo: device/host)" in differs[0]
    table = format_check({"agreement": 0.1, "disagreements": differs, "rows": [row]})
    assert "150.0/120.0" in table and "device/host" in table and "DIFFERS (> 10%): rank 1" in table
    assert compare_rank(1, device, device, device, cuda=True)[1] == []  # the same runs agree


def test_the_honesty_check_refuses_the_hybrid_layout_naming_its_rehearsal(tmp_path):
    """The hybrid layout's rehearsal runs its ranks together and predicts no step: the one-rank-at-a-time check has
    nothing to hold against the real run, and says which command rehearses it (before any rank starts)."""
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
    for name, strategy in (("rehearse_hybrid_cpu.yaml", None), ("rehearse_cpu.yaml", "hetero_hybrid")):
        with pytest.raises(ValueError, match=r"rehearsed with its ranks together \(`doctor --model CONFIG --lab"):
            honesty_check(os.path.join(configs, name), "A100-80GB,RTX3090,RTX3090", steps=2, out_dir=str(tmp_path),
                          strategy=strategy)


@pytest.mark.parametrize("name", ["hetero_fsdp", "hetero_ddp_spawn"])
def test_a_config_naming_a_strategy_by_its_registry_name_is_rehearsed_as_that_class(name):
    """``trainer.strategy: hetero_fsdp`` in a config (Lightning's registry spelling) was refused as "not a
    lightning_hetero strategy"."""
    from jsonargparse import Namespace

    from lightning_hetero.registry import entry_of
    from lightning_hetero.rehearse.job import RankJob
    from lightning_hetero.rehearse.rank import rehearsed_config

    job = RankJob("job.yaml", "hetero", 0, ["A100-80GB", "RTX3090"], 4, "rank0.json")
    config = Namespace(trainer=Namespace(strategy=name), model=Namespace(batch_size=8))
    rehearsed_config(job, config)
    assert config.trainer.strategy.class_path == entry_of(name).class_path
    assert config.trainer.strategy.init_args.emulate == ["A100-80GB", "RTX3090"]
    with pytest.raises(ValueError, match="is not a lightning_hetero strategy"):
        rehearsed_config(job, Namespace(trainer=Namespace(strategy="ddp"), model=Namespace(batch_size=8)))
