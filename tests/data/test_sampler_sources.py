"""Any reproducible sampler: every rank draws the same global order and takes its capacity share of each batch."""

import copy
import glob
import os
import random
from typing import Optional

import pytest
import torch
from lightning.pytorch import seed_everything
from torch.utils.data import BatchSampler, DataLoader, Sampler, WeightedRandomSampler

from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler
from tests.helpers import IndexedDataset, TinyModel, fit_distributed, flat_params, max_rel_diff, steps_optimizer


def _weights(n: int) -> torch.Tensor:
    return torch.linspace(0.1, 2.0, n)


def reference_on_batches(model: TinyModel, batches: list[list[int]], accumulate: int = 1,
                         epochs: int = 1) -> list[torch.Tensor]:
    """One process trained on the given global batches (mean loss over each); params after each batch.

    ``accumulate`` steps the optimizer every that many batches of an epoch (``epochs`` of equal length) and at its
    end, each batch's loss divided by it, as Lightning's ``accumulate_grad_batches`` does.
    """
    dataset = IndexedDataset(model.hparams.n)
    optimizer = model.configure_optimizers()
    per_epoch = len(batches) // epochs
    params = []
    for i, batch in enumerate(batches):
        idx = torch.tensor(batch)
        (model.loss((dataset.x[idx], dataset.y[idx], idx)) / accumulate).backward()
        if steps_optimizer(i % per_epoch, per_epoch, accumulate):
            optimizer.step()
            optimizer.zero_grad()
        params.append(flat_params(model))
    return params


def check_against_reference(records: list[dict], reference_model: TinyModel, expected_batches: list[list[int]],
                            accumulate: int = 1, epochs: int = 1) -> None:
    world = len(records)
    assert {len(r["indices"]) for r in records} == {len(expected_batches)}  # equal step counts
    for step, batch in enumerate(expected_batches):
        # The ranks' slices hold the global batch, plus at most one re-read sample per padding step.
        taken = [i for r in range(world) for i in records[r]["indices"][step]]
        assert set(batch) <= set(taken) and len(batch) <= len(taken) <= len(batch) + world, f"step {step}"
        for r in range(1, world):
            assert torch.equal(records[r]["params"][step], records[0]["params"][step])
    ref = reference_on_batches(reference_model, expected_batches, accumulate, epochs)
    diff = max(max_rel_diff(records[0]["params"][s], ref[s]) for s in range(len(ref)))
    print(f"{len(ref)} steps, {world} ranks: max rel diff to one process {diff:.2e}")
    assert diff <= 1e-6, diff


# -- unit level ------------------------------------------------------------------------------------------------------
def test_weighted_sampler_order_is_seeded_per_epoch_and_drawn_once():
    n = 30
    source = WeightedRandomSampler(_weights(n), num_samples=40)
    order = GlobalOrder(n, shuffle=False, seed=7, source=source)
    assert len(order) == 40
    first = list(order)
    assert list(order) == first  # drawn once per epoch: profiling or a second look does not advance anything
    expected = list(WeightedRandomSampler(_weights(n), 40, generator=torch.Generator().manual_seed(7)))
    assert first == expected and source.generator is None  # the user's sampler is left as it was
    order.set_epoch(1)
    assert list(order) == list(WeightedRandomSampler(_weights(n), 40, generator=torch.Generator().manual_seed(8)))
    # Training's global RNG stream is untouched by the draw.
    torch.manual_seed(0)
    a = torch.rand(1)
    torch.manual_seed(0)
    order.set_epoch(2)
    list(order)
    assert torch.equal(torch.rand(1), a)


def test_user_generator_advances_like_one_process_and_rewinds_on_restore():
    n = 20
    make = lambda: WeightedRandomSampler(_weights(n), 16, generator=torch.Generator().manual_seed(3))  # noqa: E731
    one_process = make()
    epochs = [list(one_process) for _ in range(3)]
    order = GlobalOrder(n, shuffle=False, source=make())
    sampler = HeteroBatchSampler(order, 8, [3, 1], rank=0, drop_last=False)
    seen = []
    for epoch in range(3):
        order.set_epoch(epoch)
        seen.append([i for b in sampler.global_batches() for i in b])
        if epoch == 1:
            saved = sampler.state_dict()
    assert seen == epochs
    # A resumed run (fresh generator) continues epoch 1 with epoch 1's order, and epoch 2 after it.
    order2 = GlobalOrder(n, shuffle=False, source=make())
    sampler2 = HeteroBatchSampler(order2, 8, [3, 1], rank=0, drop_last=False)
    list(order2)  # drawn before the restore (e.g. while the loader was built)
    sampler2.load_state_dict(saved)
    assert [i for b in sampler2.global_batches() for i in b] == epochs[1]
    order2.set_epoch(2)
    assert list(order2) == epochs[2]


class BucketBatchSampler(Sampler):
    """Groups indices of similar "length" (here: index % 3) into batches of varying size, order seeded per epoch."""

    def __init__(self, n: int, sizes: tuple[int, ...] = (9, 5, 7)) -> None:
        self.n, self.sizes, self.epoch = n, sizes, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(100 + self.epoch)
        batches = []
        for bucket in range(3):
            idx = [i for i in torch.randperm(self.n, generator=g).tolist() if i % 3 == bucket]
            size = self.sizes[bucket]
            batches += [idx[k:k + size] for k in range(0, len(idx), size)]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return iter([batches[p] for p in perm])

    def __len__(self) -> int:
        return sum(-(-len(range(b, self.n, 3)) // s) for b, s in zip(range(3), self.sizes))


def test_batch_source_splits_variable_batches_every_index_once():
    n, caps = 50, [5, 2, 1]
    source = BucketBatchSampler(n)
    samplers = [HeteroBatchSampler(GlobalOrder(n, False, source=source, batches=True), 9, caps, r, drop_last=False)
                for r in range(3)]
    for epoch in (0, 1):
        for s in samplers:
            s.sampler.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert {len(b) for b in per_rank} == {len(samplers[0])} == {len(source)}
        used = []
        for r, s in enumerate(samplers):
            for k, batch in enumerate(per_rank[r]):
                local, total = s.sizes_at(k)
                assert total == len(s.global_batches()[k]) and len(batch) == max(local, 1)
                used += batch[:local]
        assert sorted(used) == list(range(n))


# -- distributed fits --------------------------------------------------------------------------------------------------
class WeightedModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        n = self.hparams.n
        return DataLoader(IndexedDataset(n), batch_size=self.hparams.batch_size,
                          sampler=WeightedRandomSampler(_weights(n), num_samples=n + 7))


@pytest.mark.slow
def test_weighted_random_sampler_equals_one_process(tmp_path):
    """With replacement "every index once" does not apply: the global order is the one-process sampler's."""
    seed_everything(5)  # PL_GLOBAL_SEED=5: the sampler's generator is seeded 5 + epoch on every rank
    model = WeightedModel(n=40, batch_size=4)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=2)
    batches = []
    for epoch in range(2):
        order = list(WeightedRandomSampler(_weights(40), 47, generator=torch.Generator().manual_seed(5 + epoch)))
        batches += [order[i:i + 8] for i in range(0, len(order), 8)]
    for step, batch in enumerate(batches):  # exact order, slices in rank order
        assert records[0]["indices"][step] + records[1]["indices"][step] == batch
    assert [len(b) for b in records[0]["indices"][:6]] == [6] * 5 + [5]  # last global batch of 7: 5 + 2
    check_against_reference(records, reference_model, batches)


class SizedBuckets(BatchSampler):
    """A bucketing batch sampler in `BatchSampler`'s API: batches of one bucket (index % 3), sizes B-2, B, B+3."""

    def __iter__(self):
        buckets: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for i in self.sampler:
            bucket = buckets[i % 3]
            bucket.append(i)
            if len(bucket) == self.batch_size + (-2, 0, 3)[i % 3]:
                yield list(bucket)
                bucket.clear()
        for bucket in buckets.values():
            if bucket:
                yield list(bucket)


class BucketModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.hparams.n), batch_sampler=BucketBatchSampler(self.hparams.n))


class SizedBucketModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        dataset = IndexedDataset(self.hparams.n)
        return DataLoader(dataset, batch_sampler=SizedBuckets(torch.utils.data.RandomSampler(dataset), 6, False))


def _check_every_index_once(records: list[dict], epoch_batches: list[list[list[int]]], n: int) -> None:
    world, step = len(records), 0
    for batches in epoch_batches:
        assert sorted(i for b in batches for i in b) == list(range(n))
        for batch in batches:
            slices = [records[r]["indices"][step] for r in range(world)]
            assert {i for s in slices for i in s} == set(batch)
            # A batch smaller than the world runs zero-weight padding steps (one re-read sample on the idle ranks).
            assert sum(len(s) for s in slices) == max(len(batch), world)
            step += 1


@pytest.mark.slow
def test_custom_batch_sampler_batches_are_global_batches(tmp_path):
    """A batch sampler Lightning cannot re-instantiate runs with `use_distributed_sampler=False`."""
    seed_everything(0)
    model = BucketModel(n=50)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 3, {"capacities": [5, 2, 1]}, max_epochs=2,
                              use_distributed_sampler=False)
    source = BucketBatchSampler(50)
    epochs = []
    for epoch in range(2):
        source.set_epoch(epoch)
        epochs.append(list(source))
    _check_every_index_once(records, epochs, 50)
    check_against_reference(records, reference_model, [b for e in epochs for b in e])


@pytest.mark.slow
def test_batch_sampler_subclass_gets_the_global_order(tmp_path):
    """Lightning re-instantiates a `BatchSampler` subclass around a DistributedSampler; every rank draws the global
    order instead (seed + epoch), and the subclass's batches of 4, 6 and 9 are the global batches."""
    seed_everything(0)
    model = SizedBucketModel(n=50)
    reference_model = copy.deepcopy(model)
    records = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1]}, max_epochs=2)
    order = GlobalOrder(50, shuffle=True, seed=0)
    epochs = []
    for epoch in range(2):
        order.set_epoch(epoch)
        epochs.append(list(SizedBuckets(order, 6, False)))
    assert {len(b) for b in epochs[0]} >= {4, 6, 9}
    _check_every_index_once(records, epochs, 50)
    check_against_reference(records, reference_model, [b for e in epochs for b in e])


class Unseeded(Sampler):
    """A shuffle from fresh OS entropy: different on every rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        idx = list(range(self.n))
        random.Random().shuffle(idx)
        return iter(idx)

    def __len__(self) -> int:
        return self.n


class UnseededModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.hparams.n), batch_size=4, sampler=Unseeded(self.hparams.n))


@pytest.mark.slow
def test_non_reproducible_sampler_fails_on_every_rank(tmp_path):
    with pytest.raises(Exception, match="Unseeded drew a different order on rank.*not reproducible across ranks"):
        fit_distributed(UnseededModel(n=32), str(tmp_path), 2, {"capacities": [1, 1]}, max_epochs=1)


def test_global_batch_size_with_custom_batch_sampler_is_refused(tmp_path):
    with pytest.raises(Exception, match="global_batch_size.*custom batch sampler"):
        fit_distributed(SizedBucketModel(n=30), str(tmp_path), 2, {"capacities": [1, 1], "global_batch_size": 8},
                        max_epochs=1)


class GeneratorModel(TinyModel):
    """A sampler with the user's own seeded generator: it advances from epoch to epoch, as in one process."""

    def train_dataloader(self) -> DataLoader:
        n = self.hparams.n
        sampler = WeightedRandomSampler(_weights(n), n, generator=torch.Generator().manual_seed(21))
        return DataLoader(IndexedDataset(n), batch_size=self.hparams.batch_size, sampler=sampler)


def _fit_generator_model(out_dir: str, ckpt_dir: Optional[str] = None, ckpt_path: Optional[str] = None,
                         max_steps: int = -1) -> list[dict]:
    import lightning.pytorch as pl

    from lightning_hetero import HeteroDDPStrategy
    from tests.helpers import Recorder, free_port

    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    torch.manual_seed(0)
    callbacks: list = [Recorder(out_dir)]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=max_steps, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=3, max_steps=max_steps, callbacks=callbacks,
                         strategy=HeteroDDPStrategy(start_method="fork", observation={"print_table": False},
                                                    resilience={"timeout": 120}, capacities=[3, 1]),
                         logger=False, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(GeneratorModel(n=24, batch_size=4), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.slow
def test_user_generator_sampler_resumes_mid_epoch(tmp_path):
    """Epochs 0-2 are the generator's 1st-3rd draws; a checkpoint in epoch 1 resumes with that epoch's draw."""
    full = _fit_generator_model(str(tmp_path / "full"))
    one_process = WeightedRandomSampler(_weights(24), 24, generator=torch.Generator().manual_seed(21))
    orders = [list(one_process) for _ in range(3)]
    assert [i for k in range(9) for i in full[0]["indices"][k] + full[1]["indices"][k]] == sum(orders, [])
    first = _fit_generator_model(str(tmp_path / "first"), ckpt_dir=str(tmp_path / "ckpt"), max_steps=4)
    (ckpt,) = glob.glob(str(tmp_path / "ckpt" / "*step=4*.ckpt"))
    resumed = _fit_generator_model(str(tmp_path / "resumed"), ckpt_path=ckpt)
    for r in range(2):
        assert first[r]["indices"] + resumed[r]["indices"] == full[r]["indices"]
        assert torch.equal(resumed[r]["params"][-1], full[r]["params"][-1])
