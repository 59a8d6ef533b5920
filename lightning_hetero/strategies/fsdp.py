"""``HeteroFSDPStrategy``: sharded data parallelism (FSDP2) over unequal devices, exact like one device.

Everything that is not about where tensors live comes from the hetero strategy's shared machinery: capacities,
profiling, shares, rebalancing, data sources (samplers, streams, tokens), per-rank precision, monitoring, the
watchdog, emulation and per-rank checkpoint state. What this class adds:

1. ``setup``: each rank's memory mode is resolved (:mod:`lightning_hetero.plan.memory`), then the model is sharded
   (:func:`lightning_hetero.grad.sharding.shard_module`) before the optimizers are built on the shards;
2. ``backward``: the loss is scaled by b_r · W / G, so FSDP's averaging reduce-scatter yields the global batch's
   gradient (exact per micro-step, so gradient accumulation with partial batches is exact too);
3. ``block_backward_sync``: accumulation steps skip the reduce-scatter;
4. checkpoints are sharded directories written with torch's distributed checkpoint
   (:mod:`lightning_hetero.resilience.sharded`), resumable on another world size.
"""

import importlib
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_hetero.grad.precision import PrecisionPolicyArg
from lightning_hetero.grad.weighting import WeightingState
from lightning_hetero.grad.sharding import (
    default_blocks,
    device_mesh,
    is_sharded,
    loss_weight,
    mixed_precision,
    set_gradient_sync,
    shard_module,
)
from lightning_hetero.plan.capacity import CapacitiesArg
from lightning_hetero.plan.memory import (
    MemoryPolicy,
    MemoryPolicyArg,
    ModelFootprint,
    RankMemory,
    device_budget,
    memory_column,
    optimizer_slots,
    parse_memory_policy,
    resolve_memory,
)
from lightning_hetero.resilience.checkpoint import reopen_interrupted_epoch
from lightning_hetero.resilience.sharded import is_sharded_checkpoint, load_sharded, save_sharded
from lightning_hetero.data.streaming import StreamMode
from lightning_hetero.data.tokens import Balance, Denominator
from lightning_hetero.strategies.ddp import HeteroDDPStrategy, StartMethod

# PORT: on the shared core this becomes `ParallelStrategy` + `HeteroCore`; the DDP strategy is the base for now only
# for its data, shares, precision and fault machinery (no DDP wrapper or comm hook is used here).


class HeteroFSDPStrategy(HeteroDDPStrategy):
    """Sharded training over unequal devices: per-rank batch shares, per-rank memory modes, one device's math.

    Args (the hetero arguments are :class:`~lightning_hetero.HeteroDDPStrategy`'s, same meaning):
        memory: what each rank keeps in device memory: ``"auto"`` (the fastest mode that fits, rank by rank),
            ``"keep"``, ``"checkpoint"`` (activation checkpointing), ``"offload"`` (shard and optimizer state in host
            memory), ``"checkpoint_offload"``, a mapping from device-name substring or ``"rank:N"`` to one of those, or
            a :class:`~lightning_hetero.plan.memory.MemoryPolicy`. A job that cannot fit fails before its first
            step, with every rank's numbers.
        blocks: dotted class paths (``"mypkg.model.Block"``) of the modules to shard one by one (one all-gather each).
            Default: the entries of the model's ``nn.ModuleList`` s, else every module with parameters of its own.
            A model that shards itself in ``configure_model`` is left as it is.
        hybrid: on several hosts with equal GPU counts, shard inside each host and replicate across hosts (HSDP), so
            only one gradient all-reduce crosses the slow link. Unequal hosts shard over all ranks.
    """

    strategy_name = "hetero_fsdp"

    def __init__(
        self,
        memory: MemoryPolicyArg = "auto",
        blocks: Optional[list[str]] = None,
        hybrid: bool = True,
        capacities: CapacitiesArg = "auto",
        global_batch_size: Optional[int] = None,
        timeout: float = 1800.0,
        start_method: StartMethod = "popen",
        process_group_backend: Optional[str] = None,
        print_table: bool = True,
        profile_steps: int = 4,
        memory_headroom: float = 0.1,
        max_batch_per_rank: Optional[int] = None,
        rebalance: bool = False,
        rebalance_every: int = 20,
        rebalance_threshold: float = 0.05,
        rebalance_smoothing: float = 0.5,
        monitor: bool = False,
        emulate: Optional[list[Union[str, dict[str, Any], None]]] = None,
        precision_policy: Optional[PrecisionPolicyArg] = None,
        stream_mode: StreamMode = "exact",
        resume: Optional[str] = None,
        balance: Balance = "samples",
        loss_denominator: Denominator = "samples",
        sample_cost: Optional[str] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self._memory_policy = parse_memory_policy(memory)
        self._block_paths = _check_blocks(blocks)
        if not isinstance(hybrid, bool):
            raise ValueError(f"`hybrid`={hybrid!r} must be True or False.")
        self._hybrid = hybrid
        self._memory_plan: Optional[list[RankMemory]] = None
        self._footprint: Optional[ModelFootprint] = None
        self._loss_factor = 1.0  # b_r · W / G of the running step
        self._full_state_hook: Optional[Any] = None
        super().__init__(
            capacities=capacities, global_batch_size=global_batch_size, timeout=timeout, start_method=start_method,
            process_group_backend=process_group_backend, print_table=print_table, profile_steps=profile_steps,
            memory_headroom=memory_headroom, max_batch_per_rank=max_batch_per_rank, rebalance=rebalance,
            rebalance_every=rebalance_every, rebalance_threshold=rebalance_threshold,
            rebalance_smoothing=rebalance_smoothing, monitor=monitor, emulate=emulate,
            precision_policy=precision_policy, stream_mode=stream_mode, resume=resume, accelerator=accelerator,
            parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, balance=balance, loss_denominator=loss_denominator,
            sample_cost=sample_cost,
        )

    @property
    def memory_policy(self) -> MemoryPolicy:
        return self._memory_policy

    @property
    def blocks(self) -> Optional[tuple[type[nn.Module], ...]]:
        """The block classes given by ``blocks`` (``None``: chosen from the model at setup)."""
        return None if self._block_paths is None else tuple(_import_class(p) for p in self._block_paths)

    @property
    def memory_plan(self) -> Optional[list[RankMemory]]:
        """Every rank's memory mode and estimate (after setup)."""
        return self._memory_plan

    # -- sharding -------------------------------------------------------------------------------------------------
    @override
    def model_to_device(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            super().model_to_device()
        # Fitting: `fully_shard` places each shard (on the device, or in host memory when offloaded); moving the whole
        # model first would need it to fit the smallest card.

    @override
    def configure_ddp(self) -> None:
        module = self.lightning_module
        blocks = self._block_classes(module)
        self._footprint = ModelFootprint.of(module, blocks, optimizer_slots(None))
        self._memory_plan = self._plan_memory(self._estimated_samples())
        mine = self._memory_plan[self.global_rank]
        mesh = device_mesh(self.lab.hosts if self._hybrid else {"all": range(self.world_size)}, self.root_device.type)
        modes = self._precision_modes or (str(getattr(self.precision_plugin, "precision", "32-true")),) * self.world_size
        shard_module(module, mesh, blocks, checkpoint="checkpoint" in mine.mode, offload="offload" in mine.mode,
                     mp_policy=mixed_precision(modes))
        self.add_lab_columns({"memory": memory_column(self._memory_plan, self._memory_policy)})
        # Counts each step's samples for the share controller and logging; no comm hook: the loss carries the weight.
        self._weighting = WeightingState(self.world_size)

    def _block_classes(self, module: nn.Module) -> tuple[type[nn.Module], ...]:
        return self.blocks or default_blocks(module)

    def _estimated_samples(self) -> list[int]:
        """Per-rank samples per step for the memory plan: the capacity share of ``global_batch_size`` (0 when it is
        not known yet; the plan is checked again with the real shares before the first step)."""
        total = self._global_batch_size or 0
        weights = self.lab.capacities
        return [round(total * w / sum(weights)) for w in weights]

    def _plan_memory(self, samples: list[int]) -> list[RankMemory]:
        assert self._footprint is not None
        devices = self.lab.devices
        budgets = [device_budget(d, self._memory_policy.headroom) for d in devices]
        shard_ranks = len(next(iter(self.lab.hosts.values()))) if self._hybrid and _equal_hosts(self.lab.hosts) \
            else self.world_size
        return resolve_memory(self._memory_policy, self._footprint, devices, samples, budgets, shard_ranks)

    @override
    def on_train_start(self) -> None:
        """Before the first step: the memory plan again, with the real shares and optimizer (fails with numbers)."""
        super().on_train_start()
        sampler = self.train_batch_sampler
        if sampler is None or self._footprint is None or self._memory_plan is None:
            return
        slots = optimizer_slots(self.optimizers[0] if self.optimizers else None)
        self._footprint = ModelFootprint(self._footprint.parameter_bytes, self._footprint.largest_block_bytes,
                                         self._footprint.blocks, slots)
        chosen = {p.rank: p.mode for p in self._memory_plan}
        policy = self._memory_policy
        # The modes are in place (sharding is done): check them, do not choose again.
        self._memory_policy = replace(policy, rules={f"rank:{r}": m for r, m in chosen.items()})
        try:
            self._memory_plan = self._plan_memory([int(b) for b in sampler.split_at(0, sampler.global_batch_len(0))])
        finally:
            self._memory_policy = policy

    # -- gradient path --------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        sampler = self.train_batch_sampler
        if sampler is not None:
            local, total = sampler.sizes_at(batch_idx)
            self._loss_factor = loss_weight(local, total, self.world_size)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        return super().backward(closure_loss * self._loss_factor, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        set_gradient_sync(self.lightning_module, False)
        try:
            yield
        finally:
            set_gradient_sync(self.lightning_module, True)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards load into the sharded model and its optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards are written by `save_checkpoint`

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        trainer = self.lightning_module.trainer
        if self.train_batch_sampler is not None:
            reopen_interrupted_epoch(checkpoint, self.train_batch_sampler.sampler.epoch, self._shares.position,
                                     trainer.num_training_batches)
        path = self.broadcast(str(filepath))
        with self._in_phase("checkpoint"):
            # A checksum manifest (resilience.checkpoint) plugs in as `before_publish`.
            save_sharded(path, checkpoint, self.lightning_module, [o for o in self.optimizers], self.global_rank,
                         self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        if is_sharded_checkpoint(path):
            return load_sharded(path, self.lightning_module, list(self.optimizers),
                                strict=self.lightning_module.strict_loading)
        return super().load_checkpoint(path, weights_only=weights_only)  # a full file (e.g. from one device)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # a full file: every rank keeps its shard of it
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.lightning_module, checkpoint["state_dict"],
                                 options=StateDictOptions(full_state_dict=True, strict=strict))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        module = self._lightning_module
        if module is not None and is_sharded(module) and self._full_state_hook is None:
            # After fit, `state_dict()` returns whole tensors, as after DDP (the in-process launchers hand rank 0's to
            # the main process). A collective: every rank calls it, as those launchers do.
            self._full_state_hook = module.register_state_dict_post_hook(_gather_whole_tensors)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("hetero_fsdp", "popen"), ("hetero_fsdp_spawn", "spawn"), ("hetero_fsdp_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"Sharded (FSDP2) training over unequal GPUs, "
                                           f"start method '{start_method}'", start_method=start_method)


def _gather_whole_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[name] = value.full_tensor()


def _equal_hosts(hosts: dict[str, tuple[int, ...]]) -> bool:
    return len(hosts) > 1 and len({len(r) for r in hosts.values()}) == 1


def _check_blocks(blocks: Optional[list[str]]) -> Optional[tuple[str, ...]]:
    if blocks is None:
        return None
    if isinstance(blocks, str) or not isinstance(blocks, (list, tuple)) or not blocks or not all(
        isinstance(b, str) and "." in b for b in blocks
    ):
        raise ValueError(f"`blocks`={blocks!r} must be None or a non-empty list of dotted class paths "
                         "('package.module.Class').")
    return tuple(blocks)


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"`blocks` entry {path!r} is not an nn.Module class.")
    return found
