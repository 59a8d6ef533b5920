"""The hybrid layout with models and callbacks as users write them: each either trains as one process would (its
logged values included) or is refused with one line naming the cause and the fix."""

import copy
import os
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn

from lightning_hetero import HeteroDDPStrategy
from tests.helpers import IndexedDataset, free_port, max_rel_diff, reference_run
from tests.strategies.test_hybrid import Chain, _flat, fit, hybrid

WORLD, PIPELINES, CAPACITIES = 4, [[2, 3]], [2, 2, 1, 1]


class TiedAcrossStages(Chain):
    """Chain whose last layer shares its weight with a layer of the first stage (an embedding and its output head)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(classes=16, **kwargs)
        self.net[6].weight = self.net[2].weight


class CalledTwice(Chain):
    """Chain whose second layer runs twice, once in each stage of a ``split_points=["net.4"]`` pipeline."""

    def forward(self, x):
        net = self.net
        h = torch.tanh(net[2](torch.tanh(net[0](x))))
        return net[6](torch.tanh(net[2](torch.tanh(net[4](h)))))


@pytest.mark.slow
@pytest.mark.parametrize(("model_class", "named"), [
    (TiedAcrossStages, r"net\.2\.weight.*net\.6\.weight.*(untie|split_points)"),
    (CalledTwice, r"net\.2\.weight.*more than one stage"),
], ids=["tied across stages", "called in two stages"])
def test_a_parameter_two_stages_use_is_refused_by_name(tmp_path, model_class, named):
    seed_everything(0)
    with pytest.raises(Exception, match=named):
        fit(model_class(n=24), str(tmp_path), WORLD, hybrid(PIPELINES, CAPACITIES, split_points=["net.4"],
                                                             resilience={"timeout": 30}), 1, max_steps=1)


class Normalized(Chain):
    """Chain with a BatchNorm layer (per-rank statistics: no ``sync_batchnorm``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net[3] = nn.BatchNorm1d(16)


class MicroBatchSizes(Callback):
    def __init__(self):
        self.smallest = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        replica = trainer.strategy.replica
        if replica is not None:
            size = getattr(replica, "last_micro_batch", 0)
            self.smallest = size if self.smallest is None else min(self.smallest, size)

    def on_train_end(self, trainer, pl_module):
        if trainer.strategy.replica is not None:
            assert self.smallest >= 2, self.smallest


@pytest.mark.slow
def test_batchnorm_keeps_two_samples_per_micro_batch_at_a_short_last_batch(tmp_path):
    """21 samples, 16 a step: the last global batch of 5 splits 2, 2, 1, 1, the pipeline's 2 in one micro-batch."""
    seed_everything(0)
    records = fit(Normalized(n=21), str(tmp_path), WORLD, hybrid(PIPELINES, CAPACITIES, resilience={"timeout": 60}),
                  1, callbacks=[MicroBatchSizes()], default_root_dir=str(tmp_path))
    assert all(record["steps"] == 2 for record in records)


class Final(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def teardown(self, trainer, pl_module, stage):
        torch.save(_flat({n: p.detach().clone() for n, p in pl_module.named_parameters()}),
                   os.path.join(self.out_dir, f"final{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_ema_weight_averaging_ends_as_under_the_ddp_strategy(tmp_path):
    """Lightning's EMAWeightAveraging copies its average in at the end of training on every rank, stage ranks
    included, and ends with the averaged parameters the data-parallel strategy (exact) gives."""
    finals = {}
    for name in ("hybrid", "ddp"):
        seed_everything(0)
        out = tmp_path / name
        out.mkdir()
        os.environ["MASTER_PORT"] = str(free_port())
        strategy = (hybrid(PIPELINES, CAPACITIES) if name == "hybrid" else HeteroDDPStrategy(
            capacities=CAPACITIES, start_method="fork", observation={"print_table": False}))
        trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=False,
                          callbacks=[EMAWeightAveraging(decay=0.5), Final(str(out))], enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Chain(n=40))
        finals[name] = [torch.load(out / f"final{r}.pt") for r in range(WORLD)]
    for r in range(WORLD):
        assert max_rel_diff(finals["hybrid"][r], finals["ddp"][0]) <= 2e-5, r


class Manual(Chain):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


@pytest.mark.slow
def test_manual_optimization_is_refused_at_set_up(tmp_path):
    seed_everything(0)
    refusal = r"HeteroHybridStrategy: manual optimization \(`automatic_optimization = False`\).*hetero_ddp"
    with pytest.raises(Exception, match=refusal):
        fit(Manual(n=24), str(tmp_path), WORLD, hybrid(PIPELINES, CAPACITIES, resilience={"timeout": 30}), 1,
            max_steps=1)


def _norm(tensors):
    return float(torch.cat([t.reshape(-1) for t in tensors]).norm())


class LogsNorms(Chain):
    """Logs the norm of its weights in ``training_step`` and of its gradients in ``on_before_optimizer_step``."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        self.log("weight_norm", torch.cat([p.detach().reshape(-1) for p in self.parameters()]).norm(),
                 sync_dist=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.reshape(-1) for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.cat(grads).norm(), sync_dist=True)


class Logged(Callback):
    def __init__(self, out_dir):
        self.out_dir, self.values = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append({k: float(trainer.callback_metrics[k]) for k in ("weight_norm", "grad_norm")})

    def on_train_end(self, trainer, pl_module):
        torch.save(self.values, os.path.join(self.out_dir, f"logged{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_synced_weight_and_gradient_norms_are_one_process_values(tmp_path):
    n = 40
    seed_everything(0)
    model = LogsNorms(n=n, optimizer="sgd")
    probe = copy.deepcopy(model)
    ref_params, ref_batches = reference_run(copy.deepcopy(model), WORLD, CAPACITIES, 1)
    fit(model, str(tmp_path), WORLD, hybrid(PIPELINES, CAPACITIES), 1, callbacks=[Logged(str(tmp_path))],
        default_root_dir=str(tmp_path))
    dataset = IndexedDataset(n)
    start = nn.utils.parameters_to_vector(probe.parameters()).detach().clone()
    for step, batch in enumerate(ref_batches):
        nn.utils.vector_to_parameters(start if step == 0 else ref_params[step - 1], probe.parameters())
        probe.zero_grad()
        idx = torch.tensor(batch)
        probe.loss((dataset.x[idx], dataset.y[idx], idx)).backward()
        expected = {"weight_norm": _norm([p.detach() for p in probe.parameters()]),
                    "grad_norm": _norm([p.grad for p in probe.parameters()])}
        for r in range(WORLD):
            logged = torch.load(tmp_path / f"logged{r}.pt")[step]
            for key, value in expected.items():
                assert abs(logged[key] - value) <= 1e-5 * value, (r, step, key, logged[key], value)


class Evaluated(Chain):
    def val_dataloader(self):
        from torch.utils.data import DataLoader
        return DataLoader(IndexedDataset(12, seed=1), batch_size=4)

    test_dataloader = val_dataloader

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)


class Warnings(Callback):
    """Rank 0's warnings from its set-up on (a forked rank's warnings reach no test's capture), saved at teardown."""

    def __init__(self, out_dir):
        self.out_dir, self.catcher, self.caught = out_dir, None, []

    def setup(self, trainer, pl_module, stage):
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")

    def teardown(self, trainer, pl_module, stage):
        self.catcher.__exit__(None, None, None)
        if trainer.global_rank == 0:
            torch.save([str(w.message) for w in self.caught], os.path.join(self.out_dir, "warnings.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["validate", "test"])
def test_standalone_evaluation_warns_of_no_replicated_samples(tmp_path, stage):
    """Lightning's warning that a DistributedSampler replicates samples is false here (each sample once)."""
    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=hybrid(PIPELINES, CAPACITIES), logger=False,
                      callbacks=[Warnings(str(tmp_path))], enable_progress_bar=False, enable_model_summary=False)
    getattr(trainer, stage)(Evaluated(n=24))
    caught = torch.load(tmp_path / "warnings.pt")
    assert caught and not [w for w in caught if "replicates some samples" in w]
