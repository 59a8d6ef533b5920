"""Streaming datasets: capacity shares of every global batch of a stream (exact mode) or of per-rank shards."""

import copy
import glob
import math
import os
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import seed_everything
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, IterableDataset

from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy
from lightning_hetero.plan.split import split_batch
from tests.helpers import IndexedDataset, TinyModel, fit_distributed
from tests.data.test_sampler_sources import check_against_reference


class Stream(IterableDataset):
    """Samples of IndexedDataset in a seeded order per epoch; ``shard_by_rank`` splits it unevenly across ranks
    (rank r gets a share ∝ ``weights[r]``), as a dataset that shards itself would."""

    def __init__(self, n: int, sized: bool = True, weights: Optional[list[float]] = None) -> None:
        self.data = IndexedDataset(n)
        self.n, self.sized, self.weights, self.epoch = n, sized, weights, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, rank: int = 0) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(11 + self.epoch)).tolist()
        if self.weights is None:
            return order
        cuts = [round(self.n * sum(self.weights[:r]) / sum(self.weights)) for r in range(len(self.weights) + 1)]
        return order[cuts[rank]:cuts[rank + 1]]

    def __iter__(self):
        rank = dist.get_rank() if self.weights is not None else 0
        return (self.data[i] for i in self.order(rank))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized stream")
        return self.n


class StreamModel(TinyModel):
    def __init__(self, stream_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_kwargs = stream_kwargs or {}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(self.hparams.n, **self.stream_kwargs), batch_size=self.hparams.batch_size)


def _epoch_orders(n: int, epochs: int) -> list[list[int]]:
    stream = Stream(n)
    out = []
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        out.append(stream.order())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sized", [True, False])
def test_exact_mode_equals_one_process_on_the_stream(tmp_path, sized):
    """3 ranks [5, 2, 1], 50 samples, global batch 12: the last global batch of 2 leaves one rank a padding step."""
    seed_everything(0)
    model = StreamModel({"sized": sized}, n=50, batch_size=4)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 3, {"capacities": [5, 2, 1]}, max_epochs=2)
    batches = [order[i:i + 12] for order in _epoch_orders(50, 2) for i in range(0, 50, 12)]
    assert len(batches) == 10
    step = 0
    for order in _epoch_orders(50, 2):  # every index once per epoch, in the stream's order, slices in rank order
        trained = []
        for _ in range(5):
            slices = [records[r]["indices"][step] for r in range(3)]
            real = [s for s in slices if s] if step % 5 < 4 else [slices[0], slices[1]]  # batch of 2: ranks 0, 1
            trained += [i for s in real for i in s]
            step += 1
        assert trained == order
    assert [len(records[r]["indices"][0]) for r in range(3)] == [8, 3, 1]
    check_against_reference(records, reference_model, batches)


# Loader batch 8: global batches of 8 x W. Each stream ends in a partial global batch split unlike a full one
# ([5, 1], a padding step [1, 1, 0], [2, 1]) that shares an accumulation window of 2 with a full batch.
UNEQUAL_STREAMS = [([3, 1], 54), ([5, 2, 1], 74), ([7, 1], 51)]
# How the gradient is weighted: the loss (DDP's built-in all-reduce, FSDP's reduce-scatter) or the weighting comm hook
# (any comm hook, compression, the CPU emulator's slowdown, periodic sync).
WEIGHTING_ROUTES = {
    "ddp": ({}, HeteroDDPStrategy),
    "ddp-comm-hook": ({"ddp_comm_hook": default_hooks.allreduce_hook}, HeteroDDPStrategy),
    "fsdp": ({}, HeteroFSDPStrategy),
}


@pytest.mark.slow
@pytest.mark.parametrize(("route", "accumulate"), [("ddp", 1), ("ddp", 2), ("ddp-comm-hook", 1),
                                                   ("ddp-comm-hook", 2), ("fsdp", 2)])
@pytest.mark.parametrize(("capacities", "n"), UNEQUAL_STREAMS, ids=[str(c) for c, _ in UNEQUAL_STREAMS])
def test_exact_mode_at_unequal_shares_equals_one_process(tmp_path, capacities, n, route, accumulate):
    """3 epochs of a stream in exact mode equal one process on its global batches of G = 8 x W samples."""
    world, epochs = len(capacities), 3
    options, strategy_class = WEIGHTING_ROUTES[route]
    seed_everything(0)
    model = StreamModel(n=n, batch_size=8)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), world, {"capacities": capacities, **options},
                              max_epochs=epochs, strategy_class=strategy_class, accumulate_grad_batches=accumulate)
    g = 8 * world
    batches = [order[i:i + g] for order in _epoch_orders(n, epochs) for i in range(0, n, g)]
    assert [len(b) for b in records[0]["indices"][:4]] == [split_batch(g, capacities)[0]] * 3 + [
        split_batch(n % g, capacities)[0] or 1]
    check_against_reference(records, reference_model, batches, accumulate, epochs)


def _shard_steps(records: list[dict], stream: Stream, shares: list[int], epochs: int) -> list[list[int]]:
    """Per step, the samples all ranks trained on in shard mode, checked: rank r takes the next ``shares[r]`` of its
    own shard each step and, once its shard is used up, pads (one re-read sample) until every rank's is."""
    world, batches, step = len(shares), [], 0
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        shards = [stream.order(r) for r in range(world)]
        taken: list[list[int]] = [[] for _ in range(world)]
        for _ in range(max(math.ceil(len(shard) / share) for shard, share in zip(shards, shares))):
            real = []
            for r in range(world):
                got = records[r]["indices"][step]
                if len(taken[r]) < len(shards[r]):
                    assert got == shards[r][len(taken[r]):len(taken[r]) + shares[r]]
                    taken[r] += got
                    real += got
                else:
                    assert len(got) == 1  # padding step
            batches.append(real)
            step += 1
        assert taken == shards
    return batches


@pytest.mark.slow
@pytest.mark.parametrize(("route", "accumulate", "n"), [("ddp", 1, 40), ("ddp", 2, 42), ("ddp-comm-hook", 2, 42),
                                                        ("fsdp", 2, 42)])
def test_shard_mode_weights_the_union_and_pads_exhausted_ranks(tmp_path, route, accumulate, n):
    """Each rank streams its own shard (rank 0: 60 %, rank 1: 40 %) at shares 6/2 per step: rank 0 runs out first
    and pads with zero-weight steps until rank 1 is done; every sample once, steps equal, parameters exact."""
    options, strategy_class = WEIGHTING_ROUTES[route]
    seed_everything(0)
    model = StreamModel({"sized": False, "weights": [3, 2]}, n=n, batch_size=4)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], "data": {"stream_mode": "shard"},
                                                        **options},
                              max_epochs=2, strategy_class=strategy_class, accumulate_grad_batches=accumulate)
    stream = Stream(n, weights=[3, 2])
    # 40: shards of 24 and 16, rank 0 takes 6 a step (4 steps), rank 1 takes 2 (8 steps): rank 0 pads for 4.
    # 42: 25 and 17 in 9 steps; rank 0's fifth step holds 1 sample and shares an accumulation window with a padding
    # step.
    assert [len(stream.order(r)) for r in range(2)] == {40: [24, 16], 42: [25, 17]}[n]
    batches = _shard_steps(records, stream, [6, 2], epochs=2)
    assert len(batches) == {40: 16, 42: 18}[n]
    check_against_reference(records, reference_model, batches, accumulate, epochs=2)


@pytest.mark.slow
def test_shard_mode_under_periodic_sync_weights_what_each_rank_holds(tmp_path):
    """Periodic sync weighs each rank by every rank's samples of the step: in shard mode those are what the ranks
    hold (a rank past its shard's end has none), not a split of their sum. H = 1 with averaging is exact sync (plain
    SGD: the hosts' weights change from step to step, which momentum kept per host would not follow)."""
    from tests.grad.test_periodic import HOSTS

    class PlainSGDModel(StreamModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    seed_everything(0)
    model = PlainSGDModel({"sized": False, "weights": [3, 1, 1]}, n=50, batch_size=4)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 3, {
        "capacities": [3, 1, 2], "emulate": HOSTS, "periodic_sync": {"every": 1, "outer": "average"},
        "data": {"stream_mode": "shard"}}, max_epochs=2)
    # Shards of 30, 10, 10 at 6, 2, 4 a step: rank 2's third step has 2 samples, then it pads for two steps.
    batches = _shard_steps(records, Stream(50, weights=[3, 1, 1]), [6, 2, 4], epochs=2)
    check_against_reference(records, reference_model, batches, epochs=2)


@pytest.mark.slow
def test_exact_mode_refuses_a_stream_that_differs_across_ranks(tmp_path):
    with pytest.raises(Exception, match="ranks read different streams.*stream_mode='shard'"):
        fit_distributed(StreamModel({"weights": [1, 1]}, n=16), str(tmp_path), 2, {"capacities": [1, 1]},
                        max_epochs=1)


@pytest.mark.slow
def test_shard_mode_refuses_an_empty_shard_on_every_rank(tmp_path):
    with pytest.raises(Exception, match=r"streams of rank\(s\) \[1\] are empty"):
        fit_distributed(StreamModel({"sized": False, "weights": [1, 0]}, n=16), str(tmp_path), 2,
                        {"capacities": [1, 1], "data": {"stream_mode": "shard"}}, max_epochs=1)


def test_bad_stream_mode_is_a_value_error():
    from lightning_hetero import HeteroDDPStrategy

    with pytest.raises(ValueError, match="stream_mode"):
        HeteroDDPStrategy(data={"stream_mode": "fast"})  # type: ignore[arg-type]


def _fit_resumable(out_dir: str, mode: str, sized: bool, ckpt_dir: Optional[str] = None,
                   ckpt_path: Optional[str] = None,
                   max_steps: int = -1) -> list[dict]:
    import lightning.pytorch as pl

    from lightning_hetero import HeteroDDPStrategy
    from tests.helpers import Recorder, free_port

    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    torch.manual_seed(0)
    kwargs = {"sized": sized, "weights": [3, 2]} if mode == "shard" else {"sized": sized}
    model = StreamModel(kwargs, n=44, batch_size=4)
    callbacks: list[Any] = [Recorder(out_dir)]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=max_steps, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=2, max_steps=max_steps, callbacks=callbacks,
                         strategy=HeteroDDPStrategy(start_method="fork", observation={"print_table": False},
                                                    resilience={"timeout": 120},
                                                    capacities=[3, 1], data={"stream_mode": mode}),
                         logger=False, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "sized", "stop"), [("exact", True, 3), ("shard", False, 3), ("exact", False, 6)],
                         ids=["exact-mid-epoch", "shard-mid-epoch", "unsized-after-last-batch"])
def test_stream_resumes_exactly(tmp_path, mode, sized, stop):
    """Checkpoint at step ``stop`` of epoch 0 (6 is its last batch), resume: the same batches and parameters as an
    uninterrupted run."""
    full = _fit_resumable(str(tmp_path / "full"), mode, sized)
    first = _fit_resumable(str(tmp_path / "first"), mode, sized, ckpt_dir=str(tmp_path / "ckpt"), max_steps=stop)
    (ckpt,) = glob.glob(str(tmp_path / "ckpt" / f"*step={stop}*.ckpt"))
    resumed = _fit_resumable(str(tmp_path / "resumed"), mode, sized, ckpt_path=ckpt)
    for r in range(2):
        assert len(first[r]["indices"]) == stop
        assert first[r]["indices"] + resumed[r]["indices"] == full[r]["indices"]
        assert torch.equal(resumed[r]["params"][-1], full[r]["params"][-1])


# -- LitData ---------------------------------------------------------------------------------------------------------
def _write_litdata(directory: str, n: int) -> None:
    from litdata.streaming.writer import BinaryWriter

    data = IndexedDataset(n)
    writer = BinaryWriter(directory, chunk_size=8)
    for i in range(n):
        x, y, _ = data[i]
        writer[i] = (x, int(y), i)
    writer.done()
    writer.merge()


class LitDataModel(TinyModel):
    data_dir = ""
    num_workers = 0

    def train_dataloader(self) -> DataLoader:
        from litdata import StreamingDataset

        return DataLoader(StreamingDataset(self.data_dir, shuffle=True, seed=3), batch_size=self.hparams.batch_size,
                          num_workers=self.num_workers)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_litdata_exact_mode_equals_one_process(tmp_path, workers):
    """The stream is the samples one process's DataLoader (same workers, batches of G) delivers, cut into G."""
    pytest.importorskip("litdata")
    from litdata import StreamingDataset

    _write_litdata(str(tmp_path / "data"), 30)
    seed_everything(0)
    model = LitDataModel(n=30, batch_size=4)
    model.data_dir, model.num_workers = str(tmp_path / "data"), workers
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=2)
    one_process = StreamingDataset(str(tmp_path / "data"), shuffle=True, seed=3)
    batches = []
    for epoch in range(2):
        one_process.set_epoch(epoch)
        loader = DataLoader(one_process, batch_size=8, num_workers=workers, collate_fn=list)
        order = [int(s[2]) for chunk in loader for s in chunk]
        assert sorted(order) == list(range(30))  # every index once per epoch
        batches += [order[i:i + 8] for i in range(0, 30, 8)]
    for step, batch in enumerate(batches):
        assert records[0]["indices"][step] + records[1]["indices"][step] == batch
    check_against_reference(records, reference_model, batches)


@pytest.mark.slow
def test_litdata_shard_mode_gives_capacity_weighted_shards(tmp_path):
    pytest.importorskip("litdata")
    _write_litdata(str(tmp_path / "data"), 64)
    seed_everything(0)
    model = LitDataModel(n=64, batch_size=4)
    model.data_dir = str(tmp_path / "data")
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], "data": {"stream_mode": "shard"}},
                              max_epochs=1)
    # Rank 0 reads 6/8 of the items at 6 a step, rank 1 2/8 at 2 a step: both finish after 8 steps, no padding.
    sizes = [[len(b) for b in records[r]["indices"]] for r in range(2)]
    assert sizes == [[6] * 8, [2] * 8]
    seen = [i for r in range(2) for b in records[r]["indices"] for i in b]
    assert sorted(seen) == list(range(64))
    check_against_reference(records, reference_model,
                            [records[0]["indices"][k] + records[1]["indices"][k] for k in range(8)])


class ProfiledStreamModel(StreamModel):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(Stream(12, sized=False), batch_size=2)


@pytest.mark.slow
def test_profiled_shares_and_validation_streams(tmp_path):
    """`capacities="profile"` times the model on the stream's first samples; a validation stream is split too."""
    seed_everything(0)
    model = ProfiledStreamModel(n=32, batch_size=4)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": "profile"}, max_epochs=1)
    (order,) = _epoch_orders(32, 1)
    batches = [order[i:i + 8] for i in range(0, 32, 8)]
    for step, batch in enumerate(batches):
        assert records[0]["indices"][step] + records[1]["indices"][step] == batch
    check_against_reference(records, reference_model, batches)
