"""Per-card micro-batches: a share larger than a rank's limit runs as k pieces with local accumulation, exactly."""

import copy
from collections import namedtuple

import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.config import parse_micro_batch
from lightning_hetero.data.microbatch import (
    _combine,
    check_micro_limits,
    chunk_sizes,
    micro_limits,
    run_micro_batches,
    slice_batch,
)
from tests.helpers import TinyModel, fit_distributed, max_rel_diff, reference_run


def test_chunk_sizes_and_limits():
    assert chunk_sizes(9, 3) == [3, 3, 3]
    assert chunk_sizes(10, 3) == [3, 3, 2, 2]
    assert chunk_sizes(5, 8) == [5] and chunk_sizes(5, None) == [5]
    assert micro_limits(None, [4, 4], 2) is None
    assert micro_limits("auto", None, 2) == [None, None]
    assert micro_limits("auto", (3, 40), 2) == [3, 40]
    assert micro_limits((5,), (3, 40), 2) == [3, 5]  # explicit and memory cap: the smaller
    assert micro_limits((5, 6), None, 2) == [5, 6]
    with pytest.raises(ValueError, match="micro_batch"):
        micro_limits((5, 6, 7), None, 2)


def test_no_micro_batch_below_the_least_share():
    """BatchNorm trained unsynced (least share 2): a share of 3 at a limit of 2 ran as [2, 1], a 1-sample batch."""
    for limit in (3, 4, 5, 7):
        for share in range(2, 40):
            sizes = chunk_sizes(share, limit, minimum=2)
            assert sum(sizes) == share and min(sizes) >= 2 and max(sizes) <= limit, (share, limit, sizes)
    with pytest.raises(ValueError, match="cannot run as micro-batches of 2 to 2"):
        chunk_sizes(3, 2, minimum=2)
    check_micro_limits([3, None], 2)
    check_micro_limits([1, 2], 1)
    with pytest.raises(ValueError, match=r"`data.micro_batch`: rank\(s\) \[1\].*at least 3, or leave"):
        check_micro_limits([3, 2], 2)


@pytest.mark.parametrize("value", [0, -1, [2, 0], "half", True, [], 2.5])
def test_bad_micro_batch_names_the_field(value):
    with pytest.raises(ValueError, match="micro_batch"):
        HeteroDDPStrategy(data={"micro_batch": value})
    assert parse_micro_batch(4) == (4,) and parse_micro_batch([2, 8]) == (2, 8) and parse_micro_batch("auto") == "auto"


def test_slice_batch_cuts_every_per_sample_field():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.arange(12).reshape(6, 2), "names": list("abcdef"), "scale": torch.tensor(2.0),
             "table": torch.zeros(3, 3), "pair": Pair(torch.arange(6), 7)}
    part = slice_batch(batch, 2, 5, 6)
    assert part["x"].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert part["names"] == ["c", "d", "e"]
    assert part["scale"] is batch["scale"] and part["table"] is batch["table"]  # not per sample
    assert isinstance(part["pair"], Pair) and part["pair"].a.tolist() == [2, 3, 4] and part["pair"].b == 7
    assert part["x"].data_ptr() == batch["x"][2:].data_ptr()  # a view, no copy


def test_logged_values_combine_by_reduce_fx():
    calls = [(torch.tensor(1.0), 0.5, (), {}), (torch.tensor(4.0), 0.25, (), {}), (torch.tensor(2.0), 0.25, (), {})]
    assert float(_combine("l", calls, "mean")) == pytest.approx(0.5 * 1 + 0.25 * 4 + 0.25 * 2)
    assert float(_combine("l", calls, "sum")) == 7.0
    assert float(_combine("l", calls, "max")) == 4.0


def test_micro_batches_accumulate_the_whole_batch_gradient():
    """In one process: k micro-batches' held gradients plus the last one's equal one backward on the whole batch."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    weights = [float(i + 1) for i in range(10)]  # e.g. tokens: each sample's share of the weighted mean

    def loss_fn(batch, w):
        per_sample = ((net(batch[0]) - batch[1]) ** 2).mean(1)
        return (per_sample * w).sum() / w.sum()

    w = torch.tensor(weights)
    loss_fn((x, y), w).backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)

    offsets = iter([0, 4, 7])
    params = list(net.parameters())

    def forward(chunk):
        start = next(offsets)
        return loss_fn(chunk, w[start : start + len(chunk[0])])

    output, pending = run_micro_batches((x, y), [4, 3, 3], weights, forward, lambda loss: loss.backward(),
                                        torch.enable_grad, params, nn.Module())
    assert all(p.grad is None for p in params)  # held aside while the loop would zero gradients
    net.zero_grad(set_to_none=True)
    pending.restore()
    output.backward()
    assert float(output.detach()) == pytest.approx(float(loss_fn((x, y), w).detach()), rel=1e-6)
    for p, e in zip(params, expected):
        assert torch.allclose(p.grad, e, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_micro_batched_rank_equals_one_process(tmp_path):
    """Capacities [3, 1], 12 samples a step: rank 0's share of 9 runs as 3 micro-batches of 3 (cap 3 from
    ``max_batch_per_rank``, ``micro_batch="auto"``), with gradient accumulation over 2 batches on top. Same
    parameters as one process on the global batches, replicas identical, the logged loss is the global mean."""
    seed_everything(0)
    model = TinyModel("sgd", n=53, batch_size=6)
    ref_model = copy.deepcopy(model)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    records = fit_distributed(model, str(tmp_path), 2,
                              {"capacities": [3, 1], "data": {"micro_batch": "auto"},
                               "profiling": {"max_batch_per_rank": 3}},
                              max_epochs=3, accumulate_grad_batches=2)
    ref_params, ref_batches = reference_run(ref_model, 2, [3, 1], 3, accumulate=2)
    assert len(ref_params) == 15 and records[0]["steps"] == 9  # 5 batches an epoch, 3 optimizer steps
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
        taken = records[0]["indices"][step] + records[1]["indices"][step]
        assert sorted(taken) == sorted(ref_batches[step])
        assert max_rel_diff(records[0]["params"][step], expected) <= 1e-6
    # Shares are not capped at 3: the rank runs 9 samples a step as micro-batches.
    assert [len(records[0]["indices"][s]) for s in range(4)] == [9, 9, 9, 9]
    # The logged loss is the global batch's mean loss under the parameters the step started from.
    probe = copy.deepcopy(ref_model)
    dataset = probe.train_dataloader().dataset
    for step, logged in enumerate(records[0]["logged"]):
        start = initial if step == 0 else ref_params[step - 1]
        torch.nn.utils.vector_to_parameters(start, probe.parameters())
        idx = torch.tensor(ref_batches[step])
        with torch.no_grad():
            assert logged == pytest.approx(float(probe.loss((dataset.x[idx], dataset.y[idx], idx))), rel=1e-5)


class _Manual(TinyModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        opt.step()


@pytest.mark.slow
def test_manual_optimization_is_refused(tmp_path):
    with pytest.raises(Exception, match="micro_batch.*automatic optimization"):
        fit_distributed(_Manual(), str(tmp_path), 2, {"capacities": [3, 1], "data": {"micro_batch": 2}}, max_epochs=1)
