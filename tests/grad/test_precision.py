"""Per-rank precision policies with one loss scale: resolver units and 2-process CPU fits (gloo, fork)."""

import copy
import math
import os
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins.precision import Precision

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.lab.devices import CAPABILITY_OVERRIDE_ENV, NAME_OVERRIDE_ENV, DeviceInfo, describe_device
from lightning_hetero.grad.precision import (
    HeteroMixedPrecision,
    PrecisionPolicy,
    build_precision_plugin,
    check_no_conflict,
    job_compute_dtype,
    parse_precision_policy,
    precision_column,
    resolve_precisions,
    resolve_rank_precision,
)
from tests.helpers import IndexedDataset, Recorder, TinyModel, fit_distributed, free_port


def _gpu(rank: int, name: str, cc: tuple[int, int]) -> DeviceInfo:
    return DeviceInfo(rank=rank, host="node", type="cuda", name=name, capability=cc, memory_bytes=2**34,
                      multiprocessors=80)


def _cpu(rank: int, cc: tuple[int, int] = (0, 0), name: str = "cpu") -> DeviceInfo:
    return DeviceInfo(rank=rank, host="node", type="cpu", name=name, capability=cc, memory_bytes=2**34,
                      multiprocessors=2)


# -- resolver --------------------------------------------------------------------------------------------------------
def test_auto_picks_fastest_safe_mode_from_capability() -> None:
    devices = [_gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0)), _gpu(1, "Tesla V100-SXM2-32GB", (7, 0)),
               _gpu(2, "NVIDIA H200", (9, 0)), _gpu(3, "Tesla T4", (7, 5)), _cpu(4), _cpu(5, cc=(7, 0))]
    policy = parse_precision_policy("auto")
    modes = resolve_precisions(policy, devices)
    assert modes == ("bf16-mixed", "16-mixed", "bf16-mixed", "16-mixed", "32-true", "16-mixed")
    column = precision_column(policy, devices, modes)
    assert column[0] == "bf16-mixed+scaler+tf32" and column[1] == "16-mixed+scaler" and column[4] == "32-true+scaler"
    assert precision_column(PrecisionPolicy(tf32=False), devices[:1], ("bf16-mixed",)) == ["bf16-mixed"]
    assert job_compute_dtype(modes) == torch.bfloat16 and job_compute_dtype(("32-true",) * 2) == torch.float32


def test_mapping_by_device_substring_and_rank() -> None:
    devices = [_gpu(0, "Tesla V100-PCIE-16GB", (7, 0)), _gpu(1, "NVIDIA A100 80GB PCIe", (8, 0)),
               _gpu(2, "NVIDIA GeForce RTX 3090", (8, 6)), _cpu(3)]
    rules = {"V100": "16-mixed", "A100": "bf16-mixed", "*": "32-true", "cpu": "bf16-mixed"}
    assert resolve_precisions(parse_precision_policy(rules), devices) == (
        "16-mixed", "bf16-mixed", "32-true", "bf16-mixed")
    # a rank key wins over any name; the longest name key wins over a shorter one
    rules2 = {"A100": "bf16-mixed", "A100 80GB": "32-true", "rank:0": "32-true", "*": "auto"}
    assert resolve_precisions(parse_precision_policy(rules2), devices) == (
        "32-true", "32-true", "bf16-mixed", "32-true")
    with pytest.raises(ValueError, match=r"rank 2 .*RTX 3090"):
        resolve_precisions(parse_precision_policy({"V100": "16-mixed", "A100": "auto", "cpu": "auto"}), devices)


def test_bf16_on_cc70_is_refused_by_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch may report emulated bf16 on pre-Ampere cards: the decision must come from the capability alone
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    policy = parse_precision_policy({"*": "bf16-mixed"})
    with pytest.raises(ValueError, match=r"rank 1 \('Tesla V100-SXM2-16GB'.*cc 7\.0\).*bf16"):
        resolve_rank_precision(policy, _gpu(1, "Tesla V100-SXM2-16GB", (7, 0)))
    with pytest.raises(ValueError, match=r"rank 3 .*cc 7\.5"):
        resolve_precisions(policy, [_gpu(r, "NVIDIA A100", (8, 0)) for r in range(3)] + [_gpu(3, "T4", (7, 5))])
    assert resolve_rank_precision(policy, _gpu(0, "NVIDIA A100", (8, 0))) == "bf16-mixed"
    assert resolve_rank_precision(policy, _cpu(0)) == "bf16-mixed"  # CPU autocast has bf16


def test_emulator_environment_selects_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAPABILITY_OVERRIDE_ENV, "7.0")
    monkeypatch.setenv(NAME_OVERRIDE_ENV, "Tesla V100 (emulated)")
    info = describe_device(torch.device("cpu"), rank=1)
    assert resolve_rank_precision(parse_precision_policy("auto"), info) == "16-mixed"
    assert resolve_rank_precision(parse_precision_policy({"v100": "32-true", "*": "auto"}), info) == "32-true"
    with pytest.raises(ValueError, match="rank 1"):
        resolve_rank_precision(parse_precision_policy("bf16-mixed"), info)


@pytest.mark.parametrize("bad", ["fp8", "bf16", {}, {"rank:x": "auto"}, {"A100": "bf16"}, {"": "auto"}, 3,
                                 PrecisionPolicy.__new__])
def test_bad_policy_is_a_value_error(bad: Any) -> None:
    if bad is PrecisionPolicy.__new__:
        with pytest.raises(ValueError, match="init_scale"):
            PrecisionPolicy(init_scale=0.0)
        with pytest.raises(ValueError, match="growth_interval"):
            PrecisionPolicy(growth_interval=0)
        with pytest.raises(ValueError, match="tf32"):
            PrecisionPolicy(tf32="yes")  # type: ignore[arg-type]
        return
    with pytest.raises(ValueError, match="precision_policy"):
        HeteroDDPStrategy(precision_policy=bad)


def test_policy_and_plugin_conflicts() -> None:
    with pytest.raises(ValueError, match="precision_policy.*precision_plugin"):
        HeteroDDPStrategy(precision_policy="auto", precision_plugin=Precision())
    policy = parse_precision_policy("auto")
    check_no_conflict(policy, Precision())  # the Trainer's default is fine
    from lightning.pytorch.plugins.precision import MixedPrecision
    with pytest.raises(ValueError, match="16-mixed"):
        check_no_conflict(policy, MixedPrecision("16-mixed", "cpu"))


def test_plugin_autocast_and_shared_scaler() -> None:
    policy = PrecisionPolicy(init_scale=1024.0)
    x = torch.randn(3, 3)
    plugins = [build_precision_plugin(policy, ("32-true", "16-mixed", "bf16-mixed"), r, "cpu") for r in range(3)]
    dtypes = []
    for plugin in plugins:
        with plugin.forward_context():
            dtypes.append((x @ x).dtype)
    assert dtypes == [torch.float32, torch.float16, torch.bfloat16]
    # every rank holds a scaler with the same settings, the fp32 and bf16 ranks too
    assert all(p.scaler is not None for p in plugins)
    assert {p.scaler.get_scale() for p in plugins} == {1024.0}
    assert all(build_precision_plugin(policy, ("32-true", "bf16-mixed"), r, "cpu").scaler is None for r in range(2))
    with pytest.raises(ValueError, match="scaler"):
        HeteroMixedPrecision("16-mixed", "cpu")
    plugins[0].load_state_dict({})  # a checkpoint from a job without fp16 ranks: nothing to restore


# -- 2-process fits ---------------------------------------------------------------------------------------------------
class ScaleModel(TinyModel):
    """TinyModel that records this rank's precision and loss scale after each step; optionally overflows once."""

    def __init__(self, out_dir: str = "", inf_rank: int = -1, inf_step: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir, self.inf_rank, self.inf_step = out_dir, inf_rank, inf_step
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.inf_rank and self.global_step == self.inf_step:
            loss = loss * math.inf
        return loss

    def _scale(self) -> Optional[float]:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return None if scaler is None else float(scaler.get_scale())

    def on_train_start(self) -> None:
        self.start_scale = self._scale()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.scales.append(self._scale())

    def on_train_end(self) -> None:
        torch.save({"scales": self.scales, "start_scale": self.start_scale, "precision": self.trainer.precision,
                    "table": self.trainer.strategy.lab.table(self.trainer.strategy.plan), "dtype": str(self.net[0].weight.dtype)},
                   os.path.join(self.out_dir, f"scale{self.global_rank}.pt"))


def _load_scales(out_dir: str) -> list[dict]:
    return [torch.load(os.path.join(out_dir, f"scale{r}.pt")) for r in range(2)]


def _full_loss(model: LightningModule, params: torch.Tensor) -> float:
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    data = IndexedDataset(model.hparams.n)
    with torch.no_grad():
        return float(model.loss((data.x, data.y, None)))


@pytest.mark.parametrize(
    ("modes", "trainer_kwargs"),
    [(("bf16-mixed", "16-mixed"), {}),
     (("32-true", "16-mixed"), {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05})],
)
def test_mixed_policies_keep_replicas_identical_and_match_fp32(tmp_path: Any, modes: tuple[str, str],
                                                               trainer_kwargs: dict) -> None:
    seed_everything(0)
    model = ScaleModel(out_dir=str(tmp_path), optimizer="adam")
    fp32_model = copy.deepcopy(model)
    rules = {"rank:0": modes[0], "rank:1": modes[1]}
    recs = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], "precision_policy": rules},
                           max_epochs=3, **trainer_kwargs)
    info = _load_scales(str(tmp_path))
    assert [i["precision"] for i in info] == list(modes)
    assert all(i["dtype"] == "torch.float32" for i in info)  # master weights stay fp32
    assert "16-mixed+scaler" in info[0]["table"] and "precision" in info[0]["table"]
    steps = len(recs[0]["params"])
    assert steps >= 10 and all(len(r["params"]) == steps for r in recs)
    for step in range(steps):
        assert torch.equal(recs[0]["params"][step], recs[1]["params"][step]), f"replicas differ after step {step}"
    assert info[0]["scales"] == info[1]["scales"] and info[0]["scales"][0] == 2.0**16

    ref_dir = tmp_path / "fp32"
    ref_dir.mkdir()
    fp32_model.out_dir = str(ref_dir)
    ref = fit_distributed(fp32_model, str(ref_dir), 2, {"capacities": [3, 1]}, max_epochs=3, **trainer_kwargs)
    start = _full_loss(model, recs[0]["params"][0])
    mixed_loss, fp32_loss = _full_loss(model, recs[0]["params"][-1]), _full_loss(model, ref[0]["params"][-1])
    print(f"{modes}: loss first step {start:.4f}, final mixed {mixed_loss:.5f}, fp32 {fp32_loss:.5f}")
    assert fp32_loss < start - 0.02  # training moved, so the comparison means something
    assert abs(mixed_loss - fp32_loss) <= 0.01 * fp32_loss


def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Any) -> None:
    seed_everything(0)
    k = 4
    model = ScaleModel(out_dir=str(tmp_path), inf_rank=1, inf_step=k)
    policy = {"rank:0": "32-true", "rank:1": "16-mixed"}
    recs = fit_distributed(model, str(tmp_path), 2, {"capacities": [1, 2], "precision_policy": policy},
                           max_epochs=1)
    scales = [i["scales"] for i in _load_scales(str(tmp_path))]
    for r in range(2):
        params = recs[r]["params"]
        assert torch.equal(params[k], params[k - 1]), f"rank {r} stepped on the overflowed step"
        assert not torch.equal(params[k + 1], params[k]) and not torch.equal(params[k - 1], params[k - 2])
        assert scales[r][: k] == [2.0**16] * k and scales[r][k] == 2.0**15 and scales[r][-1] == 2.0**15
    for step in range(len(recs[0]["params"])):
        assert torch.equal(recs[0]["params"][step], recs[1]["params"][step])


class _Checkpoint(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.save_checkpoint(self.path)  # every rank calls it, as Lightning requires


def _fit(model: LightningModule, out_dir: str, epochs: int, ckpt_in: Optional[str], ckpt_out: str) -> None:
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = HeteroDDPStrategy(start_method="fork", print_table=False, timeout=120, capacities=[1, 1],
                                 precision_policy=PrecisionPolicy(rules={"rank:0": "bf16-mixed", "*": "16-mixed"},
                                                                  init_scale=256.0, growth_interval=2))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                      callbacks=[Recorder(out_dir), _Checkpoint(ckpt_out)], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_in)


def test_scaler_state_survives_checkpoint_and_resume(tmp_path: Any) -> None:
    seed_everything(0)
    ckpt = str(tmp_path / "a.ckpt")
    _fit(ScaleModel(out_dir=str(tmp_path), n=32), str(tmp_path), 1, None, ckpt)
    first = _load_scales(str(tmp_path))
    saved = torch.load(ckpt, weights_only=False)["HeteroMixedPrecision"]
    assert saved["scale"] == first[0]["scales"][-1] == first[1]["scales"][-1] > 256.0  # it grew (interval 2)
    _fit(ScaleModel(out_dir=str(tmp_path), n=32), str(tmp_path), 2, ckpt, str(tmp_path / "b.ckpt"))
    resumed = _load_scales(str(tmp_path))
    assert resumed[0]["start_scale"] == resumed[1]["start_scale"] == saved["scale"]
    assert resumed[0]["scales"] == resumed[1]["scales"] and resumed[0]["scales"][0] >= saved["scale"]


def test_trainer_precision_conflicts_with_policy(tmp_path: Any) -> None:
    with pytest.raises(Exception, match="precision_policy"):
        fit_distributed(TinyModel(), str(tmp_path), 2, {"precision_policy": "auto"}, max_epochs=1,
                        precision="bf16-mixed")


class RankLocalGradModel(ScaleModel):
    """Also trains a tensor DDP does not know, so its gradient is rank-local: the inf check alone could disagree."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.local_bias = torch.zeros(1, requires_grad=True)  # not a Parameter: outside DDP's all-reduce

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = TinyModel.training_step(self, batch, batch_idx) + self.local_bias.sum()
        if self.global_rank == self.inf_rank and self.global_step == self.inf_step:
            loss = loss + math.inf * self.local_bias.sum()  # non-finite gradient on one rank only, never reduced
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.parameters(), self.local_bias], lr=self.hparams.lr)


def test_found_inf_is_reduced_over_ranks(tmp_path: Any) -> None:
    seed_everything(0)
    k = 3
    model = RankLocalGradModel(out_dir=str(tmp_path), inf_rank=1, inf_step=k)
    recs = fit_distributed(model, str(tmp_path), 2, {"precision_policy": {"rank:0": "bf16-mixed", "*": "16-mixed"}},
                           max_epochs=1)
    scales = [i["scales"] for i in _load_scales(str(tmp_path))]
    assert scales[0] == scales[1] and scales[0][k] == scales[0][k - 1] / 2
    for r in range(2):
        assert torch.equal(recs[r]["params"][k], recs[r]["params"][k - 1]), f"rank {r} stepped"
    for step in range(len(recs[0]["params"])):
        assert torch.equal(recs[0]["params"][step], recs[1]["params"][step])


@pytest.mark.parametrize(("yaml", "expected"), [
    ("precision_policy: auto", PrecisionPolicy()),
    ('precision_policy: {V100: 16-mixed, "rank:0": 32-true, "*": bf16-mixed}',
     PrecisionPolicy(rules={"V100": "16-mixed", "rank:0": "32-true", "*": "bf16-mixed"})),
    ('precision_policy: {rules: {"*": auto}, tf32: false, init_scale: 1024.0}',
     PrecisionPolicy(tf32=False, init_scale=1024.0)),
])
def test_policy_parses_from_yaml(yaml: str, expected: PrecisionPolicy) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(HeteroDDPStrategy, "strategy")
    strategy = parser.instantiate_classes(parser.parse_string("strategy:\n  " + yaml)).strategy
    assert strategy.core.precision.policy == expected
    with pytest.raises(SystemExit):  # not a precision mode: refused by the parser, not silently accepted
        parser.parse_string("strategy:\n  precision_policy: bf16")


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_shared_scale_composes_with_compression(tmp_path: Any, compression: str) -> None:
    """Scaled gradients through a compressing hook: replicas stay identical and an overflow is skipped everywhere."""
    seed_everything(0)
    k = 3
    model = ScaleModel(out_dir=str(tmp_path), inf_rank=0, inf_step=k)
    recs = fit_distributed(model, str(tmp_path), 2, {"capacities": [3, 1], "compression": compression,
                                                     "precision_policy": {"rank:0": "bf16-mixed", "*": "16-mixed"}},
                           max_epochs=1)
    scales = [i["scales"] for i in _load_scales(str(tmp_path))]
    assert scales[0] == scales[1] and scales[0][k] == scales[0][k - 1] / 2
    assert torch.equal(recs[0]["params"][k], recs[0]["params"][k - 1])
    assert not torch.equal(recs[0]["params"][k + 1], recs[0]["params"][k])
    for step in range(len(recs[0]["params"])):
        assert torch.equal(recs[0]["params"][step], recs[1]["params"][step]), f"replicas differ after step {step}"
