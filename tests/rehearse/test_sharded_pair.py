"""The sharded-pair benchmark's own logic on hand-made results: its levers, its rates, Σ solo at each lever's batches,
the emulation shown per rank, and the largest model's size."""

import argparse
import json

import pytest
import torch

from benchmarks.bench_sharded_pair import (
    SIZES,
    Lever,
    Pair,
    big_model,
    emulation_check,
    format_split,
    plot_big,
    read_splits,
    samples_per_s,
)
from benchmarks.step_split import device_kinds
from benchmarks.models import GPTConfig, gpt_parameters
from lightning_hetero.rehearse.job import RankResult


def _rank(rank: int, step: float, batch: int, speed=None, probe=None, split=None) -> RankResult:
    # Two untimed steps first (slow), then the timed ones.
    return RankResult("real", rank, f"card{rank}", ok=True, batch=batch, global_batch=sum(split or [batch]),
                      split=split, step_seconds=[9.0, 9.0, step, step, step], emulated_speed=speed,
                      emulation_probe_seconds=probe)


def test_levers_parse_into_the_strategys_arguments():
    lever = Lever.parse("caps=measured+gb=12+keep_gathered=true")
    assert (lever.capacities, lever.global_batch, lever.keep_gathered) == ("measured", 12, True)
    assert lever.strategy_args([40.123456, 4.5]) == {
        "capacities": [40.1235, 4.5], "memory": {"rules": {"*": "auto"}, "keep_gathered": True},
        "global_batch_size": 12}
    assert Lever.parse("caps=5/1+memory=keep").strategy_args(None) == {"capacities": [5.0, 1.0], "memory": "keep"}
    # The plan's choice unless the lever names one: resharded after forward asked for as False.
    assert Lever.parse("caps=5/1").keep_gathered == Lever.parse("caps=5/1+keep_gathered=auto").keep_gathered == "auto"
    assert Lever.parse("caps=5/1+keep_gathered=false").strategy_args(None)["memory"] == {
        "rules": {"*": "auto"}, "keep_gathered": False}
    assert Lever.parse("caps=peak").strategy_args(None)["capacities"] == "peak"
    with pytest.raises(ValueError, match="solo rates were not measured"):
        Lever.parse("caps=measured").strategy_args(None)


@pytest.mark.parametrize(("text", "message"), [("caps=fast", "caps='fast'"), ("gb=1", "gb='1'"), ("gb", "key=value"),
                                               ("keep_gathered=yes", "keep_gathered='yes'"), ("bucket=4", "'bucket'")])
def test_bad_levers_name_the_key(text, message):
    with pytest.raises(ValueError, match=message):
        Lever.parse(text)


def test_a_pair_runs_at_its_slowest_ranks_median_step():
    rate, _ = samples_per_s([_rank(0, 0.2, 7, split=[7, 1]), _rank(1, 0.25, 1, split=[7, 1])])
    assert rate == pytest.approx(8 / 0.25)
    failed = RankResult("real", 1, "card1", error="out of memory")
    assert samples_per_s([_rank(0, 0.2, 7, split=[7, 1]), failed]) == (None, None)


def test_every_rank_shows_its_emulation_and_an_unemulated_rank_is_named():
    rows, misses = emulation_check([_rank(0, 0.2, 7, 40.0, 0.01), _rank(1, 0.2, 1, 8.0, 0.045)])
    assert rows[1]["expected_ratio"] == pytest.approx(5.0) and misses == []  # 4.5x measured, within 25 %
    _, misses = emulation_check([_rank(0, 0.2, 7, 40.0, 0.01), _rank(1, 0.2, 1, None, 0.01)])
    assert misses == ["rank 1 (card1): NOT EMULATED"]
    _, misses = emulation_check([_rank(0, 0.2, 7, 40.0, 0.01), _rank(1, 0.2, 1, 8.0, 0.02)])
    assert misses == ["rank 1 (card1): workload 2.00x rank 0's, expected 5.00x"]


def test_sum_of_solo_rates_is_taken_at_the_levers_own_batches():
    pair = Pair(argparse.Namespace(), ["A100-80GB", "RTX3090"], "", None)
    pair.solo = {(0, 7): _rank(0, 0.175, 7), (1, 1): _rank(0, 0.25, 1), (0, 14): _rank(0, 0.33, 14)}
    assert pair.sum_solo([7, 1]) == pytest.approx(7 / 0.175 + 1 / 0.25)
    assert pair.sum_solo([14, 2]) is None  # card 1 not timed at 2 samples: no Σ solo rather than a wrong one


@pytest.mark.parametrize(("billions", "width"), [(8.0, 4096), (5.0, 4096), (8.0, 2560), SIZES["13b"]])
def test_the_big_model_has_about_the_parameters_asked(billions, width):
    model = big_model(billions, width)
    cfg = GPTConfig(vocab=model["vocab"], seq=model["seq"], width=width, layers=model["layers"], heads=model["heads"])
    assert billions * 1e9 <= gpt_parameters(cfg) < billions * 1e9 + 12 * width * width + 13 * width
    assert model["init"] == "fill" and width % model["heads"] == 0


def test_a_filled_gpt_has_the_random_ones_shapes_and_trains():
    import torch

    from benchmarks.lm import GPTModule

    filled, drawn = GPTModule(vocab=64, seq=8, width=32, layers=2, heads=2, init="fill"), GPTModule(
        vocab=64, seq=8, width=32, layers=2, heads=2)
    assert [(n, p.shape) for n, p in filled.named_parameters()] == [(n, p.shape) for n, p in drawn.named_parameters()]
    assert not any(p.is_meta for p in filled.parameters())
    assert torch.equal(filled.gpt.ln.weight, torch.ones(32)) and not filled.gpt.blocks[0].qkv.bias.any()
    loss = filled.training_step((torch.randint(0, 64, (2, 9)),), 0)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in filled.parameters())
    with pytest.raises(ValueError, match="`init`"):
        GPTModule(init="zeros")


def test_a_solo_card_whose_plan_is_short_runs_again_with_its_activations_counted(tmp_path, monkeypatch, capsys):
    import io

    import yaml

    import benchmarks.bench_sharded_pair as bench

    configs = []

    def launch(jobs, timeout, log):
        configs.extend(yaml.safe_load(open(job.config))["trainer"]["strategy"]["init_args"] for job in jobs)
        first = len(configs) == 1
        return [RankResult("solo", 0, "RTX3090", error="MemoryFitError: the model does not fit") if first
                else _rank(0, 0.25, 1)]

    monkeypatch.setattr(bench, "launch_ranks", launch)
    base = yaml.safe_load(open("configs/rehearse_gpt.yaml"))
    args = argparse.Namespace(accelerator="cpu", steps=4, timeout=10.0)
    pair = Pair(args, ["A100-80GB", "RTX3090"], str(tmp_path), io.StringIO())
    pair.solo_runs(base, [(1, 1)])
    assert configs[0]["memory"] == "auto"  # the strategy's own plan, measured
    assert configs[1]["global_batch_size"] == 1 and configs[1]["memory"]["activation_bytes_per_sample"] > 0
    assert pair.solo_rate(1, 1) == pytest.approx(4.0)


def test_device_time_is_split_into_copies_collectives_and_compute():
    class Event:
        def __init__(self, name, us, device="CUDA"):
            self.name, self.device_type = name, getattr(torch.autograd.DeviceType, device)
            self.time_range = argparse.Namespace(elapsed_us=lambda: us)

    events = [Event("Memcpy HtoD (Pinned -> Device)", 3e6), Event("Memcpy DtoH (Device -> Pinned)", 1e6),
              Event("ncclDevKernel_ReduceScatter_Sum_bf16", 2e6), Event("ampere_bf16_gemm", 5e6),
              Event("Memcpy DtoD (Device -> Device)", 1e6), Event("aten::mm", 9e6, "CPU")]
    assert device_kinds(events) == {"copies": 4.0, "collectives": 2.0, "compute": 6.0}


def test_each_ranks_profiled_step_is_read_back_and_printed(tmp_path):
    host = {"seconds": 1.5, "overlapped": 1.0, "waited": 0.5, "ns_per_parameter": 0.5, "threads": 15}
    for rank, steps in enumerate([None, [host]]):
        (tmp_path / f"split-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "step": 3, "wall_s": 3.0, "host_optimizer": steps,
             "device_s": {"compute": 1.0, "copies": 1.25, "collectives": 0.5}}))
    record = {"split": read_splits(str(tmp_path))}
    assert format_split(record) == [
        "    rank 0: step 3.00 s; device: compute 1.00 s, copies 1.25 s, collectives 0.50 s; no host step",
        "    rank 1: step 3.00 s; device: compute 1.00 s, copies 1.25 s, collectives 0.50 s; host optimizer 1.50 s "
        "(1.00 s during the backward, 0.50 s waited after it), 0.50 ns/param, 15 threads"]


def test_the_big_check_plots_every_run_and_each_profiled_rank(tmp_path):
    pytest.importorskip("matplotlib")
    split = {"rank": 0, "step": 3, "wall_s": 3.0, "host_optimizer": None,
             "device_s": {"compute": 1.0, "copies": 1.25, "collectives": 0.5}}
    result = {"model": {"layers": 2, "width": 64}, "caps_gib": [1.0, 0.5],
              "estimate": {"parameters": 1e8, "batch": 4},
              "runs": [{"run": "big-ours-overlap", "samples_per_s": None, "split": [split, {**split, "rank": 1}]},
                       {"run": "Lightning fsdp:offload", "samples_per_s": 0.25, "split": None}]}
    path = tmp_path / "big.png"
    plot_big(result, str(path))
    assert path.stat().st_size > 10_000
