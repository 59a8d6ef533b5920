"""Several ranks on one GPU (an emulation mode): gloo, no device binding, a mesh over the world group."""

import pytest
import torch

from lightning_hetero import HeteroFSDPStrategy
from lightning_hetero.grad.sharding import device_mesh
from lightning_hetero.lab.shared_gpu import binds_device, one_gpu, shared_device_backend, shares_a_device
from tests.strategies._fsdp_worker import run_ranks
from tests.helpers import free_port

CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


def test_repeated_cuda_indices_share_a_device_cpu_ranks_do_not():
    assert one_gpu(2) == [CUDA0, CUDA0] and one_gpu(3, index=1) == [CUDA1] * 3
    assert shares_a_device(one_gpu(2)) and shares_a_device([CUDA0, torch.device("cuda")])  # no index: cuda:0
    assert not shares_a_device([CUDA0, CUDA1]) and not shares_a_device([CPU, CPU]) and not shares_a_device(None)
    assert not binds_device(one_gpu(2), CUDA0)  # gloo's new_group fails on a bound device
    assert binds_device([CUDA0, CUDA1], CUDA1) and not binds_device([CPU, CPU], CPU)
    with pytest.raises(ValueError, match="`ranks`=0 must be a positive integer"):
        one_gpu(0)


def test_ranks_sharing_a_gpu_get_gloo_and_nccl_is_refused():
    assert shared_device_backend(one_gpu(2), None) == "gloo"
    assert shared_device_backend([CUDA0, CUDA1], None) is None  # distinct GPUs: the default (NCCL) stays
    assert shared_device_backend([CPU, CPU], "gloo") == "gloo"
    strategy = HeteroFSDPStrategy(parallel_devices=one_gpu(2), emulate=[{"memory_gib": 52}, {"memory_gib": 22}])
    assert strategy._process_group_backend == "gloo"
    with pytest.raises(ValueError, match="`process_group_backend`='nccl' cannot run several ranks on one GPU"):
        HeteroFSDPStrategy(parallel_devices=one_gpu(2), process_group_backend="nccl")


def _mesh(rank: int, world: int) -> dict:
    mesh = device_mesh({"h": list(range(world))}, "cpu")
    return {"dims": mesh.mesh_dim_names, "size": mesh.size(), "world_group": mesh.get_group() is
            torch.distributed.group.WORLD or mesh.get_group().size() == world}


def test_the_one_host_mesh_is_the_world_group():
    results = run_ranks(2, free_port(), _mesh)
    assert results[0] == results[1] == {"dims": ("shard",), "size": 2, "world_group": True}
