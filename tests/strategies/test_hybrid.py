"""The hybrid layout's contract: data-parallel ranks beside a pipelined replica end with the parameters of one
process on the same global batches (tests/test_equivalence.py under this layout)."""

import copy
import math
import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_hetero.strategies.hybrid import HeteroHybridStrategy
from tests.helpers import IndexedDataset, TinyModel, free_port, max_rel_diff, reference_run, retry_timing


class Chain(TinyModel):
    """TinyModel with its forward called the common way (``self(x)``) and four blocks to split."""

    def __init__(self, width: int = 16, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(self.hparams.features, width), nn.Tanh(), nn.Linear(width, width),
                                 nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, self.hparams.classes))

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y, _ = batch
        return nn.functional.cross_entropy(self(x), y)


class NamedRecorder(Callback):
    """Per rank: named parameters after every optimizer step, the indices trained on, the logged loss."""

    def __init__(self, out_dir):
        self.out_dir, self.params, self.indices, self.logged = out_dir, [], [], []
        self.held, self.state, self.start_held = [], [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
        self.indices.append([int(i) for i in batch[2]])
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.held.append(held_bytes(pl_module))
        self.state.append(state_bytes(trainer.optimizers))

    def on_train_start(self, trainer, pl_module):
        self.start_held = held_bytes(pl_module)

    def teardown(self, trainer, pl_module, stage):
        # After the strategy's `on_train_end` (which Lightning runs after the callbacks'): a stage rank holds the
        # whole trained model from then on.
        strategy = trainer.strategy
        owned = None
        if getattr(strategy, "replica", None) is not None:
            owned = strategy.replica.partition[strategy.replica.stage]
        profile = strategy.core.profiler.profile if hasattr(strategy, "core") else None
        torch.save({"pipelines": getattr(strategy, "pipelines", None),
                    "micro_batches": None if profile is None else profile.extra.get("micro_batches"),
                    "replica_micro_batches": getattr(getattr(strategy, "replica", None), "micro_batches", None),
                    "replica_rates": None if profile is None else profile.extra.get("replica_rates"),
                    "params": self.params, "indices": self.indices, "logged": self.logged, "owned": owned,
                    "held": self.held, "state": self.state, "start_held": self.start_held, "bytes": {n: p.numel() * p.element_size() for n, p in
                                                 pl_module.named_parameters()},
                    "steps": trainer.global_step, "final": {n: p.detach().clone() for n, p in
                                                           pl_module.named_parameters()}},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def held_bytes(module):
    """Bytes of the storage the module's parameters hold (each storage once): what the rank keeps of the model."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


def state_bytes(optimizers):
    """Bytes of optimizer state tensors (moments, momentum buffers; not Adam's step count)."""
    return sum(v.numel() * v.element_size() for opt in optimizers for state in opt.state.values()
               for k, v in state.items() if torch.is_tensor(v) and k != "step")


def _flat(named):
    return torch.cat([t.reshape(-1) for t in named.values()])


def fit(model, out_dir, world, strategy, epochs, callbacks=(), ckpt_path=None, **trainer_kwargs):
    """``model`` over ``world`` forked CPU ranks under ``strategy``; each rank's :class:`NamedRecorder` record."""
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
                      callbacks=[NamedRecorder(out_dir), *callbacks], logger=False,
                      enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def hybrid(pipelines, capacities, resilience=None, **kwargs):
    os.environ["MASTER_PORT"] = str(free_port())
    # Every equivalence case runs the overlapped exchange (opt-in); the late one, the default, where a test says so.
    kwargs.setdefault("overlap_stage_exchange", True)
    return HeteroHybridStrategy(pipelines=pipelines, capacities=capacities, start_method="fork",
                                observation={"print_table": False}, resilience=resilience or {"timeout": 120},
                                **kwargs)


def run_hybrid(tmp_path, model, world, pipelines, capacities, epochs, **kwargs):
    return fit(model, str(tmp_path), world, hybrid(pipelines, capacities, **kwargs), epochs)


CASES = [  # (world, pipelines, capacities, optimizer)
    (3, [[1, 2]], [2, 1, 1], "sgd"),
    (3, [[1, 2]], [1, 2, 1], "adamw"),
    (4, [[2, 3]], [3, 2, 1, 1], "sgd"),
    (4, [[2, 3]], [1, 1, 2, 1], "adamw"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "pipelines", "capacities", "optimizer"), CASES,
                         ids=[f"{w}ranks-{c}-{o}" for w, _, c, o in CASES])
def test_hybrid_equals_one_process(tmp_path, world, pipelines, capacities, optimizer):
    n, batch_size = 53, 4
    epochs = 2
    seed_everything(0)
    model = Chain(optimizer=optimizer, n=n, batch_size=batch_size)
    reference = copy.deepcopy(model)
    records = run_hybrid(tmp_path, model, world, pipelines, capacities, epochs)
    ref_params, ref_batches = reference_run(reference, world, capacities, epochs)

    staged = {r for p in pipelines for r in p}
    dp = [r for r in range(world) if r not in staged]
    assert {rec["steps"] for rec in records} == {len(ref_params)}
    names = list(records[dp[0]]["params"][0])
    diff = 0.0
    for step, expected in enumerate(ref_params):
        for r in dp[1:]:  # data-parallel replicas are bit-identical
            assert torch.equal(_flat(records[r]["params"][step]), _flat(records[dp[0]]["params"][step]))
        for r in staged:  # a stage rank's own parameters equal the data-parallel copies, bit for bit
            for name in records[r]["owned"]:
                assert torch.equal(records[r]["params"][step][name], records[dp[0]]["params"][step][name]), name
        for r in staged:  # a stage rank holds its stage's parameters alone (the others: 1-element placeholders)
            own = sum(records[r]["bytes"][name] for name in records[r]["owned"])
            assert own <= records[r]["held"][step] <= own + 4 * len(names), (r, step)
            assert records[r]["state"][step] == (2 if optimizer == "adamw" else 1) * own, (r, step)
            assert records[r]["start_held"] <= 4 * len(names)  # before the first split: the model in host memory
        for r in dp:
            assert records[r]["held"][step] == sum(records[r]["bytes"].values())
        taken = sorted(i for r in range(world) for i in records[r]["indices"][step])
        assert set(taken) == set(ref_batches[step])
        diff = max(diff, max_rel_diff(_flat(records[dp[0]]["params"][step]), expected))
    print(f"{world} ranks {capacities} {optimizer}: max rel diff {diff:.2e}")
    # The logged loss is one device's: the mean over the global batch, before the step's update.
    dataset, probe = IndexedDataset(n), copy.deepcopy(model)
    for step in range(1, len(ref_params)):
        nn.utils.vector_to_parameters(ref_params[step - 1], probe.parameters())
        idx = torch.tensor(ref_batches[step])
        expected = float(probe.loss((dataset.x[idx], dataset.y[idx], idx)))
        for r in range(world):
            assert abs(records[r]["logged"][step] - expected) <= 1e-5 * max(1.0, abs(expected)), (r, step)
    assert diff <= 2e-5
    assert names == [n for n, _ in reference.named_parameters()]


class Splits(Callback):
    """Rank 0's record of every training step's per-rank sample counts, as the loaders cut them."""

    def __init__(self, out_dir):
        self.out_dir, self.splits = out_dir, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.splits.append(trainer.strategy.core.loaders.train_sampler.rank_sizes_at(batch_idx))

    def teardown(self, trainer, pl_module, stage):
        if trainer.global_rank == 0:
            torch.save(self.splits, os.path.join(self.out_dir, "splits.pt"))


@pytest.mark.slow
def test_a_pipeline_whose_fair_share_is_below_its_stage_count_trains_on_one_sample(tmp_path):
    """A pipeline is one replica: beside a rank 12x as fast, its fair share of 12 samples is 0.9, so it trains on 1
    (not one per stage rank, 2, which made the pipeline set the step), the other stage rank running a padding
    slice, and training is one device's."""
    world, capacities, n, epochs = 3, [12, 0.5, 0.5], 29, 1
    seed_everything(0)
    model = Chain(optimizer="adamw", n=n)
    reference = copy.deepcopy(model)
    ref_params, _ = reference_run(reference, world, capacities, epochs)
    records = fit(model, str(tmp_path), world, hybrid([[1, 2]], capacities), epochs, callbacks=[Splits(str(tmp_path))],
                  default_root_dir=str(tmp_path))
    splits = torch.load(os.path.join(str(tmp_path), "splits.pt"))
    assert splits == [[11, 1, 0], [11, 1, 0], [4, 1, 0]]  # 29 samples: 12, 12 and the last 5
    assert records[0]["steps"] == len(ref_params) == 3
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    for name in records[2]["owned"]:  # the stage rank of no sample trained its stage as the data-parallel rank did
        assert torch.equal(records[2]["params"][-1][name], records[0]["params"][-1][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("first", ["hybrid", "ddp"])
def test_checkpoint_resumes_on_another_layout(tmp_path, first):
    """Three steps on one layout (the pipelined pair, or the same ranks as data-parallel replicas), a checkpoint,
    then the rest of two epochs on the other: the parameters of one process that never stopped."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hetero import HeteroDDPStrategy

    world, capacities, n, epochs = 3, [2, 1, 1], 53, 2
    seed_everything(0)
    model = Chain(optimizer="adamw", n=n)
    reference = copy.deepcopy(model)
    ref_params, _ = reference_run(reference, world, capacities, epochs)

    def ddp():
        os.environ["MASTER_PORT"] = str(free_port())
        return HeteroDDPStrategy(capacities=capacities, start_method="fork", observation={"print_table": False})

    layouts = {"hybrid": lambda: hybrid([[1, 2]], capacities), "ddp": ddp}
    then = "ddp" if first == "hybrid" else "hybrid"
    saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    (tmp_path / "a").mkdir()
    fit(copy.deepcopy(model), str(tmp_path / "a"), world, layouts[first](), epochs, callbacks=[saver], max_steps=3)
    path = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    (tmp_path / "b").mkdir()
    records = fit(Chain(optimizer="adamw", n=n), str(tmp_path / "b"), world, layouts[then](), epochs,
                  callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "unused"))], ckpt_path=path)
    if then == "hybrid":  # the resumed optimizer state of the other stages is dropped on a stage rank
        for r in (1, 2):
            own = sum(records[r]["bytes"][name] for name in records[r]["owned"])
            assert all(state == 2 * own for state in records[r]["state"])
    assert records[0]["steps"] == len(ref_params)
    final = _flat(records[0]["final"])
    for r in range(1, world):  # every rank ends with the whole trained model (stage ranks after the re-broadcast)
        assert torch.equal(_flat(records[r]["final"]), final)
    assert max_rel_diff(final, ref_params[-1]) <= 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [[0], [1, 2]], ids=["data-parallel rank bf16", "pipeline bf16"])
def test_per_rank_precision(tmp_path, bf16):
    """One rank under bf16 autocast, the others fp32: the same training, within bf16's rounding (compared loosely:
    bf16 keeps 8 bits of mantissa, so a few steps drift ~1e-3 relative); the fp32 copies still agree exactly."""
    world, capacities, n, epochs = 3, [2, 1, 1], 53, 1
    seed_everything(0)
    model = Chain(optimizer="sgd", n=n)
    reference = copy.deepcopy(model)
    ref_params, _ = reference_run(reference, world, capacities, epochs)
    records = run_hybrid(tmp_path, model, world, [[1, 2]], capacities, epochs,
                         precision_policy={**{f"rank:{r}": "bf16-mixed" for r in bf16}, "*": "32-true"})
    final = records[0]["params"][-1]
    diff = max_rel_diff(_flat(final), ref_params[-1])
    print(f"bf16 on ranks {bf16}: rel diff {diff:.2e}")
    assert 0 < diff <= 2e-2  # bf16 changed something, and not much
    for r in (1, 2):
        for name in records[r]["owned"]:
            assert torch.equal(records[r]["params"][-1][name], final[name])


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="`pipelines`"):
        HeteroHybridStrategy(pipelines=[2, 3])
    with pytest.raises(ValueError, match="`stage_compression`"):
        HeteroHybridStrategy(pipelines=[[2, 3]], stage_compression="int8")
    with pytest.raises(ValueError, match="`overlap_stage_exchange`"):
        HeteroHybridStrategy(pipelines=[[2, 3]], overlap_stage_exchange="no")
    # Opt-in until checked on GPUs: by default every stage exchange runs after the backward.
    assert HeteroHybridStrategy(pipelines=[[2, 3]]).overlap_stage_exchange is False
    with pytest.raises(ValueError, match="`pipelined_evaluation`"):
        HeteroHybridStrategy(pipelines=[[2, 3]], pipelined_evaluation=1)
    # Opt-in until checked on GPUs: by default a stage rank gets the whole model for validation.
    assert HeteroHybridStrategy(pipelines=[[2, 3]]).pipelined_evaluation is False
    with pytest.raises(ValueError, match="`schedule`"):
        HeteroHybridStrategy(pipelines=[[2, 3]], schedule="zb")
    with pytest.raises(ValueError, match="`data.micro_batch`"):
        HeteroHybridStrategy(pipelines=[[2, 3]], data={"micro_batch": 4})
    with pytest.raises(ValueError, match="`data.loss_denominator`"):
        HeteroHybridStrategy(pipelines=[[2, 3]], data={"loss_denominator": "tokens"})


@pytest.mark.slow
def test_rank_0_in_a_pipeline_is_refused_at_set_up(tmp_path):
    with pytest.raises(Exception, match="`pipelines`=.*rank 0 is data-parallel"):
        fit(Chain(n=24), str(tmp_path), 3, hybrid([[0, 1]], [1, 1, 1]), 1, max_steps=1)


class Validated(Chain):
    """Chain with a validation loader; records the validation loss each rank logged."""

    def val_dataloader(self):
        from torch.utils.data import DataLoader

        from tests.helpers import IndexedDataset
        return DataLoader(IndexedDataset(12, seed=1), batch_size=4)


@pytest.mark.slow
def test_validation_gives_the_whole_model_then_frees_it(tmp_path):
    """Validation between epochs runs the whole model on a stage rank (its weights re-broadcast); the next training
    step frees the other stages again; training stays exact."""
    world, capacities, n, epochs = 3, [2, 1, 1], 53, 2
    seed_everything(0)
    model = Validated(optimizer="adamw", n=n)
    reference = copy.deepcopy(model)
    ref_params, _ = reference_run(reference, world, capacities, epochs)
    records = run_hybrid(tmp_path, model, world, [[1, 2]], capacities, epochs)
    for r in (1, 2):
        own = sum(records[r]["bytes"][name] for name in records[r]["owned"])
        assert all(own <= held <= own + 64 for held in records[r]["held"])
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    for r in (1, 2):  # after fit, every rank holds the whole trained model
        assert torch.equal(_flat(records[r]["final"]), _flat(records[0]["final"]))


class Wide(Chain):
    """Chain wide enough that compute, not per-step overhead, sets a CPU step's time."""

    def __init__(self, **kwargs) -> None:
        super().__init__(width=1536, **kwargs)


@pytest.mark.slow
def test_profiled_shares_follow_the_pipelines_speed(tmp_path):
    """`capacities="profile"` times each pipeline as one replica: of two pipelines of the same cards (beside
    data-parallel rank 0), the one whose cards are emulated 8-fold slower measures, and so gets a share, several-fold
    smaller (asserted: below 0.6 of the other's, where ignoring the slowdown gives about 1: five ranks on a busy host
    stretch the unslowed compute but not the emulator's pauses, which pulls the ratio up)."""
    def attempt(i: int) -> list[dict]:  # a loaded host's noise can leave one run outside the band: measured again
        seed_everything(0)
        model = Wide(n=256, batch_size=64)
        strategy = hybrid([[1, 2], [3, 4]], "profile", profiling={"steps": 5},
                          emulate=[None, None, None, {"slowdown": 8.0}, {"slowdown": 8.0}])
        (tmp_path / str(i)).mkdir()
        records = fit(model, str(tmp_path / str(i)), 5, strategy, 1, max_steps=1)
        rates = records[0]["replica_rates"]  # rank 0, then the pipelines
        print(f"replica rates: pipeline [1, 2] {rates[1]:.4g}, 8x slower pipeline [3, 4] {rates[2]:.4g}")
        assert rates[2] < 0.6 * rates[1]
        return records

    records = retry_timing(3, attempt)
    assert all(record["steps"] == 1 for record in records)
    # Each pipeline's micro-batch count is its fastest measured one, and trains at it.
    picks = records[0]["micro_batches"]
    assert len(picks) == 2 and set(picks) <= {2, 4, 8}
    assert [records[r]["replica_micro_batches"] for r in range(1, 5)] == [picks[0], picks[0], picks[1], picks[1]]


@pytest.mark.slow
def test_default_capacities_measure_each_replica(tmp_path):
    """Without `capacities` the hybrid layout measures, as the other strategies do ("auto": "profile" when fitting):
    the pipeline is timed as one replica and its share comes from that rate, not from published ones."""
    seed_everything(0)
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = HeteroHybridStrategy(pipelines=[[1, 2]], start_method="fork", profiling={"steps": 2},
                                    observation={"print_table": False}, resilience={"timeout": 120})
    records = fit(Chain(optimizer="sgd", n=48, batch_size=8), str(tmp_path), 3, strategy, 1, max_steps=1)
    rates = records[0]["replica_rates"]
    assert rates is not None and len(rates) == 2 and all(r > 0 for r in rates)  # rank 0, then the pipeline


@pytest.mark.slow
def test_auto_pipelines_pair_the_cards_that_cannot_hold_a_replica(tmp_path):
    """`pipelines="auto"`: ranks 1 and 2, emulated with room for half a replica (its parameters, gradients and
    Adam's moments) each, become one 2-stage pipeline; rank 0 (the host's memory) stays data-parallel."""
    seed_everything(0)
    model = Chain(optimizer="adamw", n=24)
    replica = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    small = {"memory_gib": 0.75 * replica / 0.9 / 2**30}  # 3/4 of a replica after the 10 % headroom
    records = fit(model, str(tmp_path), 3, hybrid("auto", "equal", emulate=[None, small, small]), 1, max_steps=2)
    assert all(record["pipelines"] == [[1, 2]] for record in records)
    assert records[1]["owned"] and records[2]["owned"]


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [["a", "b", "b"], ["a", "a", "a"]], ids=["pipeline on another host", "one host"])
def test_stage_compression_only_across_hosts(tmp_path, hosts):
    """`stage_compression="bf16"`: the stage groups that span two (emulated) hosts exchange bf16 sums between them,
    a bf16-sized change that leaves every copy of a stage identical; on one host the exchange stays exact."""
    world, capacities, n, epochs = 3, [2, 1, 1], 53, 1
    seed_everything(0)
    model = Chain(optimizer="sgd", n=n)
    reference = copy.deepcopy(model)
    ref_params, _ = reference_run(reference, world, capacities, epochs)
    records = run_hybrid(tmp_path, model, world, [[1, 2]], capacities, epochs, stage_compression="bf16",
                         emulate=[{"host": h} for h in hosts])
    final = records[0]["params"][-1]
    diff = max_rel_diff(_flat(final), ref_params[-1])
    print(f"hosts {hosts}: rel diff {diff:.2e}")
    if len(set(hosts)) > 1:
        assert 1e-6 < diff <= 2e-2
    else:
        assert diff <= 2e-5
    for r in (1, 2):
        for name in records[r]["owned"]:
            assert torch.equal(records[r]["params"][-1][name], final[name])


def _clipped_by_norm(model, max_norm):
    """``model`` whose optimizer clips the whole gradient by norm before each step, as one device under Lightning's
    ``gradient_clip_val`` does (for :func:`reference_run`, which steps the optimizer itself)."""
    make = model.configure_optimizers

    def clip(*_):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def configure_optimizers():
        optimizer = make()
        optimizer.register_step_pre_hook(clip)
        return optimizer

    model.configure_optimizers = configure_optimizers
    return model


@pytest.mark.slow
def test_norm_clipping_uses_the_whole_models_norm(tmp_path):
    """`gradient_clip_val` by norm: a stage rank clips by the norm of every stage's gradients, as one device does."""
    world, capacities, n, max_norm = 3, [2, 1, 1], 53, 0.02
    seed_everything(0)
    model = Chain(optimizer="sgd", n=n)
    ref_params, _ = reference_run(_clipped_by_norm(copy.deepcopy(model), max_norm), world, capacities, 1)
    unclipped, _ = reference_run(copy.deepcopy(model), world, capacities, 1)
    assert max_rel_diff(unclipped[-1], ref_params[-1]) > 1e-3  # the clipping bites
    records = fit(model, str(tmp_path), world, hybrid([[1, 2]], capacities), 1, gradient_clip_val=max_norm)
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    for r in (1, 2):
        for name in records[r]["owned"]:
            assert torch.equal(records[r]["params"][-1][name], records[0]["params"][-1][name])


class GivenPlugin(Callback):
    """Per rank, after the fit: whether the precision plugin passed to the strategy still clips by norm with its
    class's own method (the strategy clips through a plugin of its own)."""

    def __init__(self, plugin, out_dir):
        self.plugin, self.out_dir = plugin, out_dir

    def teardown(self, trainer, pl_module, stage):
        untouched = ("clip_grad_by_norm" not in vars(self.plugin)
                     and self.plugin.clip_grad_by_norm.__func__ is type(self.plugin).clip_grad_by_norm)
        torch.save(untouched, os.path.join(self.out_dir, f"given{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_norm_clipping_under_bf16_mixed_leaves_the_given_plugin_alone(tmp_path):
    """A user's bf16-mixed plugin and `gradient_clip_val`: clipped by the whole model's norm as one process clips
    (within bf16's rounding, far from the unclipped run), the plugin object the user passed unchanged on every rank."""
    world, capacities, n, max_norm = 3, [2, 1, 1], 53, 0.02
    seed_everything(0)
    model = Chain(optimizer="sgd", n=n)
    ref_params, _ = reference_run(_clipped_by_norm(copy.deepcopy(model), max_norm), world, capacities, 1)
    unclipped, _ = reference_run(copy.deepcopy(model), world, capacities, 1)
    plugin = MixedPrecision("bf16-mixed", "cpu")
    records = fit(model, str(tmp_path), world, hybrid([[1, 2]], capacities, precision_plugin=plugin), 1,
                  callbacks=[GivenPlugin(plugin, str(tmp_path))], default_root_dir=str(tmp_path),
                  gradient_clip_val=max_norm)
    final = _flat(records[0]["params"][-1])
    diff, off = max_rel_diff(final, ref_params[-1]), max_rel_diff(final, unclipped[-1])
    print(f"bf16-mixed, clipped by norm: rel diff {diff:.2e} (from the unclipped run: {off:.2e})")
    assert diff <= 1e-3 < off
    assert [torch.load(os.path.join(str(tmp_path), f"given{r}.pt")) for r in range(world)] == [True] * world
    for r in (1, 2):
        for name in records[r]["owned"]:
            assert torch.equal(records[r]["params"][-1][name], records[0]["params"][-1][name])


class LogsMetric(Chain):
    """Chain that logs a torchmetrics Metric object from its training step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from torchmetrics import MeanMetric
        self.mean_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        self.log("mean_loss", self.mean_loss)
        return loss


@pytest.mark.slow
def test_logging_a_metric_object_fails_on_every_stage_rank(tmp_path):
    """A Metric object logged on a pipeline is refused on every stage rank with the reason (none hangs)."""
    seed_everything(0)
    with pytest.raises(Exception, match="self.log\\('mean_loss'"):
        fit(LogsMetric(n=24), str(tmp_path), 3, hybrid([[1, 2]], [2, 1, 1], resilience={"timeout": 20}), 1,
            max_steps=1)


class Counted(Validated):
    """Validated with a buffer that only rank 0 changes (as a data-parallel rank's running statistics change)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("seen", torch.zeros(()))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            self.seen += 1


class EvaluatedModel(Callback):
    """Per rank: the parameters and buffers the first validation batch runs with."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not os.path.exists(self._path(trainer)):
            state = {n: t.detach().clone() for n, t in [*pl_module.named_parameters(), *pl_module.named_buffers()]}
            torch.save(state, self._path(trainer))

    def _path(self, trainer):
        return os.path.join(self.out_dir, f"evaluated{trainer.global_rank}.pt")


@pytest.mark.slow
def test_validation_before_the_first_optimizer_step_runs_rank_0s_model(tmp_path):
    """Validation after the first batch of an accumulation window (a stage rank has released the other stages, no
    optimizer step has shared the split yet): every rank evaluates rank 0's weights and buffers."""
    seed_everything(0)
    fit(Counted(n=24), str(tmp_path), 3, hybrid([[1, 2]], [2, 1, 1]), 1, callbacks=[EvaluatedModel(str(tmp_path))],
        max_steps=1, accumulate_grad_batches=2, val_check_interval=1)
    evaluated = [torch.load(os.path.join(tmp_path, f"evaluated{r}.pt")) for r in range(3)]
    assert float(evaluated[0]["seen"]) == 1
    for r in (1, 2):
        for name, tensor in evaluated[0].items():
            assert torch.equal(evaluated[r][name], tensor), (r, name)


@pytest.mark.slow
def test_pipelined_validation_before_the_first_optimizer_step_runs_rank_0s_stage(tmp_path):
    """As above with `pipelined_evaluation=True`: a stage rank evaluates its own stage's parameters (rank 0's, as no
    step has changed them) and rank 0's buffers; the other stages' parameters stay placeholders on it."""
    seed_everything(0)
    records = fit(Counted(n=24), str(tmp_path), 3, hybrid([[1, 2]], [2, 1, 1], pipelined_evaluation=True), 1,
                  callbacks=[EvaluatedModel(str(tmp_path))], max_steps=1, accumulate_grad_batches=2,
                  val_check_interval=1)
    evaluated = [torch.load(os.path.join(tmp_path, f"evaluated{r}.pt")) for r in range(3)]
    assert float(evaluated[0]["seen"]) == 1
    for r in (1, 2):
        assert torch.equal(evaluated[r]["seen"], evaluated[0]["seen"])
        for name in records[r]["owned"]:
            assert torch.equal(evaluated[r][name], evaluated[0][name]), (r, name)
        others = [n for n in records[r]["bytes"] if n not in records[r]["owned"]]
        # (Cloned by the callback: a placeholder's one zero, expanded.)
        assert others and all(not evaluated[r][n].any() and evaluated[0][n].any() for n in others)


class Frozen(Chain):
    """Chain with its first layer frozen (still handed to the optimizer, as ``self.parameters()`` does)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net[0].requires_grad_(False)


@pytest.mark.slow
def test_a_frozen_layer_stays_as_on_one_device(tmp_path):
    """A frozen parameter gets no gradient from the stage exchange, so AdamW's weight decay skips it as on one
    device; the rest trains exactly."""
    world, capacities, n = 3, [2, 1, 1], 24
    seed_everything(0)
    model = Frozen(optimizer="adamw", n=n)
    ref_params, _ = reference_run(copy.deepcopy(model), world, capacities, 1)
    records = fit(model, str(tmp_path), world, hybrid([[1, 2]], capacities), 1)
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    for r in range(world):
        assert torch.equal(records[r]["final"]["net.0.weight"], model.net[0].weight), r


class Tied(Chain):
    """Chain with two of its layers sharing one weight (both in the first stage of a ``split_points=["net.6"]``
    pipeline)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net[4].weight = self.net[2].weight


@pytest.mark.slow
def test_weights_tied_within_a_stage(tmp_path):
    """A stage's tied weight (one parameter under two names) reaches a parked stage rank once, and trains exactly."""
    world, capacities, n = 3, [2, 1, 1], 24
    seed_everything(0)
    model = Tied(optimizer="sgd", n=n)
    ref_params, _ = reference_run(copy.deepcopy(model), world, capacities, 1)
    records = fit(model, str(tmp_path), world, hybrid([[1, 2]], capacities, split_points=["net.6"]), 1)
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    assert torch.equal(records[1]["final"]["net.2.weight"], records[0]["final"]["net.2.weight"])


class ValidationLoss(Callback):
    """Per rank: the epoch's reduced ``val_loss`` after every validation run (``key``, saved as
    ``{prefix}{rank}.pt``)."""

    key, prefix = "val_loss", "val"

    def __init__(self, out_dir):
        self.out_dir, self.values = out_dir, []

    def record(self, trainer):
        self.values.append(float(trainer.callback_metrics[self.key]))

    def on_validation_end(self, trainer, pl_module):
        self.record(trainer)

    def teardown(self, trainer, pl_module, stage):
        torch.save(self.values, os.path.join(self.out_dir, f"{self.prefix}{trainer.global_rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_global_batch_of_one_sample_per_replica(tmp_path, accumulate):
    """4 ranks are 3 replicas (ranks 0, 1 and the pipeline [2, 3]): a global batch of 3 trains (one sample per
    replica, stage rank 3 running a padding slice; the epoch's last batch of 1 leaves both data-parallel ranks
    padding), with and without accumulation, and equals one process on the same global batches; validation with
    that global batch (4 ranks evaluating the whole model, one short of a sample) logs one process's loss."""
    world, capacities, n, epochs = 4, [1, 1, 1, 1], 19, 2
    seed_everything(0)
    model = Validated(optimizer="adamw", n=n, batch_size=3)
    reference = copy.deepcopy(model)
    ref_params, ref_batches = reference_run(reference, 1, [1.0], epochs, accumulate=accumulate)
    assert [len(b) for b in ref_batches[:7]] == [3] * 6 + [1]
    records = fit(model, str(tmp_path), world, hybrid([[2, 3]], capacities, global_batch_size=3), epochs,
                  callbacks=[Splits(str(tmp_path)), ValidationLoss(str(tmp_path))], default_root_dir=str(tmp_path),
                  accumulate_grad_batches=accumulate)
    splits = torch.load(os.path.join(str(tmp_path), "splits.pt"))
    assert splits == 2 * ([[1, 1, 1, 0]] * 6 + [[0, 0, 1, 0]])
    assert len(records[0]["params"]) == len(ref_params) == 14
    diff = 0.0
    for step, expected in enumerate(ref_params):
        taken = sorted(i for r in range(world) if splits[step][r] for i in records[r]["indices"][step])
        assert taken == sorted(ref_batches[step])
        assert torch.equal(_flat(records[1]["params"][step]), _flat(records[0]["params"][step]))
        for r in (2, 3):
            for name in records[r]["owned"]:
                assert torch.equal(records[r]["params"][step][name], records[0]["params"][step][name]), (r, name)
        diff = max(diff, max_rel_diff(_flat(records[0]["params"][step]), expected))
    print(f"global batch 3 over 3 replicas, accumulate {accumulate}: max rel diff {diff:.2e}")
    assert diff <= 2e-5
    # Validation after each epoch: one process's mean loss over the 12 validation samples, on every rank.
    dataset, probe = IndexedDataset(12, seed=1), copy.deepcopy(reference)
    for epoch, last in enumerate((6, 13)):
        nn.utils.vector_to_parameters(ref_params[last], probe.parameters())
        expected = float(probe.loss((dataset.x, dataset.y, torch.arange(12))).detach())
        for r in range(world):
            logged = torch.load(os.path.join(str(tmp_path), f"val{r}.pt"))
            assert abs(logged[epoch] - expected) <= 1e-5 * max(1.0, abs(expected)), (r, epoch, logged, expected)


@pytest.mark.slow
def test_a_global_batch_below_the_replica_count_is_refused(tmp_path):
    """3 replicas (ranks 0, 1 and the pipeline [2, 3]) cannot split a global batch of 2: refused on every rank,
    naming the field and the replica count."""
    with pytest.raises(Exception, match=r"`global_batch_size`=2 is smaller than the 3 replicas of the 4 ranks"):
        fit(Chain(n=24), str(tmp_path), 4, hybrid([[2, 3]], [1, 1, 1, 1], global_batch_size=2), 1, max_steps=1)


class ExchangeOrder(Callback):
    """Per rank: the order of the stage exchanges' launches (the group's ranks, async or not), the first layer's
    gradient (the backward's last) and each optimizer step, per training batch."""

    def __init__(self, out_dir):
        self.out_dir, self.batches = out_dir, []

    def setup(self, trainer, pl_module, stage):
        import torch.distributed as dist

        launch = dist.all_reduce

        def spied(tensor, *args, group=None, async_op=False, **kwargs):
            if group is not None and self.batches:
                self.batches[-1].append(("all_reduce", tuple(dist.get_process_group_ranks(group)), async_op))
            return launch(tensor, *args, group=group, async_op=async_op, **kwargs)

        dist.all_reduce = spied

    def on_train_start(self, trainer, pl_module):
        pl_module.net[0].weight.register_post_accumulate_grad_hook(
            lambda p: self.batches[-1].append(("first layer grad",)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.batches[-1].append(("optimizer step",))

    def teardown(self, trainer, pl_module, stage):
        torch.save(self.batches, os.path.join(self.out_dir, f"order{trainer.global_rank}.pt"))


class Unused(Chain):
    """Chain with a trainable parameter in its last stage that never gets a gradient (used detached)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spare = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.net(x) + self.spare.detach()


@pytest.mark.slow
@pytest.mark.parametrize(("accumulate", "model_class", "overlap"),
                         [(1, Chain, True), (2, Chain, True), (1, Unused, True), (1, Chain, False)],
                         ids=["overlap", "accumulate 2", "unused parameter", "overlap off"])
def test_stage_exchanges_overlap_the_backward(tmp_path, accumulate, model_class, overlap):
    """A data-parallel rank launches the last stage's exchange before the backward reaches the first layer, only on
    the backward an optimizer step follows, in descending stage order; a stage that never gets all its gradients
    (an unused parameter) is exchanged late, and so is every stage below it; with `overlap_stage_exchange=False`
    every exchange is late, in ascending stage order. The result is one process's."""
    world, capacities, n = 3, [2, 1, 1], 72
    seed_everything(0)
    model = model_class(optimizer="adamw", n=n)
    ref_params, _ = reference_run(copy.deepcopy(model), world, capacities, 1, accumulate=accumulate)
    strategy = hybrid([[1, 2]], capacities, split_points=["net.4"], overlap_stage_exchange=overlap)
    records = fit(model, str(tmp_path), world, strategy, 1, callbacks=[ExchangeOrder(str(tmp_path))],
                  accumulate_grad_batches=accumulate)
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    assert records[1]["owned"] and records[2]["owned"]
    order = torch.load(os.path.join(tmp_path, "order0.pt"))
    stage_groups = [(0, 1), (0, 2)]
    early = model_class is Chain and overlap
    steps = [events for events in order if ("optimizer step",) in events]
    assert len(steps) >= 3
    for events in steps[1:]:  # the first step shares the stage split: exchanged late
        exchanges = [e for e in events if e[0] == "all_reduce" and e[1] in stage_groups]
        # One exchange per stage group, launched async during the backward when early; with the overlap on, the last
        # stage's first (early or late), off: the first stage's first.
        assert [e[1] for e in exchanges] == (stage_groups[::-1] if overlap else stage_groups)
        assert [e[2] for e in exchanges] == [early, early]
        last_stage, grad = events.index(exchanges[0]), events.index(("first layer grad",))
        assert (last_stage < grad) == early
    accumulating = [events for events in order if ("optimizer step",) not in events]
    assert len(accumulating) == (len(order) - len(steps) if accumulate > 1 else 0)
    for events in accumulating:
        assert not [e for e in events if e[0] == "all_reduce" and e[1] in stage_groups]


def scale_last_layer(module):
    """A gradient edit after the backward: the last layer's gradients (in the last stage) times 0.25, where held."""
    for p in module.net[6].parameters():
        if p.grad is not None:
            p.grad.mul_(0.25)


class EditsGrads(Chain):
    def on_after_backward(self):
        scale_last_layer(self)


class EditGrads(Callback):
    def on_after_backward(self, trainer, pl_module):
        scale_last_layer(pl_module)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["module", "callback"])
def test_a_gradient_edit_after_the_backward_is_honoured(tmp_path, where):
    """`on_after_backward` sees each rank's own gradients before the exchange, as Lightning promises: an edit there
    (of the last stage, which a data-parallel rank would otherwise exchange during the backward) gives one process
    doing the same edit after its backward, with the overlap on. SGD: a scaled gradient moves the parameters less
    (Adam would undo the scale)."""
    world, capacities, n = 3, [2, 1, 1], 36
    seed_everything(0)
    model = (EditsGrads if where == "module" else Chain)(optimizer="sgd", n=n)
    ref_params, _ = reference_run(copy.deepcopy(model), world, capacities, 1, after_backward=scale_last_layer)
    strategy = hybrid([[1, 2]], capacities, split_points=["net.4"], overlap_stage_exchange=True)
    records = fit(model, str(tmp_path), world, strategy, 1, callbacks=[EditGrads()] if where == "callback" else [])
    assert records[0]["steps"] == len(ref_params) >= 3
    for step, expected in enumerate(ref_params):
        assert max_rel_diff(_flat(records[0]["params"][step]), expected) <= 2e-5, step
    assert torch.equal(records[2]["final"]["net.6.weight"], records[0]["final"]["net.6.weight"])


class EditOnRank(Callback):
    """Adds :class:`EditGrads` to the trainer's callbacks on one rank only (before the strategy's set-up), and saves
    whether each rank's exchange overlaps the backward."""

    def __init__(self, out_dir, rank):
        self.out_dir, self.rank = out_dir, rank

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == self.rank:
            trainer.callbacks.append(EditGrads())

    def on_train_start(self, trainer, pl_module):
        torch.save(trainer.strategy.overlapping, os.path.join(self.out_dir, f"overlapping{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_a_gradient_hook_on_one_rank_keeps_every_rank_late(tmp_path):
    """The late fallback is agreed by every rank: a hook on one stage rank alone turns the overlap off everywhere."""
    seed_everything(0)
    strategy = hybrid([[1, 2]], [2, 1, 1], split_points=["net.4"], overlap_stage_exchange=True)
    fit(Chain(optimizer="sgd", n=12), str(tmp_path), 3, strategy, 1, callbacks=[EditOnRank(str(tmp_path), 2)])
    assert [torch.load(os.path.join(tmp_path, f"overlapping{r}.pt")) for r in range(3)] == [False] * 3


class SkipsOddSteps(Unused):
    """Runs every odd batch's closure (training step and backward) without an optimizer step, a pattern Lightning's
    ``optimizer_step`` documents; its last stage has a parameter without a gradient, so a data-parallel rank exchanges
    late while the first stage's rank could begin as its backward returns."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 2:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


@pytest.mark.slow
def test_a_backward_without_an_optimizer_step_begins_no_exchange(tmp_path):
    """A backward that no optimizer step follows (a closure run alone) begins no stage exchange on any rank: one
    begun there would never be waited for, and a rank that began one the others did not would pair it with the next
    step's (a hang)."""
    world, capacities = 3, [2, 1, 1]
    seed_everything(0)
    strategy = hybrid([[1, 2]], capacities, split_points=["net.4"], overlap_stage_exchange=True,
                      resilience={"timeout": 30})
    records = fit(SkipsOddSteps(optimizer="sgd", n=48), str(tmp_path), world, strategy, 1,
                  callbacks=[ExchangeOrder(str(tmp_path))])
    assert records[0]["steps"] >= 3
    stage_groups = [(0, 1), (0, 2)]
    for rank in range(world):
        order = torch.load(os.path.join(tmp_path, f"order{rank}.pt"))
        skipped = [events for events in order if ("optimizer step",) not in events]
        assert len(skipped) >= 2
        for events in skipped:
            assert not [e for e in events if e[0] == "all_reduce" and e[1] in stage_groups], (rank, events)
    for r in (1, 2):
        for name in records[r]["owned"]:
            assert torch.equal(records[r]["final"][name], records[0]["final"][name]), (r, name)


class InfInStageZero(Callback):
    """At the second step, before the non-finite check (a callback of the strategy's, added after the user's): an
    inf in a stage-0 parameter's gradient on the ranks that hold stage 0 (as a stage exchange hands it on); the
    stage-1 rank holds no gradient of it."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grad = pl_module.net[0].weight.grad
        if trainer.global_step == 1 and grad is not None:
            grad.view(-1)[0] = float("inf")


@pytest.mark.slow
def test_a_non_finite_gradient_in_one_stage_is_skipped_on_every_rank(tmp_path):
    """A non-finite gradient only stage 0's holders see: every rank skips the step (none waits in the culprits'
    gather alone), the replicas stay identical, and training goes on."""
    seed_everything(0)
    strategy = hybrid([[1, 2]], [2, 1, 1], split_points=["net.4"], resilience={"timeout": 60, "nonfinite": "skip"})
    records = fit(Chain(optimizer="sgd", n=48), str(tmp_path), 3, strategy, 1, callbacks=[InfInStageZero()])
    assert [r["steps"] for r in records] == [records[0]["steps"]] * 3 and records[0]["steps"] > 2
    # The second step changed nothing on any rank (each rank's held parameters as after the first step).
    for record in records:
        before, after = record["params"][0], record["params"][1]
        assert all(torch.equal(before[n], after[n]) for n in before), record["owned"]
    for name in records[2]["owned"]:  # the stage-1 rank's parameters: the data-parallel rank's, bit for bit
        assert torch.equal(records[2]["final"][name], records[0]["final"][name])


class PipelineValidated(Chain):
    """Chain with a validation set of ``val_n`` samples (loader batch size 4)."""

    def __init__(self, val_n: int = 23, **kwargs) -> None:
        super().__init__(**kwargs)
        self.val_n = val_n

    def val_dataloader(self):
        from torch.utils.data import DataLoader
        return DataLoader(IndexedDataset(self.val_n, seed=1), batch_size=4)


class ValidationHeld(ValidationLoss):
    """Per rank: the epoch's reduced ``val_loss`` after every validation run, and the parameter bytes the rank
    holds at every validation batch."""

    def __init__(self, out_dir):
        super().__init__(out_dir)
        self.held = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.held.append(held_bytes(pl_module))

    def teardown(self, trainer, pl_module, stage):
        torch.save({"values": self.values, "held": self.held},
                   os.path.join(self.out_dir, f"val{trainer.global_rank}.pt"))


PIPELINED_VALIDATION = [  # (world, pipelines, capacities, global batch, validation samples)
    # G = 12: two validation batches, the pipeline's joined 6 and 5 samples run as 3 and 1 micro-batches.
    (3, [[1, 2]], [2, 1, 1], None, 23),
    # G = 3: the last stage (rank 3) pads every validation batch, stage 0 alone brings the pipeline's sample; the
    # last batch pads the whole pipeline (14 samples: ranks 0 and 1 hold the last ones).
    (4, [[2, 3]], [1, 1, 1, 1], 3, 14),
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "pipelines", "capacities", "global_batch", "val_n"), PIPELINED_VALIDATION,
                         ids=["3ranks", "4ranks-padding"])
def test_pipelined_validation_logs_one_devices_loss_on_stage_weights(tmp_path, world, pipelines, capacities,
                                                                    global_batch, val_n):
    """`pipelined_evaluation=True`: validation during the fit runs through the pipeline; a stage rank's device holds
    its stage's parameters alone at every validation batch (no re-broadcast of the whole model), the epoch's
    ``val_loss`` on every rank is one process's over the validation set, and training stays exact."""
    epochs = 2
    seed_everything(0)
    batch_size = 4 if global_batch is None else global_batch
    model = PipelineValidated(val_n=val_n, optimizer="adamw", n=29, batch_size=batch_size)
    reference = copy.deepcopy(model)
    ref_world = world if global_batch is None else 1
    ref_params, ref_batches = reference_run(reference, ref_world, capacities[:ref_world], epochs)
    records = fit(model, str(tmp_path), world, hybrid(pipelines, capacities, global_batch_size=global_batch,
                                                      pipelined_evaluation=True), epochs,
                  callbacks=[ValidationHeld(str(tmp_path))], default_root_dir=str(tmp_path))
    assert len(records[0]["params"]) == len(ref_params)
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    validations = [torch.load(os.path.join(str(tmp_path), f"val{r}.pt")) for r in range(world)]
    for r in pipelines[0]:
        own = sum(records[r]["bytes"][name] for name in records[r]["owned"])
        held = validations[r]["held"]
        assert held and all(own <= h <= own + 64 for h in held), (r, own, held)
        assert own < 0.9 * sum(records[r]["bytes"].values())
    dataset, probe = IndexedDataset(val_n, seed=1), copy.deepcopy(reference)
    steps_per_epoch = len(ref_params) // epochs
    for epoch in range(epochs):
        nn.utils.vector_to_parameters(ref_params[(epoch + 1) * steps_per_epoch - 1], probe.parameters())
        expected = float(probe.loss((dataset.x, dataset.y, torch.arange(val_n))).detach())
        for r in range(world):
            logged = validations[r]["values"]
            assert abs(logged[epoch] - expected) <= 1e-5 * max(1.0, abs(expected)), (r, epoch, logged, expected)
    for r in pipelines[0]:  # the end of training still gives every rank the whole trained model
        assert torch.equal(_flat(records[r]["final"]), _flat(records[0]["final"]))


@pytest.mark.slow
def test_pipelined_sanity_check_runs_before_the_first_split(tmp_path):
    """The sanity check's validation comes before any training step (a stage rank's model still parked in host
    memory): its trace places the stage, the device holds the stage alone, and training from there stays exact."""
    world, capacities = 3, [2, 1, 1]
    seed_everything(0)
    model = PipelineValidated(optimizer="adamw", n=29)
    ref_params, _ = reference_run(copy.deepcopy(model), world, capacities, 1)
    trainer = Trainer(accelerator="cpu", devices=world, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                      strategy=hybrid([[1, 2]], capacities, pipelined_evaluation=True),
                      callbacks=[NamedRecorder(str(tmp_path)), ValidationHeld(str(tmp_path))])
    trainer.fit(model)
    records = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(world)]
    held = [torch.load(os.path.join(tmp_path, f"val{r}.pt"))["held"] for r in range(world)]
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    for r in (1, 2):
        own = sum(records[r]["bytes"][name] for name in records[r]["owned"])
        assert len(held[r]) == 3 and all(own <= h <= own + 64 for h in held[r]), (r, own, held[r])


class EpochLogged(Chain):
    """Logs the training loss as an epoch mean (``on_epoch=True``): Lightning weights each step by the batch it
    infers, then sums values and batch sizes over ranks."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_epoch_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        return loss


class EpochLoss(ValidationLoss):
    """Per rank: the reduced ``train_epoch_loss`` at every training epoch's end."""

    key, prefix = "train_epoch_loss", "epoch"

    def on_validation_end(self, trainer, pl_module):
        pass

    def on_train_epoch_end(self, trainer, pl_module):
        self.record(trainer)


@pytest.mark.slow
def test_an_epoch_mean_logged_in_training_is_one_devices(tmp_path):
    """A loss logged with ``on_epoch=True`` in ``training_step``: every rank's epoch value equals one process's
    (each global batch's mean loss before its step, weighted by the batch's samples), the pipeline's stage ranks
    logging the replica's value for the samples of their slices."""
    world, capacities, epochs = 3, [2, 1, 1], 2
    seed_everything(0)
    model = EpochLogged(optimizer="sgd", n=46)
    reference = copy.deepcopy(model)
    ref_params, ref_batches = reference_run(copy.deepcopy(reference), world, capacities, epochs)
    records = fit(model, str(tmp_path), world, hybrid([[1, 2]], capacities, split_points=["net.4"]), epochs,
                  callbacks=[EpochLoss(str(tmp_path))])
    assert max_rel_diff(_flat(records[0]["params"][-1]), ref_params[-1]) <= 2e-5
    dataset, probe = IndexedDataset(46), copy.deepcopy(reference)
    before = [torch.nn.utils.parameters_to_vector(probe.parameters()).detach()] + ref_params[:-1]
    expected, per_epoch = [], len(ref_batches) // epochs
    with torch.no_grad():
        for epoch in range(epochs):
            total = weight = 0.0
            for k in range(epoch * per_epoch, (epoch + 1) * per_epoch):
                torch.nn.utils.vector_to_parameters(before[k], probe.parameters())
                idx = torch.tensor(ref_batches[k])
                total += float(probe.loss((dataset.x[idx], dataset.y[idx], idx))) * len(idx)
                weight += len(idx)
            expected.append(total / weight)
    for r in range(world):
        logged = torch.load(os.path.join(str(tmp_path), f"epoch{r}.pt"))
        assert logged == pytest.approx(expected, rel=1e-5), (r, logged, expected)
