"""``HeteroDDPStrategy``: DDP where every rank trains on a share of the global batch that matches its speed.

Lifecycle (what this class adds to Lightning's ``DDPStrategy``):

1. ``setup_environment``: after the process group exists, every rank reports its device, the capacities are
   resolved and the device-class / host process groups are built.
2. ``process_dataloader``: each loader is rebuilt around a :class:`HeteroBatchSampler`, so the user's
   ``DataLoader(batch_size=B)`` keeps its DDP meaning (global batch G = B × world size) but rank r loads b_r ∝ c_r.
   Any reproducible sampler or batch sampler supplies the global order; a stream is split by
   :mod:`lightning_hetero.data.streaming`.
3. ``_register_ddp_hooks``: the weighting hook (any device type) scales each rank's gradient by b_r / G; the
   user's comm hook, if any, runs inside it.
4. ``on_train_batch_start`` / ``optimizer_step``: count the step's samples into the weight, then reset it.
5. ``reduce``: inside a step, ``self.log(..., sync_dist=True)`` means are weighted by local batch size.
"""

import inspect
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

from lightning_hetero._compat import IndexBatchSamplerWrapper as _IndexBatchSamplerWrapper
from lightning_hetero._compat import init_dist_connection as _init_dist_connection
from lightning_hetero._compat import weights_only_argument  # [docs-ci] Lightning 2.5 support
from lightning_hetero.grad.autocompress import AutoCompression, choose, link_column, measure_links
from lightning_hetero.plan.capacity import CapacitiesArg, parse_capacities, resolve_static_capacities
from lightning_hetero.resilience.checkpoint import (
    AtomicCheckpointIO,
    check_trainer_checkpoint,
    newest_checkpoint,
    reopen_interrupted_epoch,
)
from lightning_hetero.grad.compression import CompressionArg, GradientCompression, describe_compression, parse_compression
from lightning_hetero.lab.devices import DeviceInfo, describe_device
from lightning_hetero.lab.emulation import (
    Emulator,
    LinkPacer,
    PacedState,
    lab_warning,
    paced_hook,
    parse_emulate,
    start_emulation,
)
from lightning_hetero.lab.environments import PerNodeTorchElasticEnvironment
from lightning_hetero.resilience.faults import FaultMonitor, rendezvous
from lightning_hetero.lab.groups import HeteroLab, LabGroups, build_groups, gather_devices
from lightning_hetero.data.microbatch import (
    MicroBatchArg,
    PendingGrads,
    chunk_sizes,
    micro_limits,
    parse_micro_batch,
    run_micro_batches,
)
from lightning_hetero.grad.precision import (
    PrecisionPolicyArg,
    apply_tf32,
    build_precision_plugin,
    check_no_conflict,
    job_compute_dtype,
    parse_precision_policy,
    precision_column,
    resolve_precisions,
)
from lightning_hetero.plan.rebalance import ShareController, validate_tuning
from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler
from lightning_hetero.data.streaming import STREAM_MODES, StreamMode, build_stream_loader
from lightning_hetero.resilience.state import RandomState, RankStateCallback
from lightning_hetero.data.tokens import Balance, Denominator, dataset_costs, resolve_cost_fn
from lightning_hetero.grad.weighting import WeightingState, weighted_allreduce_hook

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class HeteroDDPStrategy(DDPStrategy):
    """Data-parallel training over unequal devices, with the math of one device on the global batch.

    Args:
        capacities: relative speed of each rank: a list (one per global rank), a mapping from device-name
            substring to weight (``{"A100": 3, "3090": 1, "*": 1}``), or ``"equal"``, ``"peak"`` (published rates),
            ``"profile"`` (measured on the model), ``"auto"`` (best available).
        global_batch_size: samples per optimizer step over all ranks. Default: the loader's ``batch_size`` × world
            size, which is what plain DDP trains on, so hyper-parameters transfer unchanged.
        ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view`` ...).
        timeout: seconds a collective may wait, a rank may make no progress, or a rank may take to join, before every
            rank fails naming the cause (rank, host, device, step, phase). See :mod:`lightning_hetero.resilience.faults`.
        print_table: rank 0 prints the lab table once.
        profile_steps: timed steps per batch size when ``capacities`` is ``"profile"``/``"auto"`` (after 5 warm-up
            steps; at half and all of an equal share, then at a rank's own share if that is far from both). See
            :mod:`lightning_hetero.plan.profiling`.
        memory_headroom: fraction of each CUDA device's memory kept free when profiling derives how many samples a
            rank can hold (its "mem cap"); the split never gives a rank more.
        max_batch_per_rank: an explicit cap on any rank's samples per step (CPU ranks have no measured cap).
        rebalance: re-derive shares while training from each rank's measured compute time per sample.
        rebalance_every: batches between measurement exchanges (one ``all_gather`` each).
        rebalance_threshold: change shares only when the measured rates predict the new split to shorten the step by
            more than this fraction.
        rebalance_smoothing: weight of the newest measurement in the moving average of throughput (1: no smoothing).
        monitor: add a :class:`~lightning_hetero.observe.monitor.HeteroMonitor` (unless one is among the callbacks): per-rank
            compute, wait, data and communication time logged through the Trainer's logger, and a summary at the end.
        emulate: emulate a mixed lab on identical devices, one entry per rank: a preset name (``"A100-40GB"``,
            ``"RTX3090"``, ``"V100"``, ``"T4"`` ...), a dict (``{"sm_share": 0.25, "memory_gib": 24, "link": "pcie",
            "capability": "7.0", "name": ..., "slowdown": 3}``) or ``None`` (the real device). See
            :mod:`lightning_hetero.lab.emulation`.
        compression: gradient compression on the wire: ``"none"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"topk"``
            or a :class:`~lightning_hetero.CastCompression` / ``PowerSGDCompression`` / ``TopKCompression``
            (``hierarchical=True``: compress only between hosts or device classes). Bytes sent per optimizer step:
            ``comm_bytes_last_step``, logged as ``comm/bytes``.
        precision_policy: per-rank mixed precision with one loss scale for the job: ``"auto"`` (bf16 on compute
            capability >= 8.0, fp16 + loss scaling below, fp32 on CPU), one mode for all, a mapping from device-name
            substring or ``"rank:N"`` to a mode, or a :class:`~lightning_hetero.grad.precision.PrecisionPolicy`.
            ``None``: the Trainer's precision. When set, leave ``Trainer(precision=...)`` at its default.
        stream_mode: how a loader over an ``IterableDataset`` (LitData's ``StreamingDataset``, any stream) is split:
            ``"exact"`` (every rank reads the whole stream and keeps its share of each global batch: one device's
            training, at the cost of reading everything on every rank) or ``"shard"`` (each rank reads its own shard
            and takes its share per step; exhausted ranks pad with zero-weight steps). See
            :mod:`lightning_hetero.data.streaming`.
        resume: ``"auto"``: ``fit`` without ``ckpt_path`` goes on from the newest checkpoint in the ``dirpath`` of the
            trainer's ``ModelCheckpoint`` callbacks (none there: a fresh start); a directory: the newest checkpoint
            in it. A re-run of the same command (or ``torchrun --max-restarts``) then continues where the last
            checkpoint stood, also on a different number or kind of devices. ``None``: Lightning's ``ckpt_path`` only.
        ddp_comm_hook: a torch comm hook; it receives the weighted gradient.
        ddp_comm_state: the state passed to ``ddp_comm_hook``.
        ddp_comm_wrapper: a wrapper around ``ddp_comm_hook`` (torch's fp16/bf16 compress wrappers).

    Checkpoints are written atomically (:class:`~lightning_hetero.resilience.checkpoint.AtomicCheckpointIO`) unless a
    ``checkpoint_io`` is given.
        balance: ``"samples"`` splits each training batch by sample count; ``"tokens"`` by summed per-sample cost
            (sequence length), so each rank's tokens match its capacity; ``"padded_tokens"`` by sample count times
            the longest sample (a collate that pads). See :mod:`lightning_hetero.data.tokens`.
        loss_denominator: what the training loss averages over: ``"samples"`` (gradient weight b_r / G) or
            ``"tokens"`` (t_r / T, with the per-sample cost as the token count).
        sample_cost: dotted path ``"package.module.function"`` of a function sample -> cost. Default: the dataset's
            ``lengths``, else the LightningModule's ``sample_cost(sample)``, else the length of the first sequence
            tensor of each sample.
        micro_batch: run a rank's share as micro-batches with local accumulation when it exceeds this many samples:
            an int (every rank), a list (one per rank) or ``"auto"`` (the profiled memory cap, or
            ``max_batch_per_rank``). Shares are then split by capacity alone, never capped. See
            :mod:`lightning_hetero.data.microbatch`.
    """

    strategy_name = "hetero_ddp"

    def __init__(
        self,
        capacities: CapacitiesArg = "auto",
        global_batch_size: Optional[int] = None,
        ddp_kwargs: Optional[dict[str, Any]] = None,
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
        compression: CompressionArg = "none",
        precision_policy: Optional[PrecisionPolicyArg] = None,
        stream_mode: StreamMode = "exact",
        resume: Optional[str] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        balance: Balance = "samples",
        loss_denominator: Denominator = "samples",
        sample_cost: Optional[str] = None,
        micro_batch: Optional[MicroBatchArg] = None,
    ) -> None:
        if balance not in ("samples", "tokens", "padded_tokens"):
            raise ValueError(f"`balance`={balance!r} must be 'samples', 'tokens' or 'padded_tokens'.")
        if loss_denominator not in ("samples", "tokens"):
            raise ValueError(f"`loss_denominator`={loss_denominator!r} must be 'samples' or 'tokens'.")
        if sample_cost is not None and not isinstance(sample_cost, str):
            raise ValueError(f"`sample_cost`={sample_cost!r} must be a dotted path 'package.module.function' or None.")
        self._balance, self._loss_denominator, self._sample_cost = balance, loss_denominator, sample_cost
        self._micro_batch = parse_micro_batch(micro_batch)
        self._micro_limit: Optional[int] = None  # this rank's samples per forward/backward (None: whole share)
        self._pending_grads: Optional[PendingGrads] = None
        self._step_weights: Optional[list[float]] = None  # per sample of the current training batch
        self._capacity_spec = parse_capacities(capacities)
        self._emulate = parse_emulate(emulate)
        self._emulator: Optional[Emulator] = None
        self._compression_config = parse_compression(compression)
        self._compression_request = self._compression_config  # "auto" is resolved at setup, per fit
        if self._compression_config is not None and (ddp_comm_hook is not None or ddp_comm_wrapper is not None):
            raise ValueError("`compression` and `ddp_comm_hook`/`ddp_comm_wrapper` both own the gradient hook.")
        self._compression: Optional[GradientCompression] = None
        self._precision_policy = parse_precision_policy(precision_policy)
        if self._precision_policy is not None and precision_plugin is not None:
            raise ValueError("`precision_policy` and `precision_plugin` both set the precision: pass only one.")
        self._precision_modes: Optional[tuple[str, ...]] = None
        if global_batch_size is not None and (
            isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1
        ):
            raise ValueError(f"`global_batch_size`={global_batch_size!r} must be a positive integer or None.")
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or (
            timeout <= 0
        ):
            raise ValueError(f"`timeout`={timeout!r} must be a positive number of seconds.")
        if resume is not None and (not isinstance(resume, str) or not resume):
            raise ValueError(f"`resume`={resume!r} must be None, 'auto' or a checkpoint directory.")
        self._resume = resume
        ddp_kwargs = _check_ddp_kwargs(ddp_kwargs)
        _check_plain_args(start_method=start_method, process_group_backend=process_group_backend,
                          print_table=print_table, accelerator=accelerator, parallel_devices=parallel_devices,
                          cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                          precision_plugin=precision_plugin, ddp_comm_hook=ddp_comm_hook,
                          ddp_comm_wrapper=ddp_comm_wrapper)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=float(timeout)),
            start_method=start_method,
            **ddp_kwargs,
        )
        if stream_mode not in STREAM_MODES:
            raise ValueError(f"`stream_mode`={stream_mode!r} must be one of {STREAM_MODES}.")
        self._stream_mode = stream_mode
        self._global_batch_size = global_batch_size
        self._print_table = print_table
        self._lab: Optional[HeteroLab] = None
        self._groups: Optional[LabGroups] = None
        self._weighting: Optional[WeightingState] = None
        self._train_sampler: Optional[HeteroBatchSampler] = None
        # Evaluation samplers by (stage, dataset): a reloaded loader replaces its predecessor. Plain containers only:
        # the spawn launcher pickles the strategy.
        self._eval_samplers: dict[tuple[str, int], HeteroBatchSampler] = {}
        self._train_step_size: Optional[int] = None  # this rank's real samples in the current training batch
        self._logging_batch_size: Optional[int] = None  # set while a step runs, for `reduce`
        self._table_printed = False
        self._rank_state = RankStateCallback()
        self._rng = RandomState()
        self._faults: Optional[FaultMonitor] = None  # this rank's watchdog while a run is on (see faults.py)
        validate_tuning(profile_steps, memory_headroom, max_batch_per_rank, rebalance_every, rebalance_threshold,
                        rebalance_smoothing)
        if not isinstance(rebalance, bool):
            raise ValueError(f"`rebalance`={rebalance!r} must be True or False.")
        if not isinstance(monitor, bool):
            raise ValueError(f"`monitor`={monitor!r} must be True or False.")
        self._monitor_enabled = monitor
        self._monitor: Optional[Any] = None  # the HeteroMonitor timing this run's collectives
        self._shares = ShareController(
            profile=self._capacity_spec.source in ("profile", "auto"),  # the training loader exists only when fitting
            profile_steps=profile_steps,
            memory_headroom=float(memory_headroom),
            max_batch_per_rank=max_batch_per_rank,
            rebalance=rebalance,
            every=rebalance_every,
            threshold=float(rebalance_threshold),
            smoothing=float(rebalance_smoothing),
        )

    # -- public, read-only views ----------------------------------------------------------------------------------
    @property
    def lab(self) -> HeteroLab:
        """Ranks, devices, groups and batch shares of this job (available after setup)."""
        if self._lab is None:
            raise RuntimeError("the lab is described once the process group exists (after `Trainer.fit` starts).")
        return self._lab

    @property
    def groups(self) -> LabGroups:
        """This rank's process groups: by device class, by host, and the leaders across them."""
        if self._groups is None:
            raise RuntimeError("process groups are built once the process group exists.")
        return self._groups

    @property
    def train_batch_sampler(self) -> Optional[HeteroBatchSampler]:
        return self._train_sampler

    @property
    def rank_state(self) -> RankStateCallback:
        """Per-rank state saved in checkpoints (parts register themselves with ``rank_state.register``)."""
        return self._rank_state

    # -- setup ----------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        # Hosts with unequal GPU counts (2 + 1): torchrun's ranks are right, Lightning's devices × nodes check is not.
        if type(self.cluster_environment) is TorchElasticEnvironment:
            self.cluster_environment = PerNodeTorchElasticEnvironment()
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
            devices = self.parallel_devices or []
            if local and devices and all(d.type == "cpu" for d in devices) and len(devices) != local:
                # CPU processes have no device to count: this node runs what torchrun started (--nproc-per-node).
                self.parallel_devices = [torch.device("cpu")] * local
        super()._configure_launcher()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The cluster's world size, not num_nodes × devices (unequal hosts); the batch sampler replaces it anyway.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def emulation(self) -> Optional[Emulator]:
        """This rank's lab emulator (``None`` unless ``emulate`` gave it a profile); ``emulation.work()`` runs code
        under its caps."""
        return self._emulator

    @override
    def setup_environment(self) -> None:
        if self._emulate is not None:
            self.set_world_ranks()  # the rank is known from the cluster environment; NCCL env must precede the group
            host = describe_device(self.root_device, self.global_rank)
            self._emulator = start_emulation(self._emulate, self.global_rank, self.world_size, host, self.root_device)
        super().setup_environment()
        if self._emulator is not None:
            self._emulator.activate()
        local = describe_device(self.root_device, self.global_rank)
        if self._emulator is not None:
            local = self._emulator.describe(local)
        if self.world_size > 1:
            self._faults = FaultMonitor(self.global_rank, self.world_size, local.host, local.name,
                                        self._timeout.total_seconds())
            self._faults.start()
        devices = gather_devices(local)
        self._install_precision(devices)
        weights, source = resolve_static_capacities(self._capacity_spec, devices, self._compute_dtype())
        self._lab = HeteroLab(devices=devices, capacities=tuple(weights), capacity_source=source)
        if self._precision_policy is not None and self._precision_modes is not None:
            self._lab = self._lab.with_column(
                "precision", precision_column(self._precision_policy, devices, self._precision_modes)
            )
        self._groups = build_groups(self._lab)
        if self._emulate is not None:
            self._show_emulation()
        if isinstance(self._compression_request, AutoCompression):
            self._choose_compression(self._compression_request)
        by_class = getattr(self._compression_config, "group_by", "") == "class"
        by = self._lab.device_classes if by_class else self._lab.hosts
        described = describe_compression(self._compression_config, list(by.values()), self.world_size)
        if isinstance(self._compression_request, AutoCompression):
            described = [f"auto: {d}" for d in described]
        self._lab = self._lab.with_column("compression", described)
        trainer = getattr(self._lightning_module, "_trainer", None)
        # Callbacks are restored before `setup`: the state callback must be in place by then.
        if trainer is not None and self._rank_state not in trainer.callbacks:
            trainer.callbacks.append(self._rank_state)
        self._rank_state.register("rng", self._rng)
        if trainer is not None and self._resume is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resume_from_newest(trainer)
        if trainer is not None and self._monitor_enabled:
            from lightning_hetero.observe.monitor import HeteroMonitor

            if not any(isinstance(c, HeteroMonitor) for c in trainer.callbacks):
                trainer.callbacks.append(HeteroMonitor())

    def _resume_from_newest(self, trainer: Any) -> None:
        """With ``resume``: when ``fit`` got no ``ckpt_path``, restore the newest checkpoint (rank 0's choice)."""
        if self._resume == "auto":
            directories = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
            if not directories:
                raise ValueError(
                    "`resume`='auto' looks for checkpoints in the `dirpath` of the trainer's `ModelCheckpoint` "
                    "callbacks, and none has one: pass `ModelCheckpoint(dirpath=...)` or `resume=<directory>`."
                )
        else:
            directories = [self._resume]
        found = [newest_checkpoint(directories) if self.global_rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)  # one file for all ranks, even without a shared file system
        if found[0] is None:
            return
        # Lightning resolves `ckpt_path` before the strategy is set up; the restore call is the first point after
        # setup where the path is still open. The user's explicit `ckpt_path` wins.
        connector = trainer._checkpoint_connector
        restore = type(connector)._restore_modules_and_callbacks.__get__(connector)

        def restore_newest(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
            connector.__dict__.pop("_restore_modules_and_callbacks", None)  # once: back to the class's method
            if checkpoint_path is None:
                rank_zero_info(f"HeteroDDPStrategy resume='{self._resume}': going on from {found[0]}")
            restore(checkpoint_path or found[0], *args, **kwargs)

        connector._restore_modules_and_callbacks = restore_newest

    @override
    def setup_distributed(self) -> None:
        """Lightning's, through a rendezvous that names the ranks (nodes) that did not join within ``timeout``."""
        if dist.is_initialized():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        env = self.cluster_environment
        assert env is not None
        store = rendezvous(env.main_address, env.main_port, self.global_rank, self.world_size,
                           self._timeout.total_seconds(), ranks_per_node=self.num_processes)
        _init_dist_connection(env, self._process_group_backend, timeout=self._timeout, store=store,
                              device_id=self.root_device if self.root_device.type != "cpu" else None)

    def _install_precision(self, devices: Sequence[DeviceInfo]) -> None:
        """With a ``precision_policy``: this rank's autocast mode, the job's one loss scaler (see precision.py)."""
        if self._precision_policy is None:
            return
        check_no_conflict(self._precision_policy, self.precision_plugin)
        # Derived from the gathered devices, hence identical on every rank without another collective.
        self._precision_modes = resolve_precisions(self._precision_policy, devices)
        apply_tf32(self._precision_policy, devices[self.global_rank])
        self.precision_plugin = build_precision_plugin(
            self._precision_policy, self._precision_modes, self.global_rank, self.root_device.type
        )

    def _show_emulation(self) -> None:
        """An "emulated" table column and a rank-0 warning (a collective: every rank with ``emulate`` calls it)."""
        summaries: list[Any] = [None] * self.world_size
        dist.all_gather_object(summaries, self._emulator.summary() if self._emulator is not None else "real device")
        self._lab = self.lab.with_column("emulated", summaries)
        if self.global_rank == 0:
            rank_zero_warn(lab_warning(summaries))

    def _emulated_work(self) -> Any:
        return self._emulator.work() if self._emulator is not None else nullcontext()

    def _link_pacer(self, participants: int) -> Optional[LinkPacer]:
        """The emulated inter-host link's pacing (only with emulated hosts and ``inter_host_gbit``)."""
        gbit = self._emulator.inter_host_gbit if self._emulator is not None else None
        if gbit is None or len(self.lab.hosts) < 2:
            return None
        return LinkPacer(gbit, participants, self.root_device)

    def _choose_compression(self, request: AutoCompression) -> None:
        """``compression="auto"``: time the links, choose by them and the gradient size (same choice on every rank)."""
        links = measure_links(request, self.lab, self.groups, self.root_device, self._link_pacer(len(self.lab.hosts)))
        module = self._lightning_module
        grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) if module else 0
        self._compression_config, reason = choose(request, links, grad_bytes)
        self._lab = self.lab.with_column("link (measured)", link_column(links, self.lab))
        rank_zero_info(f"HeteroDDPStrategy compression='auto': {reason}")

    def _compute_dtype(self) -> torch.dtype:
        """The dtype this rank's matmuls run in, for the published-rate table."""
        if self._precision_modes is not None:
            return job_compute_dtype(self._precision_modes)  # one dtype for all ranks: capacities must agree
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if "bf16" in precision:
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        return torch.float32

    def update_capacities(
        self, capacities: Sequence[float], source: str, split: Optional[Sequence[int]] = None
    ) -> None:
        """Adopt new capacities (profiled or rebalanced) for the batches that follow (and their full-batch split)."""
        self._lab = replace(self.lab, capacities=tuple(float(c) for c in capacities), capacity_source=source)
        if split is not None:
            self._lab = replace(self._lab, split=tuple(int(b) for b in split))
        # Evaluation loaders built earlier (the sanity check runs before profiling) follow from their next pass on.
        # They are idle here: profiling and rebalancing happen between training batches.
        for sampler in self._eval_samplers.values():
            sampler.change_shares(capacities, first_batch=0)

    def observe_backward_end(self, observer: Callable[[], None], observe: bool = True) -> bool:
        """Call ``observer`` as each gradient bucket enters the comm hook, the last time once a synchronizing
        backward has accumulated every gradient (``observe=False``: stop). False when there is no hook to watch."""
        if self._weighting is None:
            return False
        observers = self._weighting.bucket_observers
        if observe and observer not in observers:
            observers.append(observer)
        elif not observe and observer in observers:
            observers.remove(observer)
        return True

    def attach_monitor(self, monitor: Any) -> None:
        """The :class:`~lightning_hetero.observe.monitor.HeteroMonitor` that times collectives issued inside a step (``None``:
        none). A monitor attaches itself while it watches training."""
        self._monitor = monitor

    def add_lab_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        """Extra per-rank columns for the lab table (e.g. measured samples/s, memory caps)."""
        for name, values in columns.items():
            self._lab = self.lab.with_column(name, values)

    @property
    def share_controller(self) -> ShareController:
        """Profiling results, rebalancing decisions and the share state saved in checkpoints."""
        return self._shares

    # -- data -----------------------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self.world_size == 1:
            return dataloader
        trainer = getattr(self._lightning_module, "_trainer", None)
        stage = trainer.state.stage if trainer is not None else None
        loader_name = f"{stage.dataloader_prefix}_dataloader" if stage is not None else "dataloader"
        profile_view: Any = dataloader
        if isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, IterableDataset):
            progress = trainer.fit_loop.epoch_progress.current if trainer is not None else None
            batch_sampler, new_loader, profile_view = build_stream_loader(
                dataloader, _loader_settings(dataloader), self._stream_mode, self._global_batch_size,
                self.lab.capacities, self.global_rank, self.root_device, _global_seed(), loader_name,
                epoch_fn=(lambda: progress.processed) if progress is not None else None,
                training=stage == RunningStage.TRAINING,
            )
        else:
            batch_sampler = self._build_batch_sampler(dataloader, loader_name)
            if isinstance(dataloader, DataLoader) and isinstance(dataloader.batch_sampler, _IndexBatchSamplerWrapper):
                wrapped: Any = _IndexBatchSamplerWrapper(batch_sampler)  # prediction loop tracks indices through it
            else:
                wrapped = batch_sampler
            new_loader = _rebuild_loader(dataloader, wrapped)  # type: ignore[arg-type]
        if stage != RunningStage.TRAINING:
            self._eval_samplers[(str(stage), id(dataloader.dataset))] = batch_sampler  # type: ignore[attr-defined]
        if stage == RunningStage.TRAINING:
            self._train_sampler = batch_sampler
            self._attach_costs(batch_sampler, dataloader.dataset)  # type: ignore[attr-defined]
            batch_sampler.cap_shares = self._micro_batch is None
            # Before the loader's first batch is drawn: restored or profiled shares apply from batch 0.
            self._rank_state.register("shares", self._shares)
            self._shares.on_train_loader(self, batch_sampler, profile_view)
            self._setup_micro_batching()
            if self._shares.position == 0:
                self._rng.apply()  # resumed at an epoch start: the epoch's iterator draws from the saved state
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # The table shows the training split; validate/test/predict-only runs show their own loader's.
        if stage == RunningStage.TRAINING or (not fitting and self.lab.global_batch_size is None):
            self._lab = replace(
                self.lab, global_batch_size=batch_sampler.global_batch_size, split=tuple(batch_sampler.split_at(0))
            )
            self._show_table()
        return new_loader

    def _build_batch_sampler(self, dataloader: object, loader_name: str) -> HeteroBatchSampler:
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"{loader_name}: {type(dataloader).__name__} is not a torch DataLoader; HeteroDDPStrategy splits the "
                "global batch through the DataLoader's sampler. Return a DataLoader over a map-style dataset."
            )
        outer = dataloader.batch_sampler
        inner = outer._batch_sampler if isinstance(outer, _IndexBatchSamplerWrapper) else outer
        if isinstance(inner, HeteroBatchSampler):
            return inner
        if inner is None:
            raise ValueError(
                f"{loader_name}: a DataLoader with `batch_size=None` yields single samples; HeteroDDPStrategy splits "
                "global batches. Pass `batch_size=` or a batch sampler."
            )
        if type(inner) is BatchSampler:
            order = _global_order(inner.sampler, len(dataloader.dataset), loader_name)  # type: ignore[arg-type]
            global_batch = self._global_batch_size or inner.batch_size * self.world_size
            drop_last = inner.drop_last
        else:
            # A custom batch sampler (e.g. bucketing by length): every batch it yields is one global batch.
            if self._global_batch_size is not None:
                raise ValueError(
                    f"`global_batch_size`={self._global_batch_size} is set, but {loader_name} has a custom batch "
                    f"sampler ({type(inner).__name__}) whose batches are the global batches. Leave "
                    "`global_batch_size` at None."
                )
            if isinstance(getattr(inner, "sampler", None), Sampler) and not isinstance(inner.sampler, GlobalOrder):
                # Lightning injected a DistributedSampler (a shard): every rank draws the whole order instead.
                inner.sampler = _global_order(inner.sampler, len(dataloader.dataset), loader_name)  # type: ignore
            order = GlobalOrder(len(dataloader.dataset), shuffle=False, seed=_global_seed(), source=inner,
                                batches=True)  # type: ignore[arg-type]
            # The largest batch is the nominal global batch (table, rebalancing); smaller ones are split alike.
            global_batch = max((len(b) for b in order.global_batches(0, False)), default=0)
            drop_last = False
        return HeteroBatchSampler(  # refuses a global batch smaller than the world size, naming the argument
            order,
            global_batch_size=global_batch,
            capacities=self.lab.capacities,
            rank=self.global_rank,
            drop_last=drop_last,
        )

    def _attach_costs(self, sampler: HeteroBatchSampler, dataset: Any) -> None:
        """Per-sample costs for token balance or token weighting (read once per training loader, shared)."""
        if self._balance == "samples" and self._loss_denominator == "samples":
            return
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"`balance`={self._balance!r} / `loss_denominator`={self._loss_denominator!r}: per-sample costs are "
                "read by index, which a stream (IterableDataset) has not; use 'samples' with streams."
            )
        if sampler.costs is None:
            cost_fn = resolve_cost_fn(self._sample_cost, self.lightning_module, dataset)
            costs = dataset_costs(dataset, cost_fn, self.global_rank, self.world_size, self.root_device)
            sampler.use_costs(costs, balance=self._balance != "samples", weight=self._loss_denominator == "tokens",
                              padded=self._balance == "padded_tokens")

    def _setup_micro_batching(self) -> None:
        limits = micro_limits(self._micro_batch, self._shares.caps, self.world_size)
        if limits is None:
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError("`micro_batch` needs automatic optimization: a manual-optimization `training_step` "
                             "steps its own optimizer and cannot be split into micro-batches.")
        self._micro_limit = limits[self.global_rank]
        self.add_lab_columns({"micro-batch": ["-" if m is None else str(m) for m in limits]})

    def _show_table(self) -> None:
        if self._print_table and not self._table_printed and self.global_rank == 0:
            rank_zero_info("HeteroDDPStrategy lab:\n" + self.lab.table())
        self._table_printed = True

    # -- gradient path --------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self._compression is not None:  # optimizers exist only now, after the DDP wrap
            self._compression.check_optimizers(self.optimizers)

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        inner_hook, inner_state = self._inner_comm_hook()
        self._weighting = WeightingState(self.world_size, inner_hook=inner_hook, inner_state=inner_state)
        self.model.register_comm_hook(self._weighting, weighted_allreduce_hook)
        if self._emulator is not None and self._emulator.slows_cpu:
            self.observe_backward_end(self._emulator.bucket_ready)

    def _inner_comm_hook(self) -> tuple[Optional[Callable], Any]:
        """The averaging hook that receives the weighted bucket: the user's, wrapped if asked; else a plain sum."""
        hook, state, wrapper = self._ddp_comm_hook, self._ddp_comm_state, self._ddp_comm_wrapper
        config = self._compression_config
        hierarchical = config is not None and config.hierarchical
        # An emulated slow link between hosts paces the leaders' hop (hierarchical) or the whole exchange (flat).
        pacer = self._link_pacer(len(self.lab.hosts) if hierarchical else self.world_size)
        counter = None
        if hook is None and wrapper is None:
            assert isinstance(self.model, DistributedDataParallel)
            self._compression = GradientCompression(
                config, list(self.model.module.parameters()), self.world_size, self.root_device, self.groups,
                pacer=pacer if hierarchical else None,
            )
            # Registered after Lightning restored callbacks: restored per-rank state is loaded right here.
            self._rank_state.register("compression", self._compression)
            hook, state = self._compression.hook, self._compression.state
            counter = self._compression.counter if hook is not None else None
            if hook is None and pacer is None:
                return None, None
        else:
            hook = wrapper(hook or default_hooks.allreduce_hook) if wrapper is not None else hook
        if pacer is not None and not hierarchical:
            return paced_hook, PacedState(hook or default_hooks.allreduce_hook, state, pacer, counter)
        return hook, state

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._rng.apply()  # resumed mid-epoch: the generators as they stood after the saved step
        self._enter("forward/backward", batch_idx)
        if self._train_sampler is None or self._weighting is None:
            self._train_step_size = None
            return
        sampler = self._train_sampler
        local, total = sampler.sizes_at(batch_idx)
        self._weighting.add_step(local, total)
        self._train_step_size = local
        self._step_weights = None
        if sampler.costs is not None and self._micro_limit is not None:  # micro-batch shares of the loss
            costs = list(sampler.batch_shares(batch_idx).costs[self.global_rank])
            self._step_weights = costs if sampler.weight_by_cost else [1.0] * len(costs)
        # Rebalancing measures the unit the split balances: tokens/s or samples/s.
        work = sampler.sizes_at(batch_idx, by_cost=sampler.balance_by_cost)[0] if sampler.costs is not None else local
        self._shares.on_train_batch_start(self, batch_idx, work)  # may key a share change to a later batch

    def _enter(self, phase: str, batch: Optional[int] = None) -> None:
        """Tell the watchdog what this rank is doing (a new phase is progress)."""
        if self._faults is not None:
            trainer = getattr(self._lightning_module, "_trainer", None)
            self._faults.enter(phase, trainer.global_step if trainer is not None else None, batch)

    @contextmanager
    def _in_phase(self, phase: str) -> Any:
        with self._faults.phase(phase) if self._faults is not None else nullcontext():
            yield

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._emulated_work():  # the closure runs forward and backward
                out = super().optimizer_step(*args, **kwargs)
        finally:
            self._pending_grads = None
            if self._weighting is not None:
                self._weighting.reset()
        self._log_comm_bytes()
        self._enter("data")  # next: the following batch is loaded
        return out

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        with self._in_phase("collective"):
            super().barrier(name)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._faults is not None:  # the others learn of it; the exception gets the job's cause as a note
            try:
                self._faults.on_exception(exception)
            except Exception as err:  # never hide the user's exception behind the watchdog's
                log.warning(f"lightning_hetero: could not report the failure to the other ranks: {err!r}")

    @property
    def comm_bytes_last_step(self) -> Optional[int]:
        """Bytes this rank handed to gradient collectives in the last optimizer step (None: a user comm hook)."""
        return self._compression.bytes_last_step if self._compression is not None else None

    def _log_comm_bytes(self) -> None:
        if self._compression is None:
            return
        self._compression.end_step()
        module = self._lightning_module
        trainer = getattr(module, "_trainer", None)
        # `self.log` costs ~0.1 ms: only on the steps the logger writes.
        if trainer is None or (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) != 0:
            return
        if getattr(module, "_current_fx_name", None) is not None:
            module.log("comm/bytes", float(self._compression.bytes_last_step or 0), on_step=True, on_epoch=False,
                       batch_size=1)

    # -- logging --------------------------------------------------------------------------------------------------
    @contextmanager
    def _weighted_logging(self, batch_size: Optional[int]) -> Any:
        """While a step runs, `reduce` weights means by this rank's ``batch_size`` (None: plain mean)."""
        self._logging_batch_size = batch_size
        try:
            yield
        finally:
            self._logging_batch_size = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._shares.step_started()
        with self._weighted_logging(self._train_step_size), self._emulated_work():
            sizes = chunk_sizes(_batch_size_of(args, kwargs) or 1, self._micro_limit) if self._micro_limit else [1]
            if len(sizes) == 1:
                return super().training_step(*args, **kwargs)
            return self._micro_batched_step(sizes, *args, **kwargs)

    def _micro_batched_step(self, sizes: list[int], batch: Any, *args: Any, **kwargs: Any) -> Any:
        """The first micro-batches forward and backward without sync; the last one's backward is Lightning's."""
        trainer = self.lightning_module.trainer
        optimizer = self.optimizers[0] if self.optimizers else None
        weights = self._step_weights or [1.0] * sum(sizes)
        output, self._pending_grads = run_micro_batches(
            batch, sizes, weights,
            forward=lambda chunk: super(HeteroDDPStrategy, self).training_step(chunk, *args, **kwargs),
            # Lightning divides the step's loss by the accumulation window; the micro-batches' losses likewise.
            backward=lambda loss: super(HeteroDDPStrategy, self).backward(
                loss / trainer.accumulate_grad_batches, optimizer),
            no_sync=self.model.no_sync if isinstance(self.model, DistributedDataParallel) else nullcontext,
            params=[p for p in self.lightning_module.parameters() if p.requires_grad],
            module=self.lightning_module,
        )
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        # After Lightning zeroed the gradients: the earlier micro-batches' gradients go back in before the last one's.
        if self._pending_grads is not None:
            pending, self._pending_grads = self._pending_grads, None
            pending.restore()
        self._shares.backward_started(closure_loss)
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._emulator is not None:
            self._emulator.backward_returned()
        self._enter("optimizer")
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._enter("validation")
        with self._weighted_logging(_batch_size_of(args, kwargs)), self._emulated_work():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._enter("test")
        with self._weighted_logging(_batch_size_of(args, kwargs)), self._emulated_work():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._enter("predict")
        with self._emulated_work():
            return super().predict_step(*args, **kwargs)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # [docs-ci] Lightning 2.5's Strategy.load_checkpoint has no weights_only: forwarded only where it exists.
        load_options = weights_only_argument(super().load_checkpoint, weights_only)
        checkpoint = super().load_checkpoint(checkpoint_path, **load_options)
        check_trainer_checkpoint(checkpoint, checkpoint_path)  # a clear error for a foreign file, not a KeyError
        return checkpoint

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        trainer = getattr(self._lightning_module, "_trainer", None)
        if self._train_sampler is not None and trainer is not None:
            # The sampler knows where the epoch stood; Lightning may have recorded it as finished.
            reopen_interrupted_epoch(
                checkpoint, self._train_sampler.sampler.epoch, self._shares.position, trainer.num_training_batches
            )
        with self._in_phase("checkpoint"):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def teardown(self) -> None:
        if self._faults is not None:  # first: rank 0 keeps the store up until every rank got here
            self._faults.stop()
            self._faults = None
        super().teardown()
        self._shares.teardown()
        if self._emulator is not None:
            self._emulator.restore()

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean"
    ) -> Tensor:
        """Inside a step, a mean over ranks is weighted by each rank's batch size (ranks see unequal batches)."""
        is_mean = reduce_op is None or reduce_op == dist.ReduceOp.AVG or str(reduce_op).lower() in ("mean", "avg")
        if not (is_mean and isinstance(tensor, Tensor) and self._logging_batch_size is not None and dist.is_initialized()):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        values = tensor.detach().to(torch.float64 if tensor.device.type == "cpu" else torch.float32).reshape(-1)
        weight = torch.tensor([float(self._logging_batch_size)], dtype=values.dtype, device=values.device)
        packed = torch.cat([values * weight, weight])
        # Waiting for other ranks is not this rank's compute (rebalancing, the CPU emulator); it is sync (monitor).
        emulator = self._emulator
        began = emulator.collective_began() if emulator is not None else None
        with self._shares.excluded():
            if self._monitor is None:
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            else:
                self._monitor.timed_collective(dist.all_reduce, packed, op=dist.ReduceOp.SUM, group=group)
        if began is not None:
            emulator.collective_ended(began)
        mean = packed[:-1] / packed[-1].clamp_min(1e-12)
        return mean.reshape(tensor.shape).to(tensor.dtype)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (
            ("hetero_ddp", "popen"),
            ("hetero_ddp_spawn", "spawn"),
            ("hetero_ddp_fork", "fork"),
            ("hetero_ddp_notebook", "fork"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Capacity-weighted DDP for mixed GPUs, start method '{start_method}'",
                    start_method=start_method,
                )


_START_METHODS = get_args(StartMethod)
_BACKENDS = tuple(b for b in dist.Backend.backend_list if b != "undefined")  # torch's, with registered ones
# DistributedDataParallel arguments the strategy owns, and those whose type it checks.
_OWNED_DDP_ARGS = ("self", "module", "device_ids", "output_device", "process_group", "device_mesh")
_BOOL_DDP_ARGS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
                  "skip_all_reduce_unused_params", "init_sync")


def _check_ddp_kwargs(ddp_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``ddp_kwargs`` keys must be ``DistributedDataParallel`` arguments the strategy does not own."""
    if ddp_kwargs is None:
        return {}
    if not isinstance(ddp_kwargs, Mapping):
        raise ValueError(f"`ddp_kwargs`={ddp_kwargs!r} must be a dict of DistributedDataParallel arguments or None.")
    accepted = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in _OWNED_DDP_ARGS]
    for key, value in ddp_kwargs.items():
        if key in _OWNED_DDP_ARGS:
            raise ValueError(f"`ddp_kwargs` must not set `{key}`: the strategy owns it.")
        if key not in accepted:
            raise ValueError(
                f"`ddp_kwargs` key {key!r} is not a DistributedDataParallel argument; accepted: {accepted}."
            )
        if key in _BOOL_DDP_ARGS and not isinstance(value, bool):
            raise ValueError(f"`ddp_kwargs[{key!r}]`={value!r} must be True or False.")
        if key == "bucket_cap_mb" and value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            raise ValueError(f"`ddp_kwargs['bucket_cap_mb']`={value!r} must be a positive number of MiB or None.")
    return dict(ddp_kwargs)


def _check_plain_args(**args: Any) -> None:
    """``ValueError`` naming the argument for a value of the wrong kind (LightningCLI checks types; Python does not)."""
    if args["start_method"] not in _START_METHODS:
        raise ValueError(f"`start_method`={args['start_method']!r} must be one of {_START_METHODS}.")
    backend = args["process_group_backend"]
    if backend is not None:
        # "gloo", "nccl", ... or a per-device mapping such as "cpu:gloo,cuda:nccl"
        names = [part.split(":")[-1] for part in backend.split(",")] if isinstance(backend, str) else [backend]
        if not all(isinstance(n, str) and n.lower() in _BACKENDS for n in names):
            raise ValueError(f"`process_group_backend`={backend!r} must be None or one of "
                             f"{list(_BACKENDS)} (or 'cpu:gloo,cuda:nccl').")
    if not isinstance(args["print_table"], bool):
        raise ValueError(f"`print_table`={args['print_table']!r} must be True or False.")
    devices = args["parallel_devices"]
    if devices is not None and (not isinstance(devices, (list, tuple))
                                or not all(isinstance(d, torch.device) for d in devices)):
        raise ValueError(f"`parallel_devices`={devices!r} must be a list of torch.device or None.")
    for name, kind in (("cluster_environment", ClusterEnvironment), ("checkpoint_io", CheckpointIO),
                       ("precision_plugin", Precision)):
        if args[name] is not None and not isinstance(args[name], kind):
            raise ValueError(f"`{name}`={args[name]!r} must be a {kind.__name__} or None.")
    accelerator = args["accelerator"]
    if accelerator is not None and not isinstance(accelerator, (str, Accelerator)):
        raise ValueError(f"`accelerator`={accelerator!r} must be an Accelerator, its registry name or None.")
    for name in ("ddp_comm_hook", "ddp_comm_wrapper"):
        if args[name] is not None and not callable(args[name]):
            raise ValueError(f"`{name}`={args[name]!r} must be callable or None.")


def _batch_size_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[int]:
    batch = args[0] if args else kwargs.get("batch")
    try:
        return extract_batch_size(batch)
    except Exception:  # an odd batch type: fall back to Lightning's unweighted mean
        return None


def _global_seed() -> int:
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def _global_order(sampler: object, num_samples: int, loader_name: str) -> GlobalOrder:
    """The global order the user's sampler (or Lightning's injected one) asked for, drawn alike on every rank."""
    seed = _global_seed()
    if isinstance(sampler, DistributedSampler):
        base = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's _DatasetSamplerWrapper
        if base is None:
            return GlobalOrder(num_samples, shuffle=sampler.shuffle, seed=sampler.seed)
        if isinstance(base, (SequentialSampler, RandomSampler)) and type(base) in (SequentialSampler, RandomSampler):
            if not (isinstance(base, RandomSampler) and (base.replacement or base.num_samples != num_samples)):
                return GlobalOrder(num_samples, shuffle=sampler.shuffle or isinstance(base, RandomSampler),
                                   seed=sampler.seed)
        sampler, seed = base, sampler.seed
    if type(sampler) is SequentialSampler:
        return GlobalOrder(num_samples, shuffle=False, seed=seed)
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == num_samples:  # type: ignore
        return GlobalOrder(num_samples, shuffle=True, seed=seed)
    if not isinstance(sampler, Iterable):
        raise ValueError(f"{loader_name}: the sampler {type(sampler).__name__} is not iterable.")
    # Any other sampler (WeightedRandomSampler, RandomSampler with replacement, a user's own): drawn on every rank,
    # seeded like DistributedSampler, and checked to agree across ranks at each epoch's start.
    return GlobalOrder(num_samples, shuffle=False, seed=seed, source=sampler)


_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _loader_settings(dataloader: DataLoader) -> dict[str, Any]:
    """A loader's worker, memory and collation settings: what a rebuilt loader keeps."""
    kwargs = {name: getattr(dataloader, name) for name in _LOADER_ARGS if hasattr(dataloader, name)}
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return kwargs


def _rebuild_loader(dataloader: DataLoader, batch_sampler: Any) -> DataLoader:
    """The same loader settings around a new batch sampler."""
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **_loader_settings(dataloader))
