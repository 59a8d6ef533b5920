"""GPU checks on the device machine: ``python -m pytest -q tests/gpu -m gpu`` (skipped without 2 CUDA devices).

Each test runs tests/gpu/gpu_worker.py in a subprocess (the strategy's launchers must not re-execute pytest) and
asserts on the JSON it writes.
"""

import pytest
from gpu_common import run_worker

pytestmark = pytest.mark.gpu(2)



@pytest.mark.parametrize(("emulate", "micro"), [(False, False), (True, False), (True, True)],
                         ids=["plain", "green-context", "green-context-micro-batches"])
def test_unequal_batches_equal_one_process_on_the_global_batch(tmp_path, emulate, micro):
    """2 ranks, NCCL, fp32 (TF32 off), batches split [3, 1]: every step equals one process on the global batch,
    and the replicas are bit-identical after every step (``micro``: rank 0 runs its 12 samples as 3 micro-batches)."""
    result = run_worker("gpu_worker.py", tmp_path, "equivalence", *(["--emulate"] if emulate else []),
                        *(["--micro"] if micro else []))
    assert result["steps"][0] == result["steps"][1] == result["reference_steps"] > 0
    assert result["batch_sizes"][0] == [12, 4]  # G = 16 split 3 : 1
    assert result["same_global_batches"]
    assert result["replicas_identical_every_step"]
    print(f"\nGPU equivalence ({'green-context' if emulate else 'plain'}): {result['reference_steps']} steps, "
          f"max rel diff {result['max_rel_diff']:.2e}, replicas identical {result['replicas_identical_every_step']}")
    assert result["max_rel_diff"] < 1e-4, result["per_step_rel_diff"]  # GPU vs CPU fp32 summation order


def test_green_context_caps_the_whole_training_step(tmp_path):
    """A quarter of the SMs slows a matmul-bound Lightning training step ~4x. Were only the forward capped (the
    backward running on the full device), the step could slow at most ~2x."""
    result = run_worker("gpu_worker.py", tmp_path, "cap")
    print(f"\ngreen-context cap ({result['summary']}): training step {result['slowdown']:.2f}x slower")
    assert "SMs" in result["summary"] and "all SMs" not in result["summary"]
    assert result["slowdown"] > 2.5, result
    assert result["memory_cap_holds"] and result["below_cap_ok"]


def test_sharded_unequal_batches_equal_one_process_over_nccl(tmp_path):
    """HeteroFSDPStrategy on 2 real GPUs (FSDP2, reduce-scatter over NCCL), rank 1 emulated at a quarter of the SMs on
    a PCIe-class link, batches split [3, 1], fp32: every step equals one process on the global batch and the gathered
    parameters are bit-identical on both ranks."""
    result = run_worker("gpu_worker.py", tmp_path, "equivalence", "--emulate", "--sharded")
    assert result["sharded"] and result["steps"][0] == result["steps"][1] == result["reference_steps"] > 0
    assert result["batch_sizes"][0] == [12, 4]
    assert result["same_global_batches"] and result["replicas_identical_every_step"]
    print(f"\nGPU sharded equivalence: {result['reference_steps']} steps, max rel diff {result['max_rel_diff']:.2e}")
    assert result["max_rel_diff"] < 1e-4, result["per_step_rel_diff"]


@pytest.mark.gpu(4)
def test_hybrid_layout_equals_one_process_on_four_gpus(tmp_path):
    """HeteroHybridStrategy on 4 GPUs: ranks 0, 1 data-parallel, ranks 2, 3 one 2-stage pipeline (activations sent
    between GPUs by NCCL P2P), capacities [3, 2, 1, 1], AdamW, fp32: equal to one process on the global batches;
    the data-parallel replicas bit-identical, each stage's parameters bit-equal to theirs."""
    result = run_worker("gpu_worker.py", tmp_path, "hybrid")
    assert len(set(result["steps"])) == 1 and result["steps"][0] == result["reference_steps"] > 0
    assert all(result["owned"]) and not set(result["owned"][0]) & set(result["owned"][1])
    assert result["same_global_batches"]
    assert result["replicas_identical_every_step"]
    assert result["stages_equal_replicas"]
    print(f"\nGPU hybrid equivalence: {result['reference_steps']} steps, max rel diff {result['max_rel_diff']:.2e}")
    assert result["max_rel_diff"] < 1e-4, result["per_step_rel_diff"]


@pytest.mark.gpu(4)
@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_hybrid_stage_compression_between_emulated_hosts_on_four_gpus(tmp_path, method):
    """`stage_compression` top-k / PowerSGD on 4 GPUs as two emulated hosts (ranks 0, 1 data-parallel; 2, 3 the
    pipeline), the two-level stage exchange over NCCL: every copy of a stage bit-identical, the loss within 3 % of
    the exact run's (0.4 % on CPU), fewer bytes between hosts than the fp32 stage buffers."""
    result = run_worker("gpu_worker.py", tmp_path, "hybrid_compressed", "--stage-compression", method)
    print(f"\nGPU hybrid {method} between hosts: loss {result['loss_start']:.4f} -> exact {result['loss_exact']:.4f}, "
          f"compressed {result['loss_compressed']:.4f} ({result['loss_rel_to_exact']:+.2%}); "
          f"{result['inter_bytes_last_step']} B between hosts vs {result['fp32_stage_bytes']} B fp32")
    assert result["steps"] == result["reference_steps"] > 0
    assert result["replicas_identical"] and result["stages_equal_replicas"]
    assert abs(result["loss_rel_to_exact"]) <= 0.03
    assert result["inter_bytes_last_step"] < result["fp32_stage_bytes"] / 2


@pytest.mark.gpu(4)
def test_hybrid_pipelined_validation_on_four_gpus(tmp_path):
    """`pipelined_evaluation=True` on 4 GPUs (validation through the 2-stage pipeline, sanity check included): every
    rank's epoch `val_loss` is one process's, a stage rank holds its stage's parameters alone at every validation
    batch, and training still equals one process."""
    result = run_worker("gpu_worker.py", tmp_path, "hybrid_eval")
    assert result["steps"] == result["reference_steps"] > 0
    print(f"\nGPU pipelined validation: val max rel diff {result['val_max_rel_diff']:.2e}, "
          f"train {result['train_max_rel_diff']:.2e}, stage bytes {result['stage_held_bytes_at_validation']}")
    assert result["val_max_rel_diff"] <= 1e-5, (result["val_loss"], result["expected_val_loss"])
    assert result["train_max_rel_diff"] < 1e-4
    for own, held in zip(result["stage_own_bytes"], result["stage_held_bytes_at_validation"]):
        assert held and all(own <= h <= own + 64 for h in held), (own, held)
