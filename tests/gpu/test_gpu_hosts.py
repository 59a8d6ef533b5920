"""Two-level sync across emulated hosts on GPUs: ``python -m pytest -q tests/gpu/test_gpu_hosts.py -m gpu``.

Two GPUs on two emulated hosts (NCCL_HOSTID: NCCL's socket transport between them), the second GPU at a quarter of
the SMs, a paced 25 Gbit/s link; the strategy's two-level sync runs on a side stream.
"""

import pytest
from gpu_common import run_worker

pytestmark = pytest.mark.gpu(2)



def test_two_level_sync_across_emulated_hosts_equals_one_process(tmp_path):
    result = run_worker("hosts_worker.py", tmp_path, "--compression", "none-hierarchical")
    assert result["hosts"] == {"server": [0], "ws": [1]}
    assert result["steps"][0] == result["steps"][1] == result["reference_steps"] > 0
    assert result["replicas_identical_every_step"]
    assert result["max_rel_diff"] < 1e-4  # GPU vs CPU fp32 summation order, as the flat GPU equivalence test


def test_auto_compression_measures_the_link_between_emulated_hosts(tmp_path):
    result = run_worker("hosts_worker.py", tmp_path, "--compression", "auto")
    print("\n" + result["table"])
    assert result["replicas_identical_every_step"]
    assert "between hosts" in result["columns"]["link (measured)"][0]
    assert result["columns"]["compression"][0].startswith("auto: ")
