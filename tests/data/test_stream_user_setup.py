"""A user's stream, end to end: Lightning's demo Transformer trained from a plain ``IterableDataset`` (no sharding of
its own, default exact stream mode) at unequal capacities equals one process replaying each step's global batch."""

import copy
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from lightning.pytorch.demos import Transformer
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

from lightning_hetero.plan.split import split_batch
from tests.helpers import fit_distributed

VOCAB, TOKENS, SAMPLES = 40, 12, 165
TOLERANCE = 2e-5


def token_pairs(n: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of TOKENS inputs and their next-token targets, fixed (seeded) once."""
    tokens = torch.randint(0, VOCAB, (n, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


class TokenStream(IterableDataset):
    """The samples in index order: (inputs, target, index)."""

    def __init__(self, n: int = SAMPLES) -> None:
        self.inputs, self.target = token_pairs(n)

    def __iter__(self):
        return ((self.inputs[i], self.target[i], i) for i in range(len(self.inputs)))


class DemoLanguageModel(LightningModule):
    """``LightningTransformer``'s step on a small demo ``Transformer``; SGD with momentum."""

    def __init__(self, n: int = SAMPLES) -> None:
        super().__init__()
        self.n = n
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)

    def loss(self, batch: Any) -> torch.Tensor:
        inputs, target, _ = batch
        return F.nll_loss(self.model(inputs, target), target.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenStream(self.n), batch_size=8)


def replay(model: DemoLanguageModel, steps: list[list[list[int]]], equal_rank_weights: bool = False
           ) -> list[list[torch.Tensor]]:
    """One process on each step's global batch (the ranks' slices in rank order): parameters per step.
    ``equal_rank_weights`` averages the slices' mean losses instead, as plain DDP would (the wrong answer)."""
    inputs, target = token_pairs(model.n)
    optimizer = model.configure_optimizers()
    params = []
    for slices in steps:
        parts = [torch.tensor(s) for s in slices if s] if equal_rank_weights else [torch.tensor(sum(slices, []))]
        loss = sum(model.loss((inputs[i], target[i], i)) for i in parts) / len(parts)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def per_tensor_rel_diff(flat: torch.Tensor, expected: list[torch.Tensor]) -> float:
    """The largest ‖a - b‖ / ‖b‖ over parameter tensors (small tensors such as attention biases count fully)."""
    worst, offset = 0.0, 0
    for tensor in expected:
        got = flat[offset:offset + tensor.numel()].reshape(tensor.shape)
        offset += tensor.numel()
        worst = max(worst, float((got - tensor).norm() / tensor.norm().clamp_min(1e-30)))
    return worst


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("capacities", [[3, 1], [5, 2, 1], [7, 1]], ids=["[3,1]", "[5,2,1]", "[7,1]"])
def test_demo_transformer_on_a_plain_stream_equals_one_process(tmp_path, deterministic, capacities):
    seed_everything(0)
    model = DemoLanguageModel()
    reference = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), len(capacities), {"capacities": capacities}, max_epochs=1)
    world = len(capacities)
    steps = len(records[0]["indices"])
    assert steps == -(-SAMPLES // (8 * world))
    assert sorted(i for r in records for b in r["indices"] for i in b) == list(range(SAMPLES))  # each once
    expected = replay(reference, [[r["indices"][s] for r in records] for s in range(steps)])
    diffs = [per_tensor_rel_diff(records[0]["params"][s], expected[s]) for s in range(steps)]
    print(f"{capacities}: per step " + " ".join(f"{d:.1e}" for d in diffs))
    for r in records[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], records[0]["params"]))
    assert max(diffs) <= TOLERANCE, diffs


def test_plain_ddp_weighting_would_fail_the_check(deterministic):
    """The tolerance is meaningful: the same slices at [3, 1] averaged per rank (plain DDP) land far outside it."""
    seed_everything(0)
    model = DemoLanguageModel()
    wrong = copy.deepcopy(model)
    steps = []
    for start in range(0, SAMPLES, 16):
        batch = list(range(start, min(start + 16, SAMPLES)))
        cut = split_batch(len(batch), [3, 1])[0]
        steps.append([batch[:cut], batch[cut:]])
    expected, got = replay(model, steps), replay(wrong, steps, equal_rank_weights=True)
    flat = torch.cat([p.reshape(-1) for p in got[-1]])
    assert per_tensor_rel_diff(flat, expected[-1]) > 100 * TOLERANCE
