"""Inputs that used to train with no word or end in a bare error: each is answered with the argument's name."""

import pytest
import torch

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler, check_training_batch
from lightning_hetero.data.tokens import dataset_costs, import_cost_fn
from lightning_hetero.plan.split import split_batch
from tests.helpers import TinyModel, fit_distributed


def test_capacities_that_overflow_their_sum_are_refused():
    with pytest.raises(ValueError, match=r"`capacities` = \[1e\+308, 1e\+308\] sum to more than a float holds"):
        HeteroDDPStrategy(capacities=[1e308, 1e308])
    assert split_batch(8, [1e300, 1e300]) == [4, 4]  # large but summable weights still split


def test_a_sample_cost_that_fails_names_itself_and_the_item():
    tuples = [(torch.ones(3), 1)] * 4
    cost = import_cost_fn("os.system")  # takes one argument: accepted, and fails on a tuple
    with pytest.raises(ValueError, match=r"sample cost posix.system failed on dataset item 0 \(tuple\): TypeError"):
        dataset_costs(tuples, cost, 0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"`sample_cost`='os.getcwd' must take one argument"):
        import_cost_fn("os.getcwd")
    with pytest.raises(ValueError, match=r"`sample_cost`='math.pi' is not callable"):
        import_cost_fn("math.pi")
    assert dataset_costs(tuples, import_cost_fn("builtins.len"), 0, 1, torch.device("cpu")) == [2.0] * 4


def _sampler(n: int, global_batch: int, drop_last: bool = False) -> HeteroBatchSampler:
    return HeteroBatchSampler(GlobalOrder(n, shuffle=False, seed=0), global_batch, [1, 1], rank=0, drop_last=drop_last)


def test_a_global_batch_larger_than_the_dataset():
    with pytest.raises(ValueError, match=r"`global_batch_size`=1000000000 is larger than train_dataloader's dataset "
                                         r"\(256 samples\): every epoch would be one batch of 256"):
        check_training_batch(_sampler(256, 10**9), "train_dataloader", explicit=True)
    with pytest.raises(ValueError, match=r"no batch at all \(drop_last=True\)"):
        check_training_batch(_sampler(256, 300, drop_last=True), "train_dataloader", explicit=True)
    with pytest.warns(UserWarning, match=r"the global batch \(300 = the loader's batch_size x 2 ranks\) is larger"):
        check_training_batch(_sampler(256, 300), "train_dataloader", explicit=False)
    check_training_batch(_sampler(256, 256), "train_dataloader", explicit=True)  # the whole set: fine


@pytest.mark.parametrize(("n", "advice"), [
    (0, r"every epoch would be no batch at all\. Give train_dataloader samples\."),
    (1, r"at least one sample per rank \(2\): use more samples or fewer ranks"),
    (2, r"Set `global_batch_size` to 2\."),
    (5, r"Set `global_batch_size` between 2 \(one sample per rank\) and 5\."),
])
def test_the_advice_for_a_global_batch_larger_than_the_dataset_is_one_the_strategy_accepts(n, advice):
    """An empty (or tiny) training set was told to "Set `global_batch_size` <= 0" (or 1 on 2 ranks), which the
    argument check (a positive integer) and the share plan (a sample per rank) refuse."""
    with pytest.raises(ValueError, match=advice) as err:
        check_training_batch(_sampler(n, 8), "train_dataloader", explicit=True)
    assert "<=" not in str(err.value)


def test_the_advice_names_a_global_batch_the_least_share_accepts():
    """With BatchNorm trained unsynced every rank needs 2 samples: "between 2 and 5" was advice the schedule
    refuses."""
    sampler = _sampler(5, 8)
    sampler.schedule.set_min_share(2)
    with pytest.raises(ValueError, match=r"Set `global_batch_size` between 4 \(2 samples per rank\) and 5\."):
        check_training_batch(sampler, "train_dataloader", explicit=True)
    sampler = _sampler(3, 8)
    sampler.schedule.set_min_share(2)
    with pytest.raises(ValueError, match=r"at least 2 samples per rank \(2\): use more samples"):
        check_training_batch(sampler, "train_dataloader", explicit=True)


@pytest.mark.slow
def test_a_fit_with_a_global_batch_larger_than_the_dataset_stops_at_once(tmp_path):
    with pytest.raises(Exception, match=r"`global_batch_size`=1000000000 is larger than train_dataloader's dataset"):
        fit_distributed(TinyModel(n=64), str(tmp_path), 2, {"capacities": "equal", "global_batch_size": 10**9},
                        max_epochs=1)
