"""The north star: N ranks with unequal batches train exactly like one process on the global batch."""

import copy
import math

import pytest
import torch
from lightning.pytorch import seed_everything

from tests.helpers import TinyModel, fit_distributed, max_rel_diff, reference_run

# (capacities, dataset length): every case leaves a partial last global batch; with [5, 2, 1] and 50 samples the
# last global batch has 2 samples for 3 ranks, so one rank runs a zero-weight padding step.
CASES = [([1, 1], 53), ([3, 1], 53), ([5, 2, 1], 50), ([10, 1], 53)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(("capacities", "n"), CASES, ids=[str(c) for c, _ in CASES])
def test_unequal_batches_equal_one_process(tmp_path, capacities, n, optimizer):
    world, batch_size = len(capacities), 4
    steps_per_epoch = math.ceil(n / (batch_size * world))
    epochs = math.ceil(20 / steps_per_epoch)
    seed_everything(0)
    model = TinyModel(optimizer, n=n, batch_size=batch_size)
    reference_model = copy.deepcopy(model)
    floor_model = copy.deepcopy(model)

    records = fit_distributed(model, str(tmp_path), world, {"capacities": capacities}, max_epochs=epochs)
    ref_params, ref_batches = reference_run(reference_model, world, capacities, epochs)
    floor_params, _ = reference_run(floor_model, world, capacities, epochs, shuffle_within=True)

    # Same number of optimizer steps everywhere, at least 20.
    assert {r["steps"] for r in records} == {len(ref_params)}
    assert len(ref_params) >= 20

    for step, expected in enumerate(ref_params):
        # Replicas are bit-identical after every step.
        for r in range(1, world):
            assert torch.equal(records[r]["params"][step], records[0]["params"][step]), f"rank {r} step {step}"
        # The ranks' slices of each step put together are the reference's global batch.
        taken = []
        for r in range(world):
            taken += records[r]["indices"][step]
        assert set(taken) == set(ref_batches[step])

    diff = max(max_rel_diff(records[0]["params"][s], ref_params[s]) for s in range(len(ref_params)))
    floor = max(max_rel_diff(floor_params[s], ref_params[s]) for s in range(len(ref_params)))
    print(f"capacities={capacities} {optimizer}: max rel diff {diff:.2e}, reorder floor {floor:.2e}")
    assert diff <= max(1e-6, 2 * floor)


def test_equal_weighting_would_fail_the_check():
    """The tolerance above is meaningful: averaging unequal batches equally (plain DDP) lands far outside it."""
    seed_everything(0)
    model = TinyModel("sgd", n=53)
    wrong_model = copy.deepcopy(model)
    ref_params, _ = reference_run(model, 2, [3, 1], 3)
    wrong_params, _ = reference_run(wrong_model, 2, [3, 1], 3, equal_rank_weights=True)
    assert max_rel_diff(wrong_params[-1], ref_params[-1]) > 1e-3


def test_gradient_accumulation_equals_one_process(tmp_path):
    """Hooks fire once per optimizer step on the accumulated gradient; the window's weight keeps it exact."""
    seed_everything(0)
    model = TinyModel("sgd", n=64)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=3, accumulate_grad_batches=2)
    ref_params, _ = reference_run(reference_model, 2, [3, 1], 3, accumulate=2)
    assert records[0]["steps"] == 12 and len(ref_params) == 24  # 8 micro-batches an epoch, 4 optimizer steps
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= 1e-6


def test_gradient_accumulation_through_a_comm_hook_equals_one_process(tmp_path):
    """Through the weighting comm hook (here torch's averaging `allreduce_hook`) each micro-step's loss carries its
    own weight: 61 samples end each epoch in a window of a full batch (split 6/2) and a batch of 5 (4/1)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    seed_everything(0)
    model = TinyModel("sgd", n=61)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1],
                                                        "ddp_comm_hook": default_hooks.allreduce_hook},
                              max_epochs=3, accumulate_grad_batches=2)
    ref_params, _ = reference_run(reference_model, 2, [3, 1], 3, accumulate=2)
    assert records[0]["steps"] == 12 and len(ref_params) == 24  # 8 micro-batches an epoch, 4 optimizer steps
    for step, expected in enumerate(ref_params):
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
        assert max_rel_diff(records[0]["params"][step], expected) <= 1e-6, step


class _TwoOptimizers(TinyModel):
    """Manual optimization with two optimizers, each stepping after its own backward (the GAN pattern)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def step_losses(self, batch):
        # The second loss is read after the first optimizer stepped, as Lightning runs it.
        yield self.loss(batch)
        yield self.loss(batch) * 2

    def training_step(self, batch, batch_idx):
        for optimizer, loss in zip(self.optimizers(), self.step_losses(batch)):
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1))


@pytest.mark.slow
@pytest.mark.parametrize("route", ["loss", "comm hook"])
def test_manual_optimization_with_two_optimizers_equals_one_process(tmp_path, route):
    """Every backward of a batch carries the batch's weight, also the one after the first optimizer step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from tests.helpers import IndexedDataset, flat_params

    seed_everything(0)
    model = _TwoOptimizers(n=40)
    reference = copy.deepcopy(model)
    hook = {"ddp_comm_hook": default_hooks.allreduce_hook} if route == "comm hook" else {}
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], **hook}, max_epochs=1)

    dataset = IndexedDataset(40)
    optimizers = reference.configure_optimizers()
    for step in range(len(records[0]["indices"])):
        idx = torch.tensor(records[0]["indices"][step] + records[1]["indices"][step])
        for optimizer, loss in zip(optimizers, reference.step_losses((dataset.x[idx], dataset.y[idx], idx))):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert torch.equal(records[0]["params"][step], records[1]["params"][step])
        assert max_rel_diff(records[0]["params"][step], flat_params(reference)) <= 1e-6, step
