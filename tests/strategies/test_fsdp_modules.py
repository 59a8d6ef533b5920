"""HeteroFSDPStrategy on the module shapes users write: every step goes through the sharded root, so parameters
outside the blocks (embeddings, heads, the LightningModule's own) are gathered whatever the step calls; tied weights
stay one parameter; buffers, parameters unused on some steps, ``configure_model`` and compiled blocks work."""

import copy
import math
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

from lightning_hetero import HeteroFSDPStrategy
from lightning_hetero._compat import fsdp_offloads
from lightning_hetero.grad.sharding import check_ties
from lightning_hetero.plan.blocks import tied_parameters
from tests.helpers import IndexedDataset, TinyModel, fit_distributed, free_port, max_rel_diff, reference_run

TOLERANCE = 1e-6  # the DDP strategy's tolerance against one process
VOCAB, WIDTH = 4, 8


def tokens(x: torch.Tensor) -> torch.Tensor:
    """The dataset's 8 features as 8 token ids in [0, VOCAB)."""
    return (x.abs() * 2).long().clamp(max=VOCAB - 1)


class Net(nn.Module):
    """A plain model (as from a model zoo): embedding and head outside its blocks, a buffer, optionally tied."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embedding.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.embedding(t).mean(1)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h * self.scale)


class WrapperModule(TinyModel):
    """``training_step`` calls ``self.model(...)``: the LightningModule's own ``forward`` never runs."""

    def __init__(self, optimizer: str = "sgd", n: int = 32, tie: bool = False) -> None:
        super().__init__(optimizer, n=n, batch_size=4)
        del self.net
        self.model = Net(tie)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self.model(tokens(x)), y)


class TiedThroughSelf(WrapperModule):
    """Output head tied to the embedding, the step calling ``self(...)``."""

    def __init__(self, optimizer: str = "sgd", n: int = 32) -> None:
        super().__init__(optimizer, n, tie=True)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.model(t)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self(tokens(x)), y)


class SeveralSubmodules(TinyModel):
    """An encoder, a head and a parameter of the LightningModule's own, each called by the step; an extra head used
    on every other step only (the same steps on every rank)."""

    def __init__(self, optimizer: str = "sgd", n: int = 32) -> None:
        super().__init__(optimizer, n=n, batch_size=4)
        del self.net
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)
        self.bias = nn.Parameter(torch.zeros(4))
        self.calls = 0

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        h = self.encoder(x)
        logits = self.head(h) + self.bias
        self.calls += 1
        if self.calls % 2 == 0:
            logits = logits + self.extra(h)
        return F.cross_entropy(logits, y)


class DemoTransformer(TinyModel):
    """Lightning's demo ``Transformer`` (``LightningTransformer``'s model) called as ``self.model(inputs, target)``."""

    def __init__(self, optimizer: str = "sgd", n: int = 32) -> None:
        super().__init__(optimizer, n=n, batch_size=4)
        del self.net
        self.model = Transformer(vocab_size=VOCAB, ninp=WIDTH, nhead=2, nhid=16, nlayers=1, dropout=0.0)

    def loss(self, batch: Any) -> torch.Tensor:
        x, _, _ = batch
        inputs, target = tokens(x), tokens(x.flip(1))
        return F.nll_loss(self.model(inputs, target), target.reshape(-1))


SHAPES = {"self.model": WrapperModule, "tied, self(...)": TiedThroughSelf, "several submodules": SeveralSubmodules,
          "lightning demo Transformer": DemoTransformer}


def _fit_and_reference(tmp_path: Any, model: TinyModel, capacities: list[int], strategy_kwargs: Any = None,
                       **trainer_kwargs: Any) -> tuple[list[dict], list[torch.Tensor]]:
    reference = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), len(capacities), {"capacities": capacities,
                                                                      **(strategy_kwargs or {})},
                              max_epochs=1, strategy_class=HeteroFSDPStrategy, **trainer_kwargs)
    ref_params, _ = reference_run(reference, len(capacities), capacities, 1)
    return records, ref_params


def _assert_exact(records: list[dict], ref_params: list[torch.Tensor]) -> None:
    assert {r["steps"] for r in records} == {len(ref_params)}
    for step, expected in enumerate(ref_params):
        for r in records[1:]:
            assert torch.equal(r["params"][step], records[0]["params"][step])  # replicas bit-identical
        assert records[0]["params"][step].shape == expected.shape  # a tie kept: as many parameters as one process
        assert max_rel_diff(records[0]["params"][step], expected) <= TOLERANCE, step


@pytest.mark.slow
@pytest.mark.parametrize("capacities", [[3, 1], [5, 2, 1]], ids=["[3,1]", "[5,2,1]"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_module_shape_equals_one_process(tmp_path, shape, capacities):
    seed_everything(0)
    # Adam on 3 ranks, except for the transformer: its first Adam step divides gradients that are zero up to rounding
    # (attention's softmax rows) by their own size, which turns summation order into a full-size update.
    optimizer = "adam" if len(capacities) == 3 and shape != "lightning demo Transformer" else "sgd"
    records, ref_params = _fit_and_reference(tmp_path, SHAPES[shape](optimizer), capacities)
    _assert_exact(records, ref_params)


@pytest.mark.slow
def test_blocks_that_would_split_a_tie_are_left_to_the_root(tmp_path):
    """``blocks`` naming both the embedding and the head (which share a weight): neither is sharded on its own, so
    the weight stays one parameter (in the root's group) and trains as in one process."""
    seed_everything(0)
    records, ref_params = _fit_and_reference(
        tmp_path, TiedThroughSelf(), [3, 1],
        strategy_kwargs={"blocks": ["torch.nn.Embedding", "torch.nn.Linear"]})
    _assert_exact(records, ref_params)


class ShardsItselfApart(WrapperModule):
    """``configure_model`` sharding the embedding and the tied head separately: two parameters where one was."""

    def configure_model(self) -> None:
        fully_shard(self.model.embedding)
        fully_shard(self.model.head)


@pytest.mark.slow
def test_a_module_that_shards_a_tie_apart_fails_with_a_clear_error(tmp_path):
    model = ShardsItselfApart(tie=True)
    with pytest.raises(Exception) as err:
        fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=1,
                        strategy_class=HeteroFSDPStrategy)
    message = "".join(str(e) for e in (err.value, err.value.__cause__) if e is not None)
    assert "model.embedding.weight" in message and "sharded apart" in message


def test_check_ties_names_a_tie_made_two():
    net = Net(tie=True)
    ties = tied_parameters(net)
    assert ties == [("embedding.weight", "head.weight")]
    check_ties(net, ties)
    net.head.weight = nn.Parameter(net.embedding.weight.detach().clone())
    with pytest.raises(ValueError, match=r"\['embedding.weight', 'head.weight'\] were sharded apart"):
        check_ties(net, ties)


class ShardsItself(WrapperModule):
    """``configure_model`` shards the blocks (its own choice); the strategy adds only the root."""

    def configure_model(self) -> None:
        if not any(True for _ in self.model.blocks[0].modules() if type(_).__name__.startswith("FSDP")):
            for block in self.model.blocks:
                fully_shard(block)


class CompiledBlocks(WrapperModule):
    """Blocks compiled in place (``nn.Module.compile``: names unchanged)."""

    def __init__(self, optimizer: str = "sgd", n: int = 32) -> None:
        super().__init__(optimizer, n)
        for block in self.model.blocks:
            block.compile(backend="aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [ShardsItself, CompiledBlocks], ids=["configure_model", "compiled blocks"])
def test_configure_model_and_compiled_blocks_equal_one_process(tmp_path, shape):
    seed_everything(0)
    model = shape()
    reference = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=1,
                              strategy_class=HeteroFSDPStrategy)
    ref_params, _ = reference_run(reference, 2, [3, 1], 1)
    _assert_exact(records, ref_params)


class Evaluated(WrapperModule):
    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(IndexedDataset(16, seed=3), batch_size=4)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self.val_dataloader()

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        out = self.model(tokens(batch[0]))
        self.predicted.append((batch[2], out))
        return out

    def on_predict_epoch_start(self) -> None:
        self.predicted: list = []

    def on_predict_epoch_end(self) -> None:
        # Forked ranks return no predictions: each saves its own.
        torch.save(self.predicted, f"{self.out_dir}/predicted{self.global_rank}.pt")

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self.val_dataloader()


@pytest.mark.slow
def test_validation_test_and_predict_run_through_the_strategy(tmp_path):
    """Validation inside a sharded fit (the step calls ``self.model``), then test and predict (whole model on each
    rank): the losses and predictions of the trained weights, as one process computes them."""
    seed_everything(0)
    model = Evaluated()
    reference = copy.deepcopy(model)
    fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=1,
                    strategy_class=HeteroFSDPStrategy)
    reference_run(reference, 2, [3, 1], 1)
    data = IndexedDataset(16, seed=3)
    with torch.no_grad():
        expected_loss = reference.loss((data.x, data.y, None)).item()
        expected_out = reference.model(tokens(data.x))
    strategy = HeteroFSDPStrategy(start_method="fork", capacities=[3, 1], observation={"print_table": False})
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tested = trainer.test(model)[0]["test_loss"]
    assert abs(tested - expected_loss) <= 1e-5 * abs(expected_loss)
    model.out_dir = str(tmp_path)
    trainer.predict(model)
    predicted = [p for r in range(2) for p in torch.load(tmp_path / f"predicted{r}.pt")]
    assert sorted(int(i) for indices, _ in predicted for i in indices) == list(range(16))
    for indices, out in predicted:
        assert torch.allclose(out, expected_out[indices], atol=1e-6)


# -- per-card micro-batches -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("micro_batch", "optimizer"), [([2, 2], "sgd"), ([2, 2], "adamw"), ([6, 1], "sgd")],
                         ids=["3+1 pieces, SGD", "3+1 pieces, AdamW", "1+2 pieces, SGD"])
def test_per_rank_micro_batches_equal_one_process(tmp_path, micro_batch, optimizer):
    """Shares 6 + 2 of each global batch of 8, run as 3 + 1 (or 1 + 2) micro-batches: the ranks join the same
    collectives (parameters gathered once per step) and train the module (embedding and head in the root's group)
    exactly as one process."""
    seed_everything(0)
    records, ref_params = _fit_and_reference(tmp_path, WrapperModule(optimizer, n=40), [3, 1],
                                             strategy_kwargs={"data": {"micro_batch": micro_batch}})
    _assert_exact(records, ref_params)


@pytest.mark.slow
def test_micro_batches_kept_gathered_issue_the_collectives_of_one_piece():
    """Shares 6 + 2 run as 3 + 1 pieces: each rank issues the all-gathers and reduce-scatters of a step in one piece
    (padding to 3 pieces would triple the all-gathers); only the rank that splits holds more; the parameters are one
    process's up to the summation-order floor of this loop (the strategy's own tests above hold 1e-6)."""
    from benchmarks.fsdp_micro_batches import reference, run

    one, gathered = run("one", 16, 2, free_port()), run("gathered", 16, 2, free_port())
    for key in ("all_gathers", "all_gather_elements", "reduce_scatters", "reduce_scatter_elements"):
        assert [r[key] for r in gathered] == [r[key] for r in one], key
    assert gathered[0]["micro_batches"] == 3 and gathered[1]["micro_batches"] == 1
    assert gathered[0]["held_bytes"] > one[0]["held_bytes"] == gathered[1]["held_bytes"]  # the rank that splits
    assert gathered[0]["params"] == gathered[1]["params"]
    expected = reference(16, 2)

    def error(params: dict) -> float:
        return max(max_rel_diff(torch.tensor(params[k]), v) for k, v in expected.items())

    # 8 steps of SGD with momentum on 16-wide layers: the fp32 summation-order floor, one piece per rank included.
    assert error(gathered[0]["params"]) <= 1e-5 and error(one[0]["params"]) <= 1e-5


class RecordsItsPlan(WrapperModule):
    """Writes, per rank, its memory plan, whether its first block's shard lives in host memory and the samples of
    each forward, so the test sees the plan applied and the micro-batches run."""

    def __init__(self, out_dir: str, n: int = 40) -> None:
        super().__init__("sgd", n=n)
        self.out_dir = out_dir
        self.forward_sizes: list[int] = []

    def loss(self, batch: Any) -> torch.Tensor:
        self.forward_sizes.append(len(batch[0]))
        return super().loss(batch)

    def on_train_end(self) -> None:
        plan = self.trainer.strategy.memory_plan[self.global_rank]
        torch.save({"mode": plan.mode, "micro_batches": plan.micro_batches, "gathered": plan.gathered,
                    "offloaded": fsdp_offloads(self.model.blocks[0]), "forward_sizes": self.forward_sizes},
                   f"{self.out_dir}/plan{self.global_rank}.pt")


@pytest.mark.slow
def test_micro_batches_with_a_per_block_plan_equal_one_process(tmp_path):
    """Shares 2 + 6 of each global batch of 8: rank 1 runs its 6 as 3 micro-batches with its first block offloaded
    to host memory and every block recomputing its activations, rank 0 keeps everything and runs 2 in one piece; the
    parameters held gathered across rank 1's micro-batches include the offloaded block's, and the result is one
    process's."""
    seed_everything(0)
    memory = {"rank:0": "keep", "rank:1": "offload:1,checkpoint:all"}
    records, ref_params = _fit_and_reference(tmp_path, RecordsItsPlan(str(tmp_path)), [1, 3],
                                             strategy_kwargs={"data": {"micro_batch": [8, 2]}, "memory": memory})
    _assert_exact(records, ref_params)
    plans = [torch.load(tmp_path / f"plan{r}.pt") for r in range(2)]
    assert [p["mode"] for p in plans] == ["keep", "offload:1,checkpoint:all"]
    assert [p["offloaded"] for p in plans] == [False, True]
    assert [p["micro_batches"] for p in plans] == [1, 3]
    assert plans[1]["gathered"] > plans[0]["gathered"]  # the whole model, held across rank 1's micro-batches
    assert set(plans[0]["forward_sizes"]) == {2} and set(plans[1]["forward_sizes"]) == {2}
    assert len(plans[1]["forward_sizes"]) == 3 * len(plans[0]["forward_sizes"])


class RecordsItsResharding(WrapperModule):
    """Writes, per rank, whether its blocks reshard after forward (FSDP2's flag as the strategy set it) and whether
    the memory plan kept them gathered, at the end and as sharded at setup (before the check of the first step)."""

    def __init__(self, out_dir: str, optimizer: str = "adamw", n: int = 40) -> None:
        super().__init__(optimizer, n=n)
        self.out_dir = out_dir
        self.at_setup: tuple[list[bool], bool] = ([], False)

    def _state(self) -> tuple[list[bool], bool]:
        from lightning_hetero._compat import fsdp_flags

        plan = self.trainer.strategy.memory_plan[self.global_rank]
        return [fsdp_flags(block)[0] for block in self.model.blocks], plan.keep_gathered

    def on_train_start(self) -> None:  # Lightning runs the module's hook before the strategy's
        self.at_setup = self._state()

    def on_train_end(self) -> None:
        flags, kept = self._state()
        torch.save({"reshard": flags, "kept": kept, "at_setup": self.at_setup},
                   f"{self.out_dir}/reshard{self.global_rank}.pt")


@pytest.mark.slow
def test_blocks_kept_gathered_until_their_backward_equal_one_process(tmp_path):
    """``memory.keep_gathered``: every rank's blocks keep their gathered parameters from forward to backward (one
    all-gather per block and step instead of two); shares 3 + 1, AdamW: one process's parameters, replicas equal."""
    from lightning_hetero.plan.memory import MemoryPolicy

    seed_everything(0)
    records, ref_params = _fit_and_reference(tmp_path, RecordsItsResharding(str(tmp_path)), [3, 1],
                                             strategy_kwargs={"memory": MemoryPolicy(keep_gathered=True)})
    _assert_exact(records, ref_params)
    assert [torch.load(tmp_path / f"reshard{r}.pt")["reshard"] for r in range(2)] == [[False, False]] * 2


@pytest.mark.slow
def test_auto_keeps_the_blocks_gathered_where_memory_allows_and_equals_one_process(tmp_path):
    """The default ``memory="auto"`` on two CPU ranks with room to spare: the plan keeps every block gathered from
    forward to backward on both ranks (recorded in the plan, applied to FSDP2's flags); one process's parameters."""
    seed_everything(0)
    records, ref_params = _fit_and_reference(tmp_path, RecordsItsResharding(str(tmp_path)), [3, 1])
    _assert_exact(records, ref_params)
    for r in range(2):
        state = torch.load(tmp_path / f"reshard{r}.pt")
        assert (state["reshard"], state["kept"]) == ([False, False], True)


@pytest.mark.slow
def test_auto_reshards_when_the_first_steps_counted_bytes_leave_no_room(tmp_path):
    """Rank 1 capped so that, once its share's activations are counted before the first step, its plan fits only
    with the blocks resharded after forward. At setup (shares not known yet) the plan kept them gathered; before the
    first step every rank reshards them, and the fit is one process's."""
    from lightning_hetero.plan.blocks import default_blocks
    from lightning_hetero.plan.memory import MemoryPolicy, ModelFootprint

    seed_everything(0)
    model = RecordsItsResharding(str(tmp_path))
    footprint = ModelFootprint.of(model, default_blocks(model), 2)  # AdamW: 2 slots
    on_device = 2 * 2 * math.ceil(footprint.parameter_bytes / 2) + 4 * footprint.largest_block_bytes
    cap = 2**20
    budget = int(cap * 0.9)  # the default headroom
    # Rank 1's 2 samples fill the budget but for half the model: room for no gathered copy of it.
    per_sample = (budget - on_device - footprint.parameter_bytes // 2) // 2
    policy = MemoryPolicy(activation_bytes_per_sample=per_sample)
    records, ref_params = _fit_and_reference(tmp_path, model, [3, 1], strategy_kwargs={
        "memory": policy, "emulate": [None, {"memory_gib": cap / 2**30}]})
    _assert_exact(records, ref_params)
    for r in range(2):
        state = torch.load(tmp_path / f"reshard{r}.pt")
        assert state["at_setup"] == ([False, False], True)
        assert (state["reshard"], state["kept"]) == ([True, True], False)
