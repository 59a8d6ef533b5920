"""BatchNorm under uneven shares: the synced layer against torch's BatchNorm on the concatenated batch, both strategies
with ``Trainer(sync_batchnorm=True)`` against one process (parameters and running statistics), and without sync the
one-time warning and the 2-sample minimum share that keeps BatchNorm from a 1-sample batch."""

import copy
import multiprocessing
import os
import traceback
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from lightning.pytorch import seed_everything
from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy
from lightning_hetero._compat import BatchNormXd
from lightning_hetero.grad.batchnorm import SyncedBatchNorm, SyncedBatchNormPlugin, sync_for_strategy
from lightning_hetero.plan.shares import ShareSchedule
from lightning_hetero.plan.split import split_batch
from tests.helpers import IndexedDataset, TinyModel, fit_distributed, free_port, max_rel_diff, reference_run

TOLERANCE = 2e-5


# -- the layer against torch's BatchNorm on the concatenated batch --------------------------------------------------
# (shape after N and C, BatchNorm class, constructor arguments)
LAYERS = [
    ((), nn.BatchNorm1d, {}),
    ((5,), nn.BatchNorm1d, {"momentum": None}),
    ((4, 3), nn.BatchNorm2d, {"affine": False}),
    ((2, 3, 2), nn.BatchNorm3d, {"track_running_stats": False}),
]


def _largest(difference: torch.Tensor) -> float:
    return float(difference.abs().max()) if difference.numel() else 0.0


def _layer_worker(rank: int, counts: list[int], port: int, hook_weighted: bool, out: Any,
                  checkpointed: bool = False) -> None:
    """Rank ``rank`` of ``len(counts)``: each layer of LAYERS synced, on its slice of one batch, against torch's layer
    on the whole batch. The loss is each sample's output times a fixed random tensor, as a mean over the batch.
    ``hook_weighted``: rank r's loss is scaled by b_r/G and the gradients summed (the weighting comm hook); otherwise
    its loss is scaled by b_r·W/G and the gradients averaged (DDP's all-reduce). ``checkpointed``: even ranks run the
    layer under activation checkpointing (rank 0 non-reentrant, rank 2 reentrant), so it is recomputed in their
    backward while the other ranks keep its activations."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        world = len(counts)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        total, start = sum(counts), sum(counts[:rank])
        mine = slice(start, start + counts[rank])
        errors: dict[str, float] = {}
        for tail, cls, kwargs in LAYERS:
            torch.manual_seed(0)
            x = torch.randn(total, 3, *tail) * 3 + 5
            probe = torch.randn(total, 3, *tail)
            reference = cls(3, **kwargs)
            if reference.affine:
                nn.init.uniform_(reference.weight)
                nn.init.normal_(reference.bias)
            layer = copy.deepcopy(reference)
            model = nn.Sequential(layer)
            plugin = SyncedBatchNormPlugin()
            plugin.apply(model)
            name = f"{cls.__name__}{tail}{kwargs}"
            share = counts[rank] / total
            # What makes the ranks' gradients one device's: averaged over W (DDP), or summed (the weighting hook).
            factor = 1.0 if hook_weighted else 1 / world
            for step in range(2):  # two steps: the running statistics and the cumulative momentum move twice
                x_ref = x.clone().requires_grad_()
                y_ref = reference(x_ref)
                ((y_ref * probe).sum() / total).backward()
                x_mine = x[mine].clone().requires_grad_()
                with plugin.sync.step(padding=counts[rank] == 0):
                    if checkpointed and rank % 2 == 0:
                        y = torch.utils.checkpoint.checkpoint(layer, x_mine, use_reentrant=rank == 2)
                    else:
                        y = layer(x_mine)
                mean_loss = (y * probe[mine]).sum() / max(counts[rank], 1)
                (mean_loss * share * (1 if hook_weighted else world)).backward()
                errors[f"{name} step {step} forward"] = _largest(y - y_ref[mine])
                errors[f"{name} step {step} input grad"] = _largest(
                    x_mine.grad * factor - x_ref.grad[mine])
                if layer.affine:
                    for p, q in ((layer.weight, reference.weight), (layer.bias, reference.bias)):
                        grad = p.grad * factor
                        dist.all_reduce(grad)
                        errors[f"{name} step {step} param grad"] = float((grad - q.grad).abs().max())
                        p.grad = None
                        q.grad = None
                if layer.track_running_stats:
                    for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                        errors[f"{name} step {step} {buffer}"] = float(
                            (getattr(layer, buffer) - getattr(reference, buffer)).abs().max())
            # Evaluation: the running statistics, no collective (only rank 0 evaluates here).
            if rank == 0:
                layer.eval()
                reference.eval()
                with torch.no_grad():
                    errors[f"{name} eval"] = float((layer(x) - reference(x)).abs().max())
        out.put((rank, errors))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_layers(counts: list[int], hook_weighted: bool, checkpointed: bool = False) -> dict[str, float]:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    port = free_port()
    processes = [context.Process(target=_layer_worker, args=(r, counts, port, hook_weighted, out, checkpointed))
                 for r in range(len(counts))]
    for p in processes:
        p.start()
    results = dict(out.get(timeout=120) for _ in processes)
    for p in processes:
        p.join(timeout=30)
    errors: dict[str, float] = {}
    for rank, result in sorted(results.items()):
        assert isinstance(result, dict), result
        errors.update({f"rank {rank} {k}": v for k, v in result.items()})
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("hook_weighted", [False, True], ids=["weighted-loss", "weighted-hook"])
@pytest.mark.parametrize("counts", [[6, 2], [5, 2, 1], [3, 0, 2]], ids=str)
def test_synced_layer_equals_batchnorm_on_the_whole_batch(counts, hook_weighted):
    """Forward, input gradient, weight and bias gradients, running statistics: 1-D over (N, C) and (N, C, L), 2-D,
    3-D, momentum None, no affine, no running statistics; a rank with 0 samples (a padding step) changes nothing."""
    errors = _run_layers(counts, hook_weighted)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])
    assert any("running_var" in k for k in errors) and any("param grad" in k for k in errors)


@pytest.mark.slow
@pytest.mark.parametrize("counts", [[6, 2], [5, 2, 1]], ids=str)
def test_a_recomputed_synced_layer_equals_batchnorm_on_the_whole_batch(counts):
    """Activation checkpointing recomputes the layer in the backward, outside the step's sync: it ran as a plain
    BatchNorm there (CheckpointError, a second running-statistics update). Only some ranks recompute, so the
    recomputation must not communicate."""
    errors = _run_layers(counts, hook_weighted=False, checkpointed=True)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])


def test_a_single_sample_over_all_ranks_fails_like_one_device():
    """One sample in all: one device raises, so does every rank (the count is the global one: no rank hangs)."""
    layer = nn.BatchNorm1d(3)
    plugin = SyncedBatchNormPlugin()
    plugin.apply(nn.Sequential(layer))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        layer(torch.randn(1, 3))  # outside a step: torch's own check
    assert isinstance(layer, SyncedBatchNorm)


def test_apply_and_revert_keep_the_same_parameters_and_state_dict():
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(16),
                          nn.SyncBatchNorm(16))
    weight, running_mean = model[1].weight, model[1].running_mean
    keys = list(model.state_dict())
    plugin = SyncedBatchNormPlugin()
    assert plugin.apply(model) is model
    assert [type(m) for m in model if isinstance(m, SyncedBatchNorm)] == [SyncedBatchNorm] * 3
    assert model[1].weight is weight and model[1].running_mean is running_mean
    assert list(model.state_dict()) == keys
    plugin.revert(model)
    assert [type(m) for m in model][1:] == [nn.BatchNorm2d, nn.Flatten, nn.BatchNorm1d, BatchNormXd]
    assert model[1].weight is weight and not hasattr(model[1], "sync")
    assert list(model.state_dict()) == keys


# -- what the strategy chooses --------------------------------------------------------------------------------------
def test_the_strategy_swaps_torchs_sync_batchnorm_for_the_synced_layer():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin, least = sync_for_strategy(TorchSyncBatchNorm(), model, world_size=2, uneven=True, refusal=None)
    assert isinstance(plugin, SyncedBatchNormPlugin) and least == 1
    with pytest.raises(ValueError, match="sync_batchnorm=True.*micro_batch"):
        sync_for_strategy(TorchSyncBatchNorm(), model, world_size=2, uneven=True, refusal="`data.micro_batch` ...")


def test_without_sync_the_strategy_warns_once_and_asks_for_two_samples_per_rank():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.warns(UserWarning, match=r"BatchNorm layer.*sync_batchnorm=True") as record:
        plugin, least = sync_for_strategy(None, model, world_size=2, uneven=True, refusal=None)
    assert plugin is None and least == 2 and len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sync_for_strategy(None, nn.Linear(2, 2), world_size=2, uneven=True, refusal=None) == (None, 1)
        assert sync_for_strategy(None, model, world_size=1, uneven=False, refusal=None) == (None, 1)


def test_the_split_keeps_every_share_at_two_or_gives_a_padding_step():
    assert split_batch(8, [3, 1], minimum=2) == [6, 2]
    assert split_batch(16, [10, 1], minimum=2) == [14, 2]  # [15, 1] with one sample allowed
    assert split_batch(16, [10, 1]) == [15, 1]
    assert split_batch(5, [3, 1], minimum=2) == [3, 2]
    # The last global batch too small for 2 each: 2 (or 3) to the fastest ranks, 0 (a padding step) to the others.
    assert split_batch(2, [5, 2, 1], minimum=2) == [2, 0, 0]
    assert split_batch(5, [5, 2, 1], minimum=2) == [3, 2, 0]
    assert split_batch(1, [5, 2, 1], minimum=2) == [1, 0, 0]  # one device cannot train BatchNorm on it either
    for total in range(0, 30):
        for weights in ([3, 1], [5, 2, 1], [1, 10, 1, 1]):
            shares = split_batch(total, weights, minimum=2)
            assert sum(shares) == total and all(s == 0 or s >= min(2, total) for s in shares), (total, weights)
    assert split_batch(8, [3, 1], caps=[7, 2], minimum=2) == [6, 2]
    with pytest.raises(ValueError, match="at least 2"):
        split_batch(8, [3, 1], caps=[7, 1], minimum=2)


def test_a_schedule_too_small_for_two_samples_per_rank_names_the_way_out():
    schedule = ShareSchedule(5, [3, 1, 1])
    with pytest.raises(ValueError, match="sync_batchnorm=True"):
        schedule.set_min_share(2)


# -- both strategies against one process ---------------------------------------------------------------------------
class BatchNormModel(TinyModel):
    """BatchNorm over (N, C, L), 2-D with a cumulative average, and over (N, C) without affine parameters."""

    def __init__(self, optimizer: str = "sgd", n: int = 53) -> None:
        super().__init__(optimizer, n=n, batch_size=4)
        self.net = nn.Sequential(
            nn.Conv1d(2, 4, 1), nn.BatchNorm1d(4), nn.Tanh(), nn.Unflatten(2, (2, 2)), nn.BatchNorm2d(4, momentum=None),
            nn.Flatten(), nn.Linear(16, 16), nn.BatchNorm1d(16, affine=False), nn.Tanh(), nn.Linear(16, 4))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        x, y = x.to(self.device), y.to(self.device)
        return nn.functional.cross_entropy(self.net(x.view(len(x), 2, 4)), y)


def fit_against_one_process(tmp_path: Any, strategy_class: type, capacities: list[int], sync: bool,
                            strategy_kwargs: Any = None, **trainer_kwargs: Any) -> tuple[float, float]:
    """(largest relative parameter difference over all steps, largest buffer difference at the end) of a fit
    against one process on the same global batches; every rank's buffers are compared."""
    n, epochs = (50 if len(capacities) == 3 else 53), 2
    seed_everything(0)
    model = BatchNormModel(n=n)
    reference = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), len(capacities),
                              {"capacities": capacities, **(strategy_kwargs or {})}, max_epochs=epochs,
                              strategy_class=strategy_class, sync_batchnorm=sync, **trainer_kwargs)
    ref_params, _ = reference_run(reference, len(capacities), capacities, epochs)
    assert {r["steps"] for r in records} == {len(ref_params)}
    params = max(max_rel_diff(records[0]["params"][s], expected) for s, expected in enumerate(ref_params))
    buffers = max(float((r["buffers"][name].double() - b.double()).abs().max())
                  for r in records for name, b in reference.named_buffers())
    assert set(records[0]["buffers"]) == {name for name, _ in reference.named_buffers()}
    return params, buffers


STRATEGIES = [HeteroDDPStrategy, HeteroFSDPStrategy]


@pytest.mark.slow
@pytest.mark.parametrize("capacities", [[3, 1], [5, 2, 1]], ids=str)
@pytest.mark.parametrize("strategy_class", STRATEGIES, ids=lambda c: c.__name__)
def test_sync_batchnorm_equals_one_process(tmp_path, strategy_class, capacities):
    """[3, 1] leaves one rank a single sample of the last global batch; [5, 2, 1] (50 samples) a padding step."""
    params, buffers = fit_against_one_process(tmp_path, strategy_class, capacities, sync=True)
    print(f"{strategy_class.__name__} {capacities}: params {params:.2e}, buffers {buffers:.2e}")
    assert params <= TOLERANCE and buffers <= TOLERANCE


@pytest.mark.slow
def test_sync_batchnorm_is_exact_with_a_comm_hook_weighting(tmp_path):
    """Under a comm hook each micro-step's loss carries b_r/G and the hook sums: exact with synced statistics too."""
    params, buffers = fit_against_one_process(tmp_path, HeteroDDPStrategy, [5, 2, 1], sync=True,
                                              strategy_kwargs={"ddp_comm_hook": default_hooks.allreduce_hook})
    assert params <= TOLERANCE and buffers <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("strategy_class", STRATEGIES, ids=lambda c: c.__name__)
def test_without_sync_batchnorm_trains_but_is_not_one_process(tmp_path, strategy_class):
    """Per-rank statistics: far from one process (the check above can fail). [5, 2, 1] at 50 samples would give two
    ranks one sample each of the last global batch; the 2-sample minimum gives one rank 2 and the others a padding
    step of 2 samples, so BatchNorm never sees a single sample."""
    params, buffers = fit_against_one_process(tmp_path, strategy_class, [5, 2, 1], sync=False)
    assert params > 1e-2 and buffers > 1e-2


# -- a user's BatchNorm subclass ------------------------------------------------------------------------------------
class ScaledNorm(nn.BatchNorm2d):
    """A user's BatchNorm with a method and a forward of its own that goes through BatchNorm's."""

    def scale(self) -> float:
        return 2.0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * self.scale()


def test_a_user_subclass_keeps_its_class_and_forward_while_synced():
    """It became a plain SyncedBatchNorm while synced: its own methods and forward were gone."""
    model = nn.Sequential(ScaledNorm(3), nn.BatchNorm1d(2))
    plugin = SyncedBatchNormPlugin()
    with pytest.warns(UserWarning, match=r"ScaledNorm.*own `forward`.*super\(\)\.forward"):
        plugin.apply(model)
    layer = model[0]
    assert isinstance(layer, ScaledNorm) and isinstance(layer, SyncedBatchNorm) and layer.scale() == 2.0
    assert type(model[1]) is SyncedBatchNorm
    x = torch.randn(4, 3, 2, 2)
    expected = nn.functional.batch_norm(x, None, None, training=True) * 2  # one process: the user's forward
    assert torch.allclose(layer(x), expected, atol=1e-6)
    with pytest.raises(ValueError, match="expected 4D input"):  # BatchNorm2d's own input check is kept
        layer(torch.randn(4, 3))
    plugin.revert(model)
    assert type(model[0]) is ScaledNorm and type(model[1]) is nn.BatchNorm1d
    # The same class on the next apply, and no second warning for it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.apply(model)
    assert type(model[0]) is type(layer)


# -- activation checkpointing's recomputation -----------------------------------------------------------------------
class BlockNormModel(TinyModel):
    """Two blocks holding BatchNorm (FSDP recomputes a block under the memory rule "checkpoint")."""

    def __init__(self, n: int = 53) -> None:
        super().__init__(n=n, batch_size=4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(2)])
        self.net = None

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        x, y = x.to(self.device), y.to(self.device)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(x[:, :4], y)


@pytest.mark.slow
@pytest.mark.parametrize("memory", [{"rank:0": "checkpoint", "*": "keep"}, {"*": "checkpoint"}], ids=["rank0", "all"])
def test_sync_batchnorm_is_exact_when_fsdp_recomputes_blocks(tmp_path, memory):
    """The recomputed forward ran in backward as a plain BatchNorm (CheckpointError "Recomputed values ... different
    metadata"), and running statistics would have updated twice. Rank 0 recomputing while rank 1 keeps its blocks:
    the recomputation must not communicate."""
    seed_everything(0)
    model = BlockNormModel()
    reference = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], "memory": memory}, max_epochs=1,
                              strategy_class=HeteroFSDPStrategy, sync_batchnorm=True)
    ref_params, _ = reference_run(reference, 2, [3, 1], 1)
    params = max(max_rel_diff(records[0]["params"][s], expected) for s, expected in enumerate(ref_params))
    buffers = max(float((r["buffers"][name].double() - b.double()).abs().max())
                  for r in records for name, b in reference.named_buffers())
    assert params <= TOLERANCE and buffers <= TOLERANCE


# -- no 1-sample batch anywhere without sync --------------------------------------------------------------------------
class StreamOf(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = IndexedDataset(n)

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))

    def __len__(self) -> int:
        return len(self.data)


class UnsyncedNormModel(TinyModel):
    def __init__(self, n: int, batch_size: int, stream: bool = False) -> None:
        super().__init__(n=n, batch_size=batch_size)
        self.stream = stream
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

    def train_dataloader(self) -> Any:
        data = StreamOf(self.hparams.n) if self.stream else IndexedDataset(self.hparams.n)
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size)


@pytest.mark.slow
@pytest.mark.parametrize("stream_mode", ["exact", "shard"])
def test_a_streams_padding_step_reads_as_many_samples_as_the_least_share(tmp_path, stream_mode):
    """Exact: 11 samples, G = 8 at [3, 1]: the last global batch of 3 is split [3, 0], so rank 1 pads; the stream
    padded with one sample (map-style with the least share) and BatchNorm died on it. Shard (each rank reads all 11
    here): rank 1 takes 2 a step and its stream's last sample was a step of its own."""
    seed_everything(0)
    records = fit_distributed(UnsyncedNormModel(11, 4, stream=True), str(tmp_path), 2,
                              {"capacities": [3, 1], "data": {"stream_mode": stream_mode}}, max_epochs=1)
    assert {r["steps"] for r in records} == ({2} if stream_mode == "exact" else {5})
    assert min(len(batch) for r in records for batch in r["indices"]) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("sync", [False, True])
def test_profiling_never_times_a_one_sample_batch_of_a_batchnorm_model(tmp_path, sync):
    """G = 6 on 2 ranks: profiling timed half an equal share, 1 sample, in train mode (sync or not: profiling trains
    each rank's batch alone)."""
    seed_everything(0)
    records = fit_distributed(UnsyncedNormModel(24, 3), str(tmp_path), 2, {"capacities": "profile"}, max_epochs=1,
                              sync_batchnorm=sync)
    assert {r["steps"] for r in records} == {4}


@pytest.mark.slow
def test_micro_batches_of_one_sample_are_refused_at_setup_naming_the_option(tmp_path):
    """A share of 3 at `micro_batch=2` ran as [2, 1]: BatchNorm died on the 1-sample micro-batch mid-epoch."""
    seed_everything(0)
    with pytest.raises(Exception, match=r"data\.micro_batch.*at least 3"):
        fit_distributed(UnsyncedNormModel(24, 3), str(tmp_path), 2,
                        {"capacities": [1, 1], "data": {"micro_batch": 2}}, max_epochs=1)
