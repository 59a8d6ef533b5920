"""Every argument of the strategy and of its typed configs is checked where it is given: a bad value raises a
``ValueError`` naming the field at construction, never silently later (or never)."""

import math
import warnings
import re

import pytest
import torch

from lightning_hetero.lab.emulation_spec import EmulationSpec

from lightning_hetero import (
    CastCompression,
    HeteroDDPStrategy,
    PowerSGDCompression,
    PrecisionPolicy,
    TopKCompression,
)

STRATEGY_CASES = [
    ({"start_method": "thread"}, "start_method"),
    ({"start_method": None}, "start_method"),
    ({"process_group_backend": "glooo"}, "process_group_backend"),
    ({"process_group_backend": "cpu:gloo,cuda:ncl"}, "process_group_backend"),
    ({"process_group_backend": 1}, "process_group_backend"),
    ({"ddp_kwargs": ["static_graph"]}, "ddp_kwargs"),
    ({"ddp_kwargs": {"bucket_cap": 25}}, "ddp_kwargs"),
    ({"ddp_kwargs": {"device_ids": [0]}}, "ddp_kwargs"),
    ({"ddp_kwargs": {"process_group": None}}, "ddp_kwargs"),
    ({"ddp_kwargs": {"static_graph": "yes"}}, "static_graph"),
    ({"ddp_kwargs": {"find_unused_parameters": 1}}, "find_unused_parameters"),
    ({"ddp_kwargs": {"bucket_cap_mb": 0}}, "bucket_cap_mb"),
    ({"ddp_kwargs": {"bucket_cap_mb": math.inf}}, "bucket_cap_mb"),
    ({"resilience": {"timeout": 0}}, "resilience.timeout"),
    ({"resilience": {"timeout": math.nan}}, "resilience.timeout"),
    ({"resilience": {"timeout": True}}, "resilience.timeout"),
    ({"resilience": {"timeout": "30"}}, "resilience.timeout"),
    ({"global_batch_size": 0}, "global_batch_size"),
    ({"global_batch_size": 8.0}, "global_batch_size"),
    ({"global_batch_size": True}, "global_batch_size"),
    ({"observation": {"print_table": "no"}}, "observation.print_table"),
    ({"observation": {"print_table": 0}}, "observation.print_table"),
    ({"rebalance": 1}, "rebalance"),
    ({"profiling": {"steps": 0}}, "profiling.steps"),
    ({"profiling": {"steps": 2.5}}, "profiling.steps"),
    ({"profiling": {"memory_headroom": 1.0}}, "profiling.memory_headroom"),
    ({"profiling": {"memory_headroom": -0.1}}, "profiling.memory_headroom"),
    ({"profiling": {"max_batch_per_rank": 0}}, "profiling.max_batch_per_rank"),
    ({"rebalance": {"every": 0}}, "rebalance.every"),
    ({"rebalance": {"threshold": 1.5}}, "rebalance.threshold"),
    ({"rebalance": {"smoothing": 0}}, "rebalance.smoothing"),
    ({"capacities": "fastest"}, "capacities"),
    ({"capacities": [1, True]}, "capacities"),
    ({"capacities": {"A100": -1}}, "capacities"),
    ({"emulate": "RTX3090"}, "emulate"),
    ({"emulate": ["GTX480"]}, "emulate"),
    ({"emulate": [{"sm_share": 2}]}, "sm_share"),
    ({"emulate": [{"slowdown": 0.5}]}, "slowdown"),
    ({"emulate": [{"link": "wifi"}]}, "link"),
    ({"emulate": [{"speed": 1}]}, "emulate"),
    ({"compression": "zip"}, "compression"),
    ({"compression": "fp16", "ddp_comm_hook": lambda s, b: b}, "compression"),
    ({"precision_policy": "fp8"}, "precision_policy"),
    ({"precision_policy": {"V100": "16"}}, "precision_policy"),
    ({"precision_policy": "auto", "precision_plugin": object()}, "precision_"),
    ({"ddp_comm_hook": "allreduce"}, "ddp_comm_hook"),
    ({"ddp_comm_wrapper": 3}, "ddp_comm_wrapper"),
    ({"parallel_devices": ["cpu"]}, "parallel_devices"),
    ({"parallel_devices": torch.device("cpu")}, "parallel_devices"),
    ({"cluster_environment": "slurm"}, "cluster_environment"),
    ({"checkpoint_io": "torch"}, "checkpoint_io"),
    ({"precision_plugin": "bf16-mixed"}, "precision_plugin"),
    ({"accelerator": 3}, "accelerator"),
]


@pytest.mark.parametrize(("kwargs", "field"), STRATEGY_CASES,
                         ids=[f"{f}-{i}" for i, (_, f) in enumerate(STRATEGY_CASES)])
def test_bad_strategy_argument_is_refused_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        HeteroDDPStrategy(**kwargs)


CONFIG_CASES = [
    (CastCompression, {"dtype": "fp8"}, "dtype"),
    (CastCompression, {"hierarchical": "yes"}, "hierarchical"),
    (CastCompression, {"group_by": "rack"}, "group_by"),
    (PowerSGDCompression, {"rank": 0}, "rank"),
    (PowerSGDCompression, {"rank": 2.0}, "rank"),
    (PowerSGDCompression, {"start_iter": 1}, "start_iter"),
    (PowerSGDCompression, {"start_iter": -1}, "start_iter"),
    (PowerSGDCompression, {"min_compression_rate": -1}, "min_compression_rate"),
    (PowerSGDCompression, {"min_compression_rate": True}, "min_compression_rate"),
    (PowerSGDCompression, {"orthogonalization_epsilon": math.nan}, "orthogonalization_epsilon"),
    (PowerSGDCompression, {"warm_start": 1}, "warm_start"),
    (PowerSGDCompression, {"error_feedback": None}, "error_feedback"),
    (PowerSGDCompression, {"seed": -1}, "seed"),
    (PowerSGDCompression, {"group_by": "node"}, "group_by"),
    (TopKCompression, {"ratio": 0}, "ratio"),
    (TopKCompression, {"ratio": True}, "ratio"),
    (TopKCompression, {"ratio": 1.5}, "ratio"),
    (TopKCompression, {"warmup_steps": -1}, "warmup_steps"),
    (TopKCompression, {"warmup_steps": 10, "ratio": 0.5, "warmup_ratio": 0.1}, "warmup_ratio"),
    (TopKCompression, {"error_feedback": "on"}, "error_feedback"),
    (TopKCompression, {"hierarchical": 1}, "hierarchical"),
    (EmulationSpec, {"preset": "GTX480"}, "EmulationSpec.preset"),
    (EmulationSpec, {"sm_share": 0}, "EmulationSpec.sm_share"),
    (EmulationSpec, {"memory_gib": -1}, "EmulationSpec.memory_gib"),
    (EmulationSpec, {"memory_gib": 8, "memory_fraction": 0.5}, "memory_fraction"),
    (EmulationSpec, {"capability": "seven"}, "EmulationSpec.capability"),
    (EmulationSpec, {"link": "wifi"}, "EmulationSpec.link"),
    (EmulationSpec, {"slowdown": True}, "EmulationSpec.slowdown"),
    (EmulationSpec, {"name": ""}, "EmulationSpec.name"),
    (PrecisionPolicy, {"rules": {}}, "rules"),
    (PrecisionPolicy, {"rules": {"A100": "fp16"}}, "precision_policy"),
    (PrecisionPolicy, {"rules": {"rank:x": "32-true"}}, "rank:x"),
    (PrecisionPolicy, {"tf32": "yes"}, "tf32"),
    (PrecisionPolicy, {"init_scale": 0}, "init_scale"),
    (PrecisionPolicy, {"init_scale": math.inf}, "init_scale"),
    (PrecisionPolicy, {"growth_interval": 0}, "growth_interval"),
    (PrecisionPolicy, {"growth_interval": True}, "growth_interval"),
]


@pytest.mark.parametrize(("config", "kwargs", "field"), CONFIG_CASES,
                         ids=[f"{c.__name__}-{f}-{i}" for i, (c, _, f) in enumerate(CONFIG_CASES)])
def test_bad_typed_config_is_refused_naming_the_field(config, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        config(**kwargs)


def test_good_values_are_accepted():
    """The checks refuse only what is wrong: every documented form is accepted."""
    for start_method in ("popen", "spawn", "fork", "forkserver"):
        HeteroDDPStrategy(start_method=start_method)
    for backend in (None, "gloo", "nccl", "cpu:gloo,cuda:nccl"):
        HeteroDDPStrategy(process_group_backend=backend)
    HeteroDDPStrategy(ddp_kwargs={"bucket_cap_mb": 25, "static_graph": True, "find_unused_parameters": False,
                                  "gradient_as_bucket_view": True, "broadcast_buffers": False})
    HeteroDDPStrategy(parallel_devices=[torch.device("cpu")] * 2, accelerator="cpu", resilience={"timeout": 30},
                      ddp_comm_hook=lambda state, bucket: bucket, observation={"print_table": False})
    assert EmulationSpec(capability="7.5", sm_share=1, preset="T4").capability == (7, 5)
    HeteroDDPStrategy(compression=TopKCompression(ratio=1, warmup_steps=5, warmup_ratio=1.0),
                      precision_policy=PrecisionPolicy(rules={"rank:0": "32-true", "*": "auto"}))


# One value per flat spelling of earlier releases, and the grouped spelling it folds into.
FLAT_SPELLINGS = {
    "profile_steps": 8, "memory_headroom": 0.2, "max_batch_per_rank": 16, "rebalance_every": 5,
    "rebalance_threshold": 0.1, "rebalance_smoothing": 0.5, "stream_mode": "shard", "balance": "tokens",
    "loss_denominator": "tokens", "micro_batch": 4, "timeout": 30.0, "resume": "auto", "monitor": True,
    "print_table": False,
}


def test_deprecated_flat_spellings_still_work_and_warn():
    """The only test that uses the flat spellings: each still gives the options of its grouped spelling, with a
    FutureWarning naming that spelling; a bad flat value names the flat argument."""
    from lightning_hetero.config import _FLAT

    assert set(FLAT_SPELLINGS) | {"sample_cost"} == set(_FLAT)  # sample_cost takes a callable: no YAML spelling
    for name, value in FLAT_SPELLINGS.items():
        group, field = _FLAT[name]
        # Flat rebalancing knobs apply only with rebalancing on.
        switched_on = {"rebalance": True} if group == "rebalance" else {}
        with pytest.warns(FutureWarning, match=re.escape(f"`{name}={value!r}` is deprecated") + f".*: write `{group}="):
            flat = HeteroDDPStrategy(**switched_on, **{name: value})
        assert flat.core.options == HeteroDDPStrategy(**{group: {field: value}}).core.options, name
    with pytest.raises(ValueError, match="`timeout`"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        HeteroDDPStrategy(timeout=0)
