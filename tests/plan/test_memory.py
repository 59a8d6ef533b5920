"""Per-block memory plans: the planner's choices (pure functions), the plan applied block by block, and a mixed
per-block plan against one process."""

import copy

import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn

from lightning_hetero import HeteroFSDPStrategy
from lightning_hetero._compat import fsdp_offloads
from lightning_hetero.grad.sharding import device_mesh, shard_module
from lightning_hetero.plan.blocks import top_level_blocks
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.plan.memory import (
    GIB,
    MemoryFitError,
    MemoryPolicy,
    ModelFootprint,
    device_budget,
    estimate,
    memory_column,
    parse_memory_policy,
    parse_rule,
    peak_report,
    resolve_memory,
    rule_name,
)
from tests.strategies._fsdp_worker import run_ranks
from tests.helpers import TinyModel, fit_distributed, free_port, max_rel_diff, reference_run

A100 = DeviceInfo(0, "h", "cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB, 108)
RTX3090 = DeviceInfo(1, "h", "cuda", "NVIDIA GeForce RTX 3090", (8, 6), 24 * GIB, 82)
# 7.5 GB of fp32 parameters in 30 blocks of 0.25 GB (nothing outside them), AdamW: 15 GB of state per rank over 2.
FOOTPRINT = ModelFootprint(parameter_bytes=7_500_000_000, largest_block_bytes=250_000_000, blocks=30,
                           optimizer_slots=2)


def _plan(policy, samples=(12, 4), per_sample=2 * GIB, footprint=FOOTPRINT):
    devices = (A100, RTX3090)
    budgets = [device_budget(d, policy.headroom) for d in devices]
    return resolve_memory(policy, footprint, devices, list(samples), budgets, 2, per_sample)


def _rule(plan, rule, per_sample=None):
    """The same rank under an explicit rule (to compare neighbouring plans)."""
    if per_sample is None:  # the activations per sample before checkpointing, recovered from the plan
        kept = 1 - 0.5 * plan.checkpoint_blocks / plan.blocks
        per_sample = round(plan.activations_per_sample / kept / GIB) * GIB
    return estimate(FOOTPRINT, rule, RTX3090 if plan.rank else A100, 2, plan.samples, per_sample, plan.budget)


def test_auto_checkpoints_only_the_blocks_a_short_card_needs():
    """The 3090 is 1.3 GiB short with every activation kept: checkpointing 10 of 30 blocks frees 10 x 0.13 GiB."""
    plans = _plan(parse_memory_policy("auto"))
    assert [p.mode for p in plans] == ["keep", "checkpoint:10"]
    short = plans[1]
    assert (short.offload_blocks, short.checkpoint_blocks, short.blocks) == (0, 10, 30)
    assert short.fits and not _rule(short, "checkpoint:9").fits  # filled to its budget, and no more
    assert short.budget - short.needed < 0.14 * GIB


def test_auto_offloads_the_fewest_blocks_when_checkpointing_all_is_not_enough():
    plans = _plan(parse_memory_policy("auto"), per_sample=8 * GIB)
    short = plans[1]
    # 32 GiB of activations checkpointed to 16 GiB + 14.9 GiB of state and gathered blocks: 9.3 GiB over 21.6 GiB;
    # each offloaded block frees 4 x 0.125 GB (its half of parameters, gradients and two moments) on this rank.
    assert short.mode == "offload:20,checkpoint:all" and short.fits
    assert not _rule(short, "offload:19,checkpoint:all").fits
    # The A100 recomputes 25 of 30 blocks and offloads none.
    assert plans[0].mode == "checkpoint:25" and plans[0].fits and not _rule(plans[0], "checkpoint:24").fits
    # Whole-rank granularity offloads every block of the short rank for the same job.
    assert [p.mode for p in _plan(MemoryPolicy(granularity="rank"), per_sample=8 * GIB)] == [
        "checkpoint", "checkpoint_offload"]


def test_rules_name_whole_ranks_or_blocks_and_round_trip():
    assert parse_rule("keep") == parse_rule("offload:0,checkpoint:0")
    assert parse_rule("checkpoint_offload") == parse_rule("checkpoint:all,offload:all")
    for offload, checkpoint in ((0, 0), (30, 0), (0, 30), (30, 30), (6, 30), (3, 7), (0, 12)):
        name = rule_name(offload, checkpoint, 30)
        counts = parse_rule(name)
        assert ((30 if counts.offload is None else counts.offload),
                (30 if counts.checkpoint is None else counts.checkpoint)) == (offload, checkpoint), name
    assert rule_name(6, 30, 30) == "offload:6,checkpoint:all"
    plans = _plan(parse_memory_policy({"rank:0": "keep", "3090": "offload:3,checkpoint:20"}))
    assert [(p.offload_blocks, p.checkpoint_blocks) for p in plans] == [(0, 0), (3, 20)]
    # Three offloaded blocks of 0.25 GB: 3 x 0.125 GB less of parameters + gradients on this rank.
    assert plans[1].shard == 2 * (7_500_000_000 - 750_000_000) // 2


@pytest.mark.parametrize(("value", "message"), [
    ("offload:x", "`memory`='offload:x' is not one of ('auto', 'keep', 'checkpoint', 'offload', 'checkpoint_offload')"),
    ({"3090": "offload:2,offload:3"}, "`memory`['3090']='offload:2,offload:3' is not one of"),
    ({"3090": "swap:3"}, "per-block counts such as 'offload:4'"),
])
def test_bad_block_rules_name_the_field(value, message):
    with pytest.raises(ValueError) as err:
        parse_memory_policy(value)
    assert message in str(err.value)
    with pytest.raises(ValueError, match=r"`memory.granularity`='layer' must be one of"):
        MemoryPolicy(granularity="layer")


def test_a_rule_naming_more_blocks_than_the_model_has_is_refused():
    with pytest.raises(ValueError, match="'offload:31' for rank 1 names more blocks than the model's 30"):
        _plan(parse_memory_policy({"3090": "offload:31", "*": "keep"}))


def test_peak_report_sets_peaks_beside_estimates_and_names_a_low_estimate():
    plans = _plan(parse_memory_policy("auto"))
    peaks = [plans[0].needed + 2 * GIB, plans[1].needed + 3 * GIB]
    text, low = peak_report(plans, peaks, [8 * GIB, int(2.4 * GIB)], steps=2)
    assert low == [1]  # 3 GiB over its estimate with 2.4 GiB of headroom; rank 0 is 2 GiB over 8 GiB of headroom
    assert "after 2 steps" in text and "checkpoint:10" in text and "+3.00 GiB" in text
    text, low = peak_report(plans, [None, None], [8 * GIB, 2 * GIB], steps=2)
    assert low == [] and text.count("n/a") == 4  # on CPU: no peak, no gap


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _apply_plan(rank: int, world: int, offload: int, checkpoint: int) -> dict:
    model = Stack()
    blocks = (nn.Sequential,)
    calls = [0] * 4
    for i, block in enumerate(top_level_blocks(model, blocks)):
        block[0].register_forward_hook(lambda *args, i=i: calls.__setitem__(i, calls[i] + 1))
    shard_module(model, device_mesh({"h": [0]}, "cpu"), blocks, checkpoint=checkpoint, offload=offload)
    model(torch.randn(2, 3)).sum().backward()
    return {"offloaded": [fsdp_offloads(b) for b in model.blocks], "root": fsdp_offloads(model), "calls": calls}


@pytest.mark.parametrize(("offload", "checkpoint", "root"), [(1, 3, False), (4, 2, True), (0, 0, False)])
def test_the_first_blocks_offload_and_recompute_as_the_plan_says(offload, checkpoint, root):
    applied = run_ranks(1, free_port(), _apply_plan, offload=offload, checkpoint=checkpoint)[0]
    assert applied["offloaded"] == [i < offload for i in range(4)]
    assert applied["root"] is root  # the embeddings and head leave the device only with every block
    assert applied["calls"] == [2 if i < checkpoint else 1 for i in range(4)]  # recomputed in the backward


@pytest.mark.slow
def test_a_mixed_per_block_plan_equals_one_process(tmp_path):
    """[3, 1], fp32, gloo, Adam: rank 0 offloads its first block and recomputes it, rank 1 recomputes its first
    block only; same parameters as one process on the global batches, replicas bit-identical."""
    seed_everything(0)
    model = TinyModel("adam", n=53, batch_size=4)
    reference = copy.deepcopy(model)
    memory = {"rank:0": "offload:1,checkpoint:1", "rank:1": "checkpoint:1"}
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], "memory": memory}, max_epochs=2,
                              strategy_class=HeteroFSDPStrategy)
    ref_params, _ = reference_run(reference, 2, [3, 1], 2)
    assert len(records[0]["params"]) == len(ref_params)
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= 1e-6, step


def test_micro_batches_count_the_model_gathered_and_one_micro_batch_of_activations():
    """The 3090's share of 4 samples run as 2 micro-batches of 2: half the activations, but the whole model's
    parameters and unsharded gradients (2 x 7.5 GB) held across them instead of two blocks' (4 x 0.25 GB)."""
    budget = device_budget(RTX3090, 0.1)
    whole = estimate(FOOTPRINT, "keep", RTX3090, 2, 4, 2 * GIB, budget)
    pieces = estimate(FOOTPRINT, "keep", RTX3090, 2, 4, 2 * GIB, budget, micro_limit=2)
    assert (whole.micro_batches, whole.samples, whole.gathered) == (1, 4, 4 * 250_000_000)
    assert (pieces.micro_batches, pieces.samples, pieces.gathered) == (2, 2, 2 * 7_500_000_000)
    assert pieces.activations == whole.activations // 2 == 4 * GIB
    assert pieces.needed - whole.needed == 2 * 7_500_000_000 - 4 * 250_000_000 - 4 * GIB
    assert "over 2 micro-batches" in pieces.describe() and "(one micro-batch)" in pieces.describe()
    # A limit the share does not exceed runs it whole; 4 samples under a limit of 3 run as 2 + 2.
    assert estimate(FOOTPRINT, "keep", RTX3090, 2, 4, 2 * GIB, budget, micro_limit=4) == whole
    assert estimate(FOOTPRINT, "keep", RTX3090, 2, 4, 2 * GIB, budget, micro_limit=3) == pieces


def test_auto_chooses_with_the_micro_batches_counted():
    """The same job with the 3090 splitting its share: auto offloads blocks to make room for the gathered model,
    the fewest that fit; the A100, which runs its share whole, is planned as before; the lab column says so. (Blocks
    resharded after forward: keeping them gathered is a choice of the whole job, see the tests below.)"""
    policy = MemoryPolicy(keep_gathered=False)
    devices = (A100, RTX3090)
    budgets = [device_budget(d, policy.headroom) for d in devices]
    whole = resolve_memory(policy, FOOTPRINT, devices, [12, 4], budgets, 2, 2 * GIB)
    split = resolve_memory(policy, FOOTPRINT, devices, [12, 4], budgets, 2, 2 * GIB, micro_limits=[None, 2])
    assert split[0] == whole[0] and whole[1].mode == "checkpoint:10"
    assert split[1].micro_batches == 2 and split[1].fits and split[1].offload_blocks > 0
    fewer = estimate(FOOTPRINT, rule_name(split[1].offload_blocks - 1, 30, 30), RTX3090, 2, 4, 2 * GIB,
                     budgets[1], micro_limit=2)
    assert not fewer.fits
    column = memory_column(split, policy)
    assert "micro-batches" not in column[0] and "2 micro-batches: 14 GiB gathered" in column[1]


def test_keep_gathered_counts_the_whole_model_held_from_forward_to_backward():
    """Blocks that stay gathered until their backward hold every parameter on the device (fp32 size, a bound):
    the plan counts it on every rank, and auto makes room for it the way it does for micro-batches."""
    budget = device_budget(RTX3090, 0.1)
    resharded = estimate(FOOTPRINT, "keep", RTX3090, 2, 4, 2 * GIB, budget)
    kept = estimate(FOOTPRINT, "keep", RTX3090, 2, 4, 2 * GIB, budget, keep_gathered=True)
    assert kept.gathered - resharded.gathered == FOOTPRINT.parameter_bytes
    plans = _plan(MemoryPolicy(keep_gathered=True))
    assert plans[0].mode == "keep" and plans[1].offload_blocks > 0  # the 3090 offloads to hold the gathered model
    assert all(p.gathered == 4 * 250_000_000 + FOOTPRINT.parameter_bytes for p in plans)
    with pytest.raises(ValueError, match="keep_gathered"):
        MemoryPolicy(keep_gathered="yes")


def test_auto_keeps_the_blocks_gathered_where_every_rank_still_fits():
    """``keep_gathered="auto"`` (the default): a 3 GB model leaves both cards room for every block's parameters held
    from forward to backward, so the job keeps them gathered, each rank's blocks as chosen without; the lab column
    says so."""
    small = ModelFootprint(parameter_bytes=3_000_000_000, largest_block_bytes=100_000_000, blocks=30,
                           optimizer_slots=2)
    policy = MemoryPolicy()
    assert policy.keep_gathered == "auto"
    plans = _plan(policy, samples=(6, 2), per_sample=GIB, footprint=small)
    resharded = _plan(MemoryPolicy(keep_gathered=False), samples=(6, 2), per_sample=GIB, footprint=small)
    assert [p.keep_gathered for p in plans] == [True, True]
    assert [p.mode for p in plans] == [p.mode for p in resharded] == ["keep", "keep"]
    assert all(k.gathered - r.gathered == small.parameter_bytes for k, r in zip(plans, resharded))
    assert all(p.fits for p in plans)
    assert all(cell.endswith(", kept gathered (auto)") for cell in memory_column(plans, policy))
    assert "blocks kept gathered forward to backward" in plans[1].describe()
    # One rank per shard group (alone, or HSDP with one GPU per host) all-gathers nothing: resharded.
    alone = resolve_memory(policy, small, [A100], [6], [device_budget(A100, 0.1)], 1, GIB)
    assert alone[0].fits and not alone[0].keep_gathered


def test_auto_reshards_every_rank_when_one_rank_has_no_room_for_the_gathered_model():
    """The 3090 fits its whole share with every block resharded after forward (13.97 GiB of state, 2 GiB of
    activations) but not with the 6.98 GiB model held gathered besides: no rank keeps its blocks gathered (the A100,
    with room to spare, neither: a rank that kept them would skip the all-gathers of the backward the other joins),
    and auto does not recompute or offload a block to make room."""
    policy = MemoryPolicy()
    plans = _plan(policy, samples=(12, 1))
    assert [p.mode for p in plans] == ["keep", "keep"]
    assert [p.keep_gathered for p in plans] == [False, False]
    assert plans[1].fits
    kept = estimate(FOOTPRINT, "keep", RTX3090, 2, 1, 2 * GIB, plans[1].budget, keep_gathered=True)
    assert not kept.fits and plans[0].budget - plans[0].needed > FOOTPRINT.parameter_bytes  # the A100 had room
    assert plans == _plan(MemoryPolicy(keep_gathered=False), samples=(12, 1))
    assert all(cell.endswith(", resharded (auto)") for cell in memory_column(plans, policy))
    # A card that checkpoints to fit has no room either.
    assert not any(p.keep_gathered for p in _plan(policy))


def test_keep_gathered_asked_where_it_cannot_fit_fails_naming_the_field():
    with pytest.raises(MemoryFitError) as err:
        _plan(MemoryPolicy(rules={"*": "keep"}, keep_gathered=True), samples=(12, 1))
    message = str(err.value)
    assert "rank 1 (NVIDIA GeForce RTX 3090, keep)" in message and "blocks kept gathered forward to backward" in message
    assert "set `memory.keep_gathered` to 'auto' or False" in message
    with pytest.raises(MemoryFitError) as err:
        _plan(MemoryPolicy(rules={"*": "keep"}, keep_gathered="auto"), samples=(12, 8))
    assert "keep_gathered" not in str(err.value)  # auto never asks for it
    with pytest.raises(ValueError, match="`memory.keep_gathered`='yes' must be True, False or 'auto'"):
        MemoryPolicy(keep_gathered="yes")


def _held_after_forward(rank: int, world: int, reshard_after_forward: bool) -> dict:
    from torch.distributed.tensor import DTensor

    model = Stack()
    shard_module(model, device_mesh({"h": [0]}, "cpu"), (nn.Sequential,), checkpoint=0, offload=0,
                 reshard_after_forward=reshard_after_forward)
    loss = model(torch.randn(2, 3)).sum()
    # FSDP2 registers a block's gathered parameters as plain tensors, its shards as DTensors.
    after_forward = [not isinstance(b[0].weight, DTensor) for b in model.blocks]
    loss.backward()
    return {"after_forward": after_forward,
            "after_backward": [not isinstance(b[0].weight, DTensor) for b in model.blocks]}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_blocks_stay_gathered_from_forward_to_backward_only_when_asked(reshard_after_forward):
    held = run_ranks(1, free_port(), _held_after_forward, reshard_after_forward=reshard_after_forward)[0]
    assert held["after_forward"] == [not reshard_after_forward] * 4
    assert held["after_backward"] == [False] * 4  # resharded once their gradients are reduced
