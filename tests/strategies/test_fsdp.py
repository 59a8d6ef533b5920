"""HeteroFSDPStrategy: sharded training over unequal ranks, with the math of one process on the global batch."""

import dataclasses
import copy
import os
import sys

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_hetero import HeteroFSDPStrategy
from lightning_hetero._compat import checkpoint_module_in_place
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.plan.memory import (
    GIB,
    MemoryFitError,
    MemoryPolicy,
    ModelFootprint,
    device_budget,
    memory_column,
    parse_memory_policy,
    resolve_memory,
)
from lightning_hetero.resilience.sharded import export_full_checkpoint, is_sharded_checkpoint
from tests.strategies._fsdp_worker import make_model, reference, run_ranks, train_sharded
from tests.helpers import Recorder, TinyModel, fit_distributed, flat_params, free_port, max_rel_diff, reference_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Global batches split by capacity, the last one partial (with [5, 2, 1] one rank gets no sample: a padding step).
SPLITS = {
    "[3, 1]": [[6, 2], [6, 2], [6, 2], [3, 1]],
    "[5, 2, 1]": [[5, 2, 1], [5, 2, 1], [5, 2, 1], [2, 1, 0]],
}
TOLERANCE = 1e-6  # the DDP strategy's tolerance against one process


def _max_diff(full: dict, expected: dict) -> float:
    return max((torch.tensor(full[k]) - expected[k]).abs().max().item() for k in expected)


def _fit(steps: list[list[int]], **kwargs) -> dict:
    options = {"optimizer": "sgd", "checkpoint_rank": None, "offload_rank": None, **kwargs}
    results = run_ranks(len(steps[0]), free_port(), train_sharded, steps=steps, **options)
    assert all(r == results[0] for r in results[1:])  # the gathered parameters are identical on every rank
    return results[0]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("capacities", list(SPLITS))
def test_weighted_loss_under_fsdp_equals_one_process(capacities, optimizer):
    steps = SPLITS[capacities]
    assert _max_diff(_fit(steps, optimizer=optimizer), reference(steps, optimizer)) < TOLERANCE


@pytest.mark.slow
def test_hybrid_sharding_over_two_hosts_equals_one_process():
    """4 ranks on 2 pretend hosts: a 2-D mesh (replicate x shard), unequal batches, AdamW."""
    steps = [[4, 2, 1, 1]] * 3 + [[2, 1, 1, 0]]
    assert _max_diff(_fit(steps, optimizer="adamw", hosts=2), reference(steps, "adamw")) < TOLERANCE


def test_unweighted_fsdp_would_fail_the_check():
    """Plain FSDP averaging of unequal batches lands far outside the tolerance above."""
    steps = SPLITS["[3, 1]"]
    assert _max_diff({k: v.tolist() for k, v in reference(steps, "sgd", equal_rank_weights=True).items()},
                     reference(steps, "sgd")) > 1e-3


@pytest.mark.slow
def test_checkpointing_on_one_rank_and_offload_on_another_change_nothing():
    steps = SPLITS["[5, 2, 1]"]
    full = _fit(steps, optimizer="adamw", checkpoint_rank=1, offload_rank=2)
    assert _max_diff(full, reference(steps, "adamw")) < TOLERANCE


@pytest.mark.slow
def test_gradient_accumulation_without_sync_equals_one_process():
    steps = SPLITS["[3, 1]"]
    full = _fit(steps, accumulate=2)
    assert _max_diff(full, reference(steps, "sgd", accumulate=2)) < TOLERANCE


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_another_world_size(tmp_path):
    """Saved by 2 ranks halfway, resumed by 3 (shares of the same global batches), exported to one file."""
    two = [[6, 2]] * 6
    three = [[4, 2, 2]] * 6
    saved = str(tmp_path / "ckpt")
    _fit(two, optimizer="adamw", save=saved)
    assert is_sharded_checkpoint(saved) and not (tmp_path / "ckpt.partial").exists()
    resumed = _fit(three, optimizer="adamw", start=3, load=saved)
    assert _max_diff(resumed, reference(two, "adamw")) < TOLERANCE

    export_full_checkpoint(saved, tmp_path / "full.ckpt")
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=False)
    model = make_model()
    model.load_state_dict(checkpoint["state_dict"])
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert checkpoint["step"] == 3 and optimizer.state[model[0].weight]["step"].item() == 3
    halfway = reference(two[:3], "adamw")
    assert max((model.state_dict()[k] - halfway[k]).abs().max().item() for k in halfway) < TOLERANCE


# -- memory policy ----------------------------------------------------------------------------------------------------

A100 = DeviceInfo(0, "h", "cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB, 108)
RTX3090 = DeviceInfo(1, "h", "cuda", "NVIDIA GeForce RTX 3090", (8, 6), 24 * GIB, 82)
# A 7.5 GB (fp32) model with AdamW: 30 GB of parameters, gradients and moments, 15 GB per rank when sharded over 2.
FOOTPRINT = ModelFootprint(parameter_bytes=7_500_000_000, largest_block_bytes=250_000_000, blocks=30,
                           optimizer_slots=2)


def _plan(policy, samples=(12, 4), per_sample=2 * GIB, devices=(A100, RTX3090)):
    budgets = [device_budget(d, policy.headroom) for d in devices]
    return resolve_memory(policy, FOOTPRINT, devices, list(samples), budgets, len(devices), per_sample)


def test_whole_rank_auto_memory_keeps_everything_where_it_fits_and_checkpoints_or_offloads_the_short_rank():
    """``granularity="rank"``: one whole-rank mode each (per-block plans: tests/test_fsdp_memory.py)."""
    whole = MemoryPolicy(granularity="rank")
    plans = _plan(whole)
    # A100: 13.97 GiB of state + 0.93 gathered + 24 GiB activations fits 72 GiB; the 3090's 8 GiB of activations do
    # not fit its 21.6 GiB, half of them (checkpointing) do.
    assert [p.mode for p in plans] == ["keep", "checkpoint"]
    assert plans[1].activations == 4 * GIB
    # A model that keeps most activations outside its blocks gains less from checkpointing: offload then.
    assert _plan(MemoryPolicy(checkpointed_fraction=0.9, granularity="rank"))[1].mode == "offload"
    column = memory_column(plans, whole)
    assert column[0].startswith("auto: keep") and column[1].startswith("auto: checkpoint")
    # More activations per sample: neither checkpointing nor offloading alone fits the 3090; both do.
    assert [p.mode for p in _plan(whole, per_sample=8 * GIB)][1] == "checkpoint_offload"


def test_rank_rules_win_over_device_names():
    plans = _plan(parse_memory_policy({"rank:0": "offload", "A100": "keep", "3090": "checkpoint"}))
    assert [p.mode for p in plans] == ["offload", "checkpoint"]
    assert plans[0].shard == 0 and plans[0].optimizer_state == 0


def test_a_config_that_cannot_fit_fails_with_every_ranks_numbers():
    with pytest.raises(MemoryFitError) as err:
        _plan(parse_memory_policy("keep"))
    message = str(err.value)
    assert "rank 1 (NVIDIA GeForce RTX 3090, keep)" in message
    assert "parameters+gradients 6.98 GiB, optimizer state 6.98 GiB" in message  # 2 x 3.75 GB and 2 x 3.75 GB
    assert "2.05e+03 MiB/sample x 4" in message and "of 21.6 GiB free" in message
    assert "rank 0" in message.split("Every rank:")[1]  # the ranks that fit are listed too


@pytest.mark.parametrize(("value", "message"), [
    ("fast", "`memory`='fast' is not one of ('auto', 'keep', 'checkpoint', 'offload', 'checkpoint_offload')"),
    ({"3090": "swap"}, "`memory`['3090']='swap' is not one of"),
    ({"rank:x": "keep"}, "`memory` key 'rank:x' must be 'rank:N'"),
    (3, "`memory`=3 must be a string, a mapping or a MemoryPolicy"),
])
def test_bad_memory_arguments_name_the_field(value, message):
    with pytest.raises(ValueError) as err:
        parse_memory_policy(value)
    assert message in str(err.value)
    with pytest.raises(ValueError, match=r"`memory.headroom`=1.5 must be a number in \[0, 1\)"):
        MemoryPolicy(headroom=1.5)
    with pytest.raises(ValueError, match=r"`memory.checkpointed_fraction`=0 must be a number in \(0, 1\]"):
        MemoryPolicy(checkpointed_fraction=0)


def test_checkpointing_in_place_recomputes_and_keeps_parameter_names():
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    names = [n for n, _ in block.named_parameters()]
    calls = []
    block[0].register_forward_hook(lambda *args: calls.append(1))
    checkpoint_module_in_place(block)
    block(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert len(calls) == 2 and [n for n, _ in block.named_parameters()] == names


# -- the strategy -----------------------------------------------------------------------------------------------------




def _strategy_fit(tmp_path, capacities, optimizer="sgd", n=53, epochs=3, strategy_kwargs=None, after_backward=None,
                  **trainer_kwargs):
    seed_everything(0)
    model = TinyModel(optimizer, n=n, batch_size=4)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), len(capacities), {"capacities": capacities,
                                                                      **(strategy_kwargs or {})},
                              max_epochs=epochs, strategy_class=HeteroFSDPStrategy, **trainer_kwargs)
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    ref_params, _ = reference_run(reference_model, len(capacities), capacities, epochs, accumulate=accumulate,
                                  after_backward=after_backward)
    return records, ref_params


@pytest.mark.slow
@pytest.mark.parametrize(("capacities", "optimizer"), [([3, 1], "sgd"), ([5, 2, 1], "adam")])
def test_strategy_equals_one_process(tmp_path, capacities, optimizer):
    records, ref_params = _strategy_fit(tmp_path, capacities, optimizer, n=53 if len(capacities) == 2 else 50)
    assert {r["steps"] for r in records} == {len(ref_params)}
    for step, expected in enumerate(ref_params):
        for r in records[1:]:
            assert torch.equal(r["params"][step], records[0]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= TOLERANCE, step


@pytest.mark.slow
def test_norm_clipping_under_sharding_equals_one_process(tmp_path):
    """`gradient_clip_val` by norm: a rank holds shards of the gradients (DTensors), whose norm torch's
    `clip_grad_norm_` (Lightning's clipping) reduces over the mesh: every rank clips by the whole model's norm."""
    max_norm = 0.02
    records, ref_params = _strategy_fit(tmp_path, [3, 1], epochs=1, gradient_clip_val=max_norm,
                                        after_backward=lambda m: nn.utils.clip_grad_norm_(m.parameters(), max_norm))
    seed_everything(0)
    unclipped, _ = reference_run(TinyModel("sgd", n=53, batch_size=4), 2, [3, 1], 1)
    assert max_rel_diff(unclipped[-1], ref_params[-1]) > 1e-3  # the clipping bites
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[1]["params"][step], records[0]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= TOLERANCE, step


@pytest.mark.slow
def test_auto_capacities_under_sharding_keep_the_published_rates_and_every_rank_in_step(tmp_path):
    """A sharded step waits at every block for all ranks' all-gathers, so timing it gives every rank the slowest
    rank's time: profiling measures memory caps only, with every rank running the same steps, and the shares stay
    the published rates (equal on CPU, which has none), even where the emulated cards differ 9-fold."""
    records = fit_distributed(TinyModel(n=48), str(tmp_path), 3, {
        "capacities": "auto", "emulate": ["A100-40GB", "RTX3090", "RTX3090"]}, max_epochs=1,
        strategy_class=HeteroFSDPStrategy)
    assert [[len(batch) for batch in r["indices"]] for r in records] == [[4] * 4] * 3
    for r in records[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], records[0]["params"]))


@pytest.mark.slow
def test_strategy_gradient_accumulation_equals_one_process(tmp_path):
    records, ref_params = _strategy_fit(tmp_path, [3, 1], n=64, accumulate_grad_batches=2)
    assert records[0]["steps"] == 12 and len(ref_params) == 24  # 8 batches an epoch, 4 optimizer steps
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= TOLERANCE


@pytest.mark.slow
def test_strategy_checkpointing_and_offload_on_one_rank_each_change_nothing(tmp_path):
    records, ref_params = _strategy_fit(tmp_path, [5, 2, 1], "adam", n=50, epochs=2,
                                        strategy_kwargs={"memory": {"rank:1": "checkpoint", "rank:2": "offload",
                                                                    "*": "keep"}})
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[2]["params"][step], records[0]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("global_batch_size", [None, 8])
def test_a_job_that_cannot_fit_fails_before_the_first_step_with_numbers(tmp_path, global_batch_size):
    """A terabyte of activations per sample fits nowhere: with the global batch known the plan fails at setup,
    otherwise once the shares are known, before the first step either way."""
    policy = MemoryPolicy(rules={"*": "keep"}, activation_bytes_per_sample=2**40)
    with pytest.raises(Exception) as err:
        fit_distributed(TinyModel(n=32), str(tmp_path), 2, {"capacities": [3, 1], "memory": policy,
                                                            "global_batch_size": global_batch_size},
                        strategy_class=HeteroFSDPStrategy)
    message = "".join(str(e) for e in (err.value, err.value.__cause__) if e is not None)
    assert isinstance(err.value, MemoryFitError) or "MemoryFitError" in message or "does not fit" in message
    assert "rank 0 (cpu, keep)" in message and "1.05e+06 MiB/sample x 6" in message
    assert "rank 1 (cpu, keep)" in message and "x 2 =" in message
    assert not (tmp_path / "rank0.pt").exists()  # no step was taken


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memory": "swap"}, "`memory`='swap' is not one of"),
    ({"blocks": "torch.nn.Linear"}, "`blocks`='torch.nn.Linear' must be None or a non-empty list"),
    ({"global_batch_size": 0}, "`global_batch_size`=0 must be a positive integer or None"),
    ({"resilience": {"timeout": -1}}, "`resilience.timeout`=-1"),
    ({"data": {"micro_batch": 0}}, "`data.micro_batch`=0 must be None, 'auto', a positive integer"),
    ({"blocks": ["Linear"]}, "`blocks`=['Linear'] must be None or a non-empty list of dotted class paths"),
    ({"hybrid": "yes"}, "`hybrid`='yes' must be True or False"),
    ({"capacities": [3, -1]}, "capacities"),
    ({"capacities": "profile"}, "`capacities`='profile' times each rank's own steps"),
    ({"rebalance": True}, "`rebalance` times each rank's own steps"),
    ({"rebalance": {"every": 5}}, "`rebalance` times each rank's own steps"),
])
def test_bad_strategy_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        HeteroFSDPStrategy(**kwargs)
    assert message in str(err.value)


def _fit_fsdp(out_dir, world, capacities, ckpt_dir=None, ckpt_path=None, max_steps=-1, resume=None, every=None):
    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    torch.manual_seed(0)
    model = TinyModel("adam", batch_size=4, n=64)
    strategy = HeteroFSDPStrategy(start_method="fork", observation={"print_table": False},
                                  resilience={"timeout": 120, "resume": resume}, capacities=capacities,
                                  global_batch_size=8)
    callbacks = [Recorder(out_dir)]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every or max(max_steps, 0),
                                         save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=2, max_steps=max_steps,
                      callbacks=callbacks, logger=False, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [([3, 1], [2, 1, 1]), ([2, 1, 1], [3, 1])], ids=["2->3", "3->2"])
def test_strategy_resumes_mid_epoch_on_another_world_size_and_exports_one_file(tmp_path, before, after):
    """Stop at step 5 of 8 (epoch 0); resume on another number of ranks from the sharded checkpoint and finish 2
    epochs like one process; the checkpoint exported to one file loads with ``load_from_checkpoint``."""
    seed_everything(0)
    ref_params, _ = reference_run(TinyModel("adam", batch_size=4, n=64), 2, [3, 1], 2)
    first = _fit_fsdp(str(tmp_path / "a"), len(before), before, ckpt_dir=str(tmp_path / "ckpt"), max_steps=5)
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    assert is_sharded_checkpoint(checkpoint) and first[0]["steps"] == 5
    resumed = _fit_fsdp(str(tmp_path / "b"), len(after), after, ckpt_path=str(checkpoint))
    assert resumed[0]["steps"] == 16 and len(resumed[0]["params"]) == 11
    for k, params in enumerate(resumed[0]["params"]):
        assert torch.equal(params, resumed[-1]["params"][k])
        assert max_rel_diff(params, ref_params[5 + k]) <= TOLERANCE, k
    taken = sorted(i for r in resumed for batch in r["indices"][:3] for i in batch)
    assert len(taken) == 24 and len(set(taken)) == 24  # the rest of epoch 0: each remaining sample once

    export_full_checkpoint(checkpoint, tmp_path / "full.ckpt")
    restored = TinyModel.load_from_checkpoint(tmp_path / "full.ckpt")
    assert max_rel_diff(flat_params(restored), ref_params[4]) <= TOLERANCE
    # The same file resumes a plain one-device Trainer: loops and AdamW's state (its step count) carry on.
    single = Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    single.fit(TinyModel("adam", batch_size=8, n=64), ckpt_path=str(tmp_path / "full.ckpt"))
    state = single.optimizers[0].state[single.lightning_module.net[0].weight]
    assert single.global_step == state["step"].item() > 5


@pytest.mark.slow
def test_resume_auto_goes_on_from_the_newest_sharded_checkpoint(tmp_path):
    """A re-run with ``resume="auto"`` finds the sharded directory ModelCheckpoint wrote and ends where an
    uninterrupted run ends."""
    whole = _fit_fsdp(str(tmp_path / "whole"), 2, [3, 1])
    _fit_fsdp(str(tmp_path / "a"), 2, [3, 1], ckpt_dir=str(tmp_path / "ckpt"), max_steps=5)
    again = _fit_fsdp(str(tmp_path / "b"), 2, [3, 1], ckpt_dir=str(tmp_path / "ckpt"), resume="auto")
    assert again[0]["steps"] == whole[0]["steps"] == 16
    assert len(again[0]["params"]) == len(whole[0]["params"]) - 5  # went on from step 5, not from scratch
    assert max_rel_diff(again[0]["params"][-1], whole[0]["params"][-1]) <= TOLERANCE


@pytest.mark.slow
def test_resume_auto_from_a_copied_folder_goes_by_recorded_steps(tmp_path):
    """Sharded checkpoints at steps 2, 4, 6 copied as `cp -r` does (every time the copy's), step 2's the newest: the
    re-run goes on from step 6, the step the directories' metadata records."""
    import shutil
    import time

    whole = _fit_fsdp(str(tmp_path / "whole"), 2, [3, 1])
    _fit_fsdp(str(tmp_path / "a"), 2, [3, 1], ckpt_dir=str(tmp_path / "ckpt"), max_steps=6, every=2)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "ckpt", copy, copy_function=shutil.copy)
    now = time.time()
    for checkpoint in copy.iterdir():
        step = int(checkpoint.name.split("step=")[1].split(".")[0])
        for path in (checkpoint, *checkpoint.rglob("*")):
            os.utime(path, (now - step, now - step))  # step 2 written last
    again = _fit_fsdp(str(tmp_path / "b"), 2, [3, 1], ckpt_dir=str(copy), resume="auto")
    assert len(again[0]["params"]) == len(whole[0]["params"]) - 6
    assert max_rel_diff(again[0]["params"][-1], whole[0]["params"][-1]) <= TOLERANCE


@pytest.mark.slow
def test_a_damaged_shard_is_refused_before_it_is_loaded(tmp_path):
    """Every sharded save carries a checksum manifest; a flipped byte in one shard stops the resume, naming it."""
    from lightning_hetero.resilience.checkpoint import MANIFEST_NAME

    _fit_fsdp(str(tmp_path / "a"), 2, [3, 1], ckpt_dir=str(tmp_path / "ckpt"), max_steps=5)
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    assert (checkpoint / MANIFEST_NAME).is_file()
    shard = next(p for p in sorted(checkpoint.iterdir()) if p.name.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match=shard.name):
        _fit_fsdp(str(tmp_path / "b"), 2, [3, 1], ckpt_path=str(checkpoint))


@pytest.mark.parametrize("config", ["fsdp_cpu.yaml", "fsdp_lab.yaml"])
def test_fsdp_configs_parse(config):
    """The shipped YAML files are valid LightningCLI configs for the fine-tuning example (without training)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from finetune_fsdp import Block, DigitsTransformer
    from lightning.pytorch.cli import LightningCLI
    from train_digits import DigitsDataModule

    cli = LightningCLI(DigitsTransformer, DigitsDataModule, run=False,
                       args=["--config", os.path.join(ROOT, "configs", config), "--trainer.accelerator=cpu",
                             "--trainer.devices=1"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HeteroFSDPStrategy)
    expected = {"fsdp_cpu.yaml": {"rank:1": "checkpoint", "*": "keep"}, "fsdp_lab.yaml": {"*": "auto"}}[config]
    assert strategy.memory_policy.rules == expected
    assert strategy.blocks == ((Block,) if config == "fsdp_lab.yaml" else None)


@pytest.mark.slow
def test_strategy_with_monitor_and_emulation_trains_and_reports(tmp_path):
    """The monitor, the watchdog and an emulated slow rank work as for DDP (same parameters as one process)."""
    records, ref_params = _strategy_fit(tmp_path, [3, 1], n=32, epochs=1, strategy_kwargs={
        "observation": {"monitor": True, "print_table": False},
        "emulate": [None, {"slowdown": 2, "name": "slow card (emulated)"}]})
    assert max_rel_diff(records[0]["params"][-1], ref_params[-1]) <= TOLERANCE


@pytest.mark.slow
def test_strategy_bf16_on_every_rank_shards_in_bf16_and_keeps_replicas_identical(tmp_path):
    """Every rank in bf16: bf16 all-gather and reduce-scatter, fp32 master weights (close to, not equal to, fp32)."""
    records, ref_params = _strategy_fit(tmp_path, [3, 1], n=32, epochs=1,
                                        strategy_kwargs={"precision_policy": "bf16-mixed"})
    for step in range(len(ref_params)):
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
    assert records[0]["params"][-1].dtype == torch.float32
    assert 0 < max_rel_diff(records[0]["params"][-1], ref_params[-1]) < 0.05


def test_registry_names_build_the_strategy():
    for name, start_method in (("hetero_fsdp", "popen"), ("hetero_fsdp_fork", "fork"), ("hetero_fsdp_spawn", "spawn")):
        strategy = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
        assert isinstance(strategy, HeteroFSDPStrategy) and strategy._start_method == start_method


class _KeepGatheredOnRank1(HeteroFSDPStrategy):
    """One rank's config differs (as a second host's YAML might): rank 1 keeps its blocks gathered."""

    def configure_ddp(self):
        if self.global_rank == 1:
            self.memory_policy = dataclasses.replace(self.memory_policy, keep_gathered=True)
        super().configure_ddp()


@pytest.mark.slow
def test_a_sharding_choice_that_differs_between_ranks_is_named_before_any_collective_hangs(tmp_path):
    with pytest.raises(Exception) as err:
        fit_distributed(TinyModel(n=32), str(tmp_path), 2, {"capacities": [1, 1]}, strategy_class=_KeepGatheredOnRank1)
    message = "".join(str(e) for e in (err.value, err.value.__cause__) if e is not None)
    assert "`memory.keep_gathered` differs between ranks (rank 0: auto, rank 1: True)" in message
    assert not (tmp_path / "rank0.pt").exists()


def test_teardown_leaves_the_optimizer_state_where_it_is(tmp_path, monkeypatch):
    """Lightning's base teardown copies every optimizer state to the host; a host already full of offloaded blocks
    cannot take that copy (the 13B GPT's rank was killed there), and Lightning's own FSDPStrategy skips it."""
    import lightning.pytorch.strategies.strategy as strategy_module

    moved: list[int] = []
    real = strategy_module._optimizers_to_device
    monkeypatch.setattr(strategy_module, "_optimizers_to_device",
                        lambda optimizers, device: (moved.append(len(optimizers)), real(optimizers, device)))
    environment = os.environ.copy()
    seed_everything(0)
    strategy = HeteroFSDPStrategy(observation={"print_table": False})
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    try:
        trainer.fit(TinyModel("adam", n=16, batch_size=4))
    finally:  # a process group of one, in this process: later tests start their own
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # Lightning's launcher wrote MASTER_*, NODE_RANK and LOCAL_RANK into this process's environment: a later
        # test's launch would read LOCAL_RANK as "started by an outside launcher" and never start its other ranks.
        os.environ.clear()
        os.environ.update(environment)
    assert moved == [0]
    assert len(trainer.optimizers) == 1 and trainer.optimizers[0].state  # the state kept, not dropped
