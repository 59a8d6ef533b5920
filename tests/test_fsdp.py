"""HeteroFSDPStrategy: sharded training over unequal ranks, with the math of one process on the global batch."""

import pytest
import torch

from lightning_hetero.resilience.sharded import export_full_checkpoint, is_sharded_checkpoint
from tests._fsdp_worker import make_model, reference, run_ranks, train_sharded
from tests.helpers import free_port

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
