"""The whole-tensor gather after a sharded fit, on ranks sharing a GPU over gloo: the shards gathered as CPU copies.

On a CUDA mesh of gloo groups, DTensor's own all-gather hands CUDA pointers to gloo's host code and the process dies
of SIGSEGV (``tests/gpu/repro_gloo_cuda_gather.py`` shows it on one GPU). Here, on CPU, each rank holds what
Lightning's teardown leaves: a DTensor whose mesh is a CUDA one and whose shard is on the CPU. The gather must not
touch the CUDA device (this build has none), and must give the whole tensor, uneven shards included.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_hetero.strategies.fsdp import _full_tensor
from tests.helpers import free_port
from tests.strategies._fsdp_worker import run_ranks

WHOLE = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)  # 5 rows over 2 ranks: shards of 3 and 2


def _gather_on_a_cuda_mesh(rank: int, world: int) -> list[list[float]]:
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("shard",))
    rows = WHOLE.tensor_split(world)[rank]
    # A meta shard keeps the CUDA mesh without a CUDA device; `empty_like` puts it on the CPU, as teardown's `.cpu()`.
    shard = DTensor.from_local(torch.empty(rows.shape, device="meta"), mesh, [Shard(0)], shape=WHOLE.shape,
                               stride=WHOLE.stride(), run_check=False)
    shard = torch.empty_like(shard, device="cpu")
    with torch.no_grad():
        shard.to_local().copy_(rows)
    assert shard.device.type == "cpu" and shard.device_mesh.device_type == "cuda"
    whole = _full_tensor(shard)
    assert whole.device.type == "cpu"
    return whole.tolist()


def test_a_gloo_mesh_gathers_cpu_shards_on_the_cpu_whatever_its_device_type() -> None:
    for whole in run_ranks(2, free_port(), _gather_on_a_cuda_mesh):
        assert whole == WHOLE.tolist()


def _gather_on_a_cpu_mesh(rank: int, world: int) -> list[list[float]]:
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("shard",))
    shard = DTensor.from_local(WHOLE.tensor_split(world)[rank].clone(), mesh, [Shard(0)], shape=WHOLE.shape,
                               stride=WHOLE.stride())
    return _full_tensor(shard).tolist()


def test_a_cpu_mesh_gathers_as_before() -> None:
    for whole in run_ranks(2, free_port(), _gather_on_a_cpu_mesh):
        assert whole == WHOLE.tolist()


def _gather_on_a_2d_cuda_mesh(rank: int, world: int) -> list[list[float]]:
    # HSDP's layout: replicate across (0, 2) and (1, 3), shard inside (0, 1) and (2, 3); every rank makes every group.
    replicate = {r: g for pair in ([0, 2], [1, 3]) for g in [dist.new_group(pair)] for r in pair}
    shard_groups = {r: g for pair in ([0, 1], [2, 3]) for g in [dist.new_group(pair)] for r in pair}
    mesh = DeviceMesh.from_group([replicate[rank], shard_groups[rank]], "cuda", mesh=[[0, 1], [2, 3]],
                                 mesh_dim_names=("replicate", "shard"))
    rows = WHOLE.tensor_split(2)[rank % 2]
    shard = DTensor.from_local(torch.empty(rows.shape, device="meta"), mesh, [Replicate(), Shard(0)],
                               shape=WHOLE.shape, stride=WHOLE.stride(), run_check=False)
    shard = torch.empty_like(shard, device="cpu")
    with torch.no_grad():
        shard.to_local().copy_(rows)
    return _full_tensor(shard).tolist()


def test_a_2d_gloo_mesh_gathers_on_a_cpu_mesh_over_the_same_groups() -> None:
    for whole in run_ranks(4, free_port(), _gather_on_a_2d_cuda_mesh):
        assert whole == WHOLE.tolist()
