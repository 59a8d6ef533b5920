"""The hetero core: what makes data-parallel training heterogeneous, whatever the parallelism.

:class:`HeteroCore` composes, for one strategy instance,

- the lab: this rank's device (and its emulation), every rank's device, the device-class / host groups;
- the plan: capacities (declared, published, profiled), each rank's share, rebalancing (:class:`ShareController`);
- the data path: every loader rebuilt around a :class:`HeteroBatchSampler` (or a stream splitter), token costs,
  micro-batches;
- the step: this rank's share of the current optimizer step (``b_r``, ``G``), which a strategy turns into exact
  gradient weighting its own way (a DDP comm hook, a loss scale, FSDP's reduce-scatter);
- precision: per-rank autocast with one loss scale for the job;
- observation and resilience: the lab table, the fault watchdog, per-rank checkpoint state, resume.

:class:`~lightning_hetero.strategies.lifecycle.HeteroLifecycle` is the thin layer of Lightning strategy overrides that
calls the core at each lifecycle point; a strategy is ``class HeteroXStrategy(HeteroLifecycle, XStrategy)`` plus
what its parallelism needs.
"""

import logging
from collections.abc import Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

import lightning_hetero._compat as _compat
from lightning_hetero.config import Options, check, is_int
from lightning_hetero.data.loaders import global_order, global_seed, rebuild_loader
from lightning_hetero.data.microbatch import PendingGrads, chunk_sizes, micro_limits, parse_micro_batch, run_micro_batches
from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler, check_training_batch
from lightning_hetero.data.streaming import build_stream_loader
from lightning_hetero.data.tokens import dataset_costs, resolve_cost_fn
from lightning_hetero.grad.nonfinite import NonFiniteCheck
from lightning_hetero.grad.precision import (
    parse_precision_policy,
    PrecisionPolicy,
    apply_tf32,
    build_precision_plugin,
    check_no_conflict,
    job_compute_dtype,
    precision_column,
    resolve_precisions,
)
from lightning_hetero.lab.devices import DeviceInfo, describe_device
from lightning_hetero.lab.emulation import EmulationSpec, Emulator, lab_warning, parse_emulate, start_emulation
from lightning_hetero.lab.link_pacing import LinkPacer
from lightning_hetero.lab.groups import HeteroLab, LabGroups, build_groups, gather_devices
from lightning_hetero.observe.notices import restore_inexact_resume_warning, silence_inexact_resume_warning
from lightning_hetero.plan.capacity import CapacitySpec, parse_capacities, resolve_static_capacities
from lightning_hetero.plan.rebalance import ShareController
from lightning_hetero.resilience.checkpoint import check_trainer_checkpoint, reopen_interrupted_epoch
from lightning_hetero.resilience.faults import FaultMonitor, rendezvous
from lightning_hetero.resilience.preemption import PreemptionHandler
from lightning_hetero.resilience.state import RandomState, RankStates

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_hetero"


class HeteroCore:
    """The strategy-independent state of one heterogeneous job (see the module docstring).

    The strategy that owns it passes itself as ``strategy`` (its public Lightning attributes: ranks, devices, the
    LightningModule, precision plugin and optimizers are read from it).
    """

    def __init__(
        self,
        strategy: Any,
        capacity_spec: CapacitySpec,
        global_batch_size: Optional[int],
        options: Options,
        emulate: Optional[list[Optional[EmulationSpec]]],
        precision_policy: Optional[PrecisionPolicy],
    ) -> None:
        self.strategy = strategy
        self.capacity_spec = capacity_spec
        self.global_batch_size = global_batch_size
        self.options = options
        self.emulate = emulate
        self.precision_policy = precision_policy
        self.micro_batch = parse_micro_batch(options.data.micro_batch)
        rebalancing = options.rebalance
        self.shares = ShareController(
            profile=capacity_spec.source in ("profile", "auto"),
            profile_steps=options.profiling.steps,
            memory_headroom=float(options.profiling.memory_headroom),
            max_batch_per_rank=options.profiling.max_batch_per_rank,
            rebalance=rebalancing is not None,
            every=rebalancing.every if rebalancing else 20,
            threshold=float(rebalancing.threshold) if rebalancing else 0.05,
            smoothing=float(rebalancing.smoothing) if rebalancing else 0.5,
        )
        self.rank_states = RankStates()
        self.rng = RandomState()
        self.lab_: Optional[HeteroLab] = None
        self.groups_: Optional[LabGroups] = None
        self.emulation: Optional[Emulator] = None
        self.faults: Optional[FaultMonitor] = None
        # SIGTERM / SLURM requeue: every rank stops after the same step, saves, exits. A
        # callback: the batch end (where ModelCheckpoint saves, resumed exactly) has no strategy hook.
        self.preemption = PreemptionHandler(resume=options.resilience.resume, before_stop=self.stop_watchdog)
        self.monitor: Optional[Any] = None  # the HeteroMonitor timing in-step collectives, while it watches
        self.precision_modes: Optional[tuple[str, ...]] = None
        self.train_sampler: Optional[HeteroBatchSampler] = None
        # Evaluation samplers by (stage, dataset): a reloaded loader replaces its predecessor. Plain containers only:
        # the spawn launcher pickles the strategy.
        self.eval_samplers: dict[tuple[str, int], HeteroBatchSampler] = {}
        self.micro_limit: Optional[int] = None  # this rank's samples per forward/backward (None: the whole share)
        self.pending_grads: Optional[PendingGrads] = None
        self.step_weights: Optional[list[float]] = None  # per sample of the current training batch
        self.step_share: Optional[tuple[int, int]] = None  # (b_r, G) of the current training batch
        self.logging_batch_size: Optional[int] = None  # set while a step runs, for `reduce`
        self.table_printed = False

    # -- views the plan and the monitor read ------------------------------------------------------------------------
    @property
    def lab(self) -> HeteroLab:
        if self.lab_ is None:
            raise RuntimeError("the lab is described once the process group exists (after `Trainer.fit` starts).")
        return self.lab_

    @property
    def groups(self) -> LabGroups:
        if self.groups_ is None:
            raise RuntimeError("process groups are built once the process group exists.")
        return self.groups_

    def __getattr__(self, name: str) -> Any:
        # The plan reads ranks, devices, the module, precision and optimizers of the owning strategy.
        if name in ("global_rank", "world_size", "root_device", "lightning_module", "precision_plugin", "optimizers"):
            return getattr(self.strategy, name)
        raise AttributeError(name)

    def update_capacities(self, capacities: Sequence[float], source: str,
                          split: Optional[Sequence[int]] = None) -> None:
        """Adopt new capacities (profiled or rebalanced) for the batches that follow (and their full-batch split)."""
        self.lab_ = replace(self.lab, capacities=tuple(float(c) for c in capacities), capacity_source=source)
        if split is not None:
            self.lab_ = replace(self.lab_, split=tuple(int(b) for b in split))
        # Evaluation loaders built earlier (the sanity check runs before profiling) follow from their next pass on.
        for sampler in self.eval_samplers.values():
            sampler.change_shares(capacities, first_batch=0)

    def add_lab_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        for name, values in columns.items():
            self.lab_ = self.lab.with_column(name, values)

    # -- process group ---------------------------------------------------------------------------------------------
    def before_process_group(self) -> None:
        """The emulator's environment (NCCL link class, host id) must exist before the process group does."""
        strategy = self.strategy
        if self.emulate is not None:
            strategy.set_world_ranks()
            host = describe_device(strategy.root_device, strategy.global_rank)
            self.emulation = start_emulation(self.emulate, strategy.global_rank, strategy.world_size, host,
                                             strategy.root_device)

    def init_process_group(self) -> None:
        """Lightning's set-up, through a rendezvous that names the ranks (nodes) that did not join in time."""
        strategy = self.strategy
        reset_seed()
        strategy.set_world_ranks()
        env = strategy.cluster_environment
        store = rendezvous(env.main_address, env.main_port, strategy.global_rank, strategy.world_size,
                           self.options.resilience.timeout, ranks_per_node=strategy.num_processes)
        _compat.init_process_group(strategy, store)

    def after_process_group(self) -> None:
        """Every rank's device, the precision plugin, capacities, the lab and its groups (collectives)."""
        strategy = self.strategy
        if self.emulation is not None:
            self.emulation.activate()
        local = describe_device(strategy.root_device, strategy.global_rank)
        if self.emulation is not None:
            local = self.emulation.describe(local)
        if strategy.world_size > 1:
            self.faults = FaultMonitor(strategy.global_rank, strategy.world_size, local.host, local.name,
                                       self.options.resilience.timeout)
            self.faults.start()
        devices = gather_devices(local)
        self._install_precision(devices)
        weights, source = resolve_static_capacities(self.capacity_spec, devices, self._compute_dtype())
        self.lab_ = HeteroLab(devices=devices, capacities=tuple(weights), capacity_source=source)
        if self.precision_policy is not None and self.precision_modes is not None:
            self.add_lab_columns({"precision": precision_column(self.precision_policy, devices, self.precision_modes)})
        self.groups_ = build_groups(self.lab_)
        if self.emulate is not None:
            summaries: list[Any] = [None] * strategy.world_size
            summary = self.emulation.summary() if self.emulation is not None else "real device"
            dist.all_gather_object(summaries, summary)
            self.add_lab_columns({"emulated": summaries})
            if strategy.global_rank == 0:
                rank_zero_warn(lab_warning(summaries))
        self.rank_states.register("rng", self.rng)
        trainer = _compat.trainer_of(strategy.lightning_module)
        if trainer is not None and self.preemption not in trainer.callbacks:
            trainer.callbacks.append(self.preemption)
        if trainer is not None and self.options.observation.monitor:
            from lightning_hetero.observe.monitor import HeteroMonitor

            if not any(isinstance(c, HeteroMonitor) for c in trainer.callbacks):
                trainer.callbacks.append(HeteroMonitor())
                rank_zero_info(f"{type(strategy).__name__}(observation={{'monitor': True}}): added a HeteroMonitor "
                               "callback to the trainer.")
        nonfinite = self.options.resilience.nonfinite
        if trainer is not None and nonfinite != "ignore":
            if not any(isinstance(c, NonFiniteCheck) for c in trainer.callbacks):
                trainer.callbacks.append(NonFiniteCheck(nonfinite, [d.host for d in self.lab.devices]))
                rank_zero_info(f"{type(strategy).__name__}(resilience={{'nonfinite': '{nonfinite}'}}): added a "
                               "NonFiniteCheck callback to the trainer.")

    def link_pacer(self, participants: int) -> Optional[LinkPacer]:
        """The emulated inter-host link's pacing (only with emulated hosts and ``inter_host_gbit``)."""
        gbit = self.emulation.inter_host_gbit if self.emulation is not None else None
        if gbit is None or len(self.lab.hosts) < 2:
            return None
        return LinkPacer(gbit, participants, self.strategy.root_device)

    def _install_precision(self, devices: Sequence[DeviceInfo]) -> None:
        if self.precision_policy is None:
            return
        strategy = self.strategy
        check_no_conflict(self.precision_policy, strategy.precision_plugin)
        # Derived from the gathered devices, hence identical on every rank without another collective.
        self.precision_modes = resolve_precisions(self.precision_policy, devices)
        apply_tf32(self.precision_policy, devices[strategy.global_rank])
        strategy.precision_plugin = build_precision_plugin(
            self.precision_policy, self.precision_modes, strategy.global_rank, strategy.root_device.type
        )

    def _compute_dtype(self) -> torch.dtype:
        """The dtype this rank's matmuls run in, for the published-rate table."""
        if self.precision_modes is not None:
            return job_compute_dtype(self.precision_modes)  # one dtype for all ranks: capacities must agree
        precision = str(getattr(self.strategy.precision_plugin, "precision", "32-true"))
        if "bf16" in precision:
            return torch.bfloat16
        return torch.float16 if precision.startswith("16") else torch.float32

    # -- data ------------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        strategy = self.strategy
        trainer = _compat.trainer_of(strategy.lightning_module)
        stage = trainer.state.stage if trainer is not None else None
        loader_name = f"{stage.dataloader_prefix}_dataloader" if stage is not None else "dataloader"
        profile_view: Any = dataloader
        if isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, IterableDataset):
            progress = trainer.fit_loop.epoch_progress.current if trainer is not None else None
            batch_sampler, new_loader, profile_view = build_stream_loader(
                dataloader, _stream_loader_settings(dataloader), self.options.data.stream_mode,
                self.global_batch_size, self.lab.capacities, strategy.global_rank, strategy.root_device,
                global_seed(), loader_name,
                epoch_fn=(lambda: progress.processed) if progress is not None else None,
                training=stage == RunningStage.TRAINING,
            )
        else:
            batch_sampler = self._build_batch_sampler(dataloader, loader_name)
            outer = dataloader.batch_sampler  # type: ignore[attr-defined]
            # The prediction loop tracks batch indices through Lightning's wrapper: keep it around ours.
            wrapped = _compat.IndexBatchSamplerWrapper(batch_sampler) if isinstance(
                outer, _compat.IndexBatchSamplerWrapper) else batch_sampler
            new_loader = rebuild_loader(dataloader, wrapped)  # type: ignore[arg-type]
        if stage == RunningStage.TRAINING:
            self._on_train_loader(batch_sampler, dataloader, profile_view)
        else:
            self.eval_samplers[(str(stage), id(dataloader.dataset))] = batch_sampler  # type: ignore[attr-defined]
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # The table shows the training split; validate/test/predict-only runs show their own loader's.
        if stage == RunningStage.TRAINING or (not fitting and self.lab.global_batch_size is None):
            self.lab_ = replace(self.lab, global_batch_size=batch_sampler.global_batch_size,
                                split=tuple(batch_sampler.split_at(0)))
            self.show_table()
        return new_loader

    def _on_train_loader(self, batch_sampler: HeteroBatchSampler, dataloader: Any, profile_view: Any) -> None:
        map_style = not isinstance(dataloader.dataset, IterableDataset)
        if map_style:  # a global batch the dataset cannot fill is never trained on
            check_training_batch(batch_sampler, "train_dataloader", explicit=self.global_batch_size is not None)
        self.train_sampler = batch_sampler
        self._attach_costs(batch_sampler, dataloader.dataset)
        batch_sampler.cap_shares = self.micro_batch is None
        # Before the loader's first batch is drawn: restored or profiled shares apply from batch 0.
        self.rank_states.register("shares", self.shares)
        self.shares.on_train_loader(self, batch_sampler, profile_view)
        self._setup_micro_batching()
        if self.shares.position > 0 and map_style:  # resumed at the exact batch: Lightning's warning is wrong here
            silence_inexact_resume_warning()
        if self.shares.position == 0:
            self.rng.apply()  # resumed at an epoch start: the epoch's iterator draws from the saved state

    def _build_batch_sampler(self, dataloader: object, loader_name: str) -> HeteroBatchSampler:
        strategy = self.strategy
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"{loader_name}: {type(dataloader).__name__} is not a torch DataLoader; the strategy splits the "
                "global batch through the DataLoader's sampler. Return a DataLoader over a map-style dataset."
            )
        outer = dataloader.batch_sampler
        inner = _compat.unwrap_index_batch_sampler(outer)
        if isinstance(inner, HeteroBatchSampler):
            return inner
        if inner is None:
            raise ValueError(
                f"{loader_name}: a DataLoader with `batch_size=None` yields single samples; the strategy splits "
                "global batches. Pass `batch_size=` or a batch sampler."
            )
        if type(inner) is BatchSampler:
            order = global_order(inner.sampler, len(dataloader.dataset), loader_name)  # type: ignore[arg-type]
            global_batch = self.global_batch_size or inner.batch_size * strategy.world_size
            drop_last = inner.drop_last
        else:
            # A custom batch sampler (e.g. bucketing by length): every batch it yields is one global batch.
            if self.global_batch_size is not None:
                raise ValueError(
                    f"`global_batch_size`={self.global_batch_size} is set, but {loader_name} has a custom batch "
                    f"sampler ({type(inner).__name__}) whose batches are the global batches. Leave "
                    "`global_batch_size` at None."
                )
            if isinstance(getattr(inner, "sampler", None), Sampler) and not isinstance(inner.sampler, GlobalOrder):
                # Lightning injected a DistributedSampler (a shard): every rank draws the whole order instead.
                inner.sampler = global_order(inner.sampler, len(dataloader.dataset), loader_name)  # type: ignore
            order = GlobalOrder(len(dataloader.dataset), shuffle=False, seed=global_seed(), source=inner,
                                batches=True)  # type: ignore[arg-type]
            # The largest batch is the nominal global batch (table, rebalancing); smaller ones are split alike.
            global_batch = max((len(b) for b in order.global_batches(0, False)), default=0)
            drop_last = False
        return HeteroBatchSampler(  # refuses a global batch smaller than the world size, naming the argument
            order, global_batch_size=global_batch, capacities=self.lab.capacities, rank=strategy.global_rank,
            drop_last=drop_last,
        )

    def _attach_costs(self, sampler: HeteroBatchSampler, dataset: Any) -> None:
        """Per-sample costs for token balance or token weighting (read once per training loader, shared)."""
        data = self.options.data
        if not data.uses_costs:
            return
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"`data.balance`={data.balance!r} / `data.loss_denominator`={data.loss_denominator!r}: per-sample "
                "costs are read by index, which a stream (IterableDataset) has not; use 'samples' with streams."
            )
        if sampler.costs is None:
            strategy = self.strategy
            cost_fn = resolve_cost_fn(data.sample_cost, strategy.lightning_module, dataset)
            costs = dataset_costs(dataset, cost_fn, strategy.global_rank, strategy.world_size, strategy.root_device)
            sampler.use_costs(costs, balance=data.balance != "samples", weight=data.loss_denominator == "tokens",
                              padded=data.balance == "padded_tokens")

    def _setup_micro_batching(self) -> None:
        limits = micro_limits(self.micro_batch, self.shares.caps, self.strategy.world_size)
        if limits is None:
            return
        if not self.strategy.lightning_module.automatic_optimization:
            raise ValueError("`data.micro_batch` needs automatic optimization: a manual-optimization `training_step` "
                             "steps its own optimizer and cannot be split into micro-batches.")
        self.micro_limit = limits[self.strategy.global_rank]
        self.add_lab_columns({"micro-batch": ["-" if m is None else str(m) for m in limits]})

    def show_table(self) -> None:
        strategy = self.strategy
        if self.options.observation.print_table and not self.table_printed and strategy.global_rank == 0:
            rank_zero_info(f"{type(strategy).__name__} lab:\n" + self.lab.table())
        self.table_printed = True

    # -- every training batch ---------------------------------------------------------------------------------------
    def on_train_batch_start(self, batch_idx: int) -> Optional[tuple[int, int]]:
        """This rank's and all ranks' samples (or token weights) in this batch: (b_r, G). ``None`` without a split."""
        self.rng.apply()  # resumed mid-epoch: the generators as they stood after the saved step
        self.enter("forward/backward", batch_idx)
        sampler = self.train_sampler
        if sampler is None:
            self.step_share = None
            self.logging_batch_size = None
            return None
        local, total = sampler.sizes_at(batch_idx)
        self.step_share = (local, total)
        self.step_weights = None
        if sampler.costs is not None and self.micro_limit is not None:  # micro-batch shares of the loss
            costs = list(sampler.batch_shares(batch_idx).costs[self.strategy.global_rank])
            self.step_weights = costs if sampler.weight_by_cost else [1.0] * len(costs)
        # Rebalancing measures the unit the split balances: tokens/s or samples/s.
        work = sampler.sizes_at(batch_idx, by_cost=sampler.balance_by_cost)[0] if sampler.costs is not None else local
        self.shares.on_train_batch_start(self, batch_idx, work)  # may key a share change to a later batch
        return self.step_share

    def train_step_size(self) -> Optional[int]:
        """This rank's real samples in the current training batch (the monitor's count)."""
        return None if self.step_share is None else self.step_share[0]

    @contextmanager
    def step(self, batch_size: Optional[int]) -> Any:
        """Around a step: `reduce` weights means by this rank's ``batch_size``; the emulator's caps apply."""
        self.logging_batch_size = batch_size
        try:
            with self.emulated_work():
                yield
        finally:
            self.logging_batch_size = None

    def emulated_work(self) -> Any:
        return self.emulation.work() if self.emulation is not None else nullcontext()

    def micro_batch_sizes(self, batch_size: Optional[int]) -> Optional[list[int]]:
        """The micro-batches of this rank's share, or ``None`` when it runs whole."""
        if not self.micro_limit:
            return None
        sizes = chunk_sizes(batch_size or 1, self.micro_limit)
        return sizes if len(sizes) > 1 else None

    def run_micro_batches(self, sizes: list[int], batch: Any, forward: Callable[[Any], Any],
                          backward: Callable[[Tensor], Any], no_sync: Callable[[], Any]) -> Any:
        """The first micro-batches forward and backward without sync; the last one's backward is Lightning's."""
        module = self.strategy.lightning_module
        output, self.pending_grads = run_micro_batches(
            batch, sizes, self.step_weights or [1.0] * sum(sizes), forward=forward, backward=backward,
            no_sync=no_sync, params=[p for p in module.parameters() if p.requires_grad], module=module,
        )
        return output

    def before_backward(self, loss: Tensor) -> None:
        # After Lightning zeroed the gradients: the earlier micro-batches' gradients go back in before the last one's.
        if self.pending_grads is not None:
            pending, self.pending_grads = self.pending_grads, None
            pending.restore()
        self.shares.backward_started(loss)

    def after_backward(self) -> None:
        if self.emulation is not None:
            self.emulation.backward_returned()
        self.enter("optimizer")

    def after_optimizer_step(self) -> None:
        self.enter("data", next_step=True)  # Lightning counts the step only after this hook  # next: the following batch is loaded

    def reduce_weighted_mean(self, tensor: Tensor, group: Optional[Any]) -> Tensor:
        """A mean over ranks weighted by each rank's batch size (ranks see unequal batches)."""
        values = tensor.detach().to(torch.float64 if tensor.device.type == "cpu" else torch.float32).reshape(-1)
        weight = float(self.logging_batch_size or 0)
        # Filled on the device: a tensor made from a Python list would be copied from the host, which waits for the
        # CUDA stream (a synchronization every logged step).
        packed = torch.cat([values * weight, values.new_full((1,), weight)])
        # Waiting for other ranks is not this rank's compute (rebalancing, the CPU emulator); it is sync (monitor).
        emulator = self.emulation
        began = emulator.collective_began() if emulator is not None else None
        with self.shares.excluded():
            if self.monitor is None:
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            else:
                self.monitor.timed_collective(dist.all_reduce, packed, op=dist.ReduceOp.SUM, group=group)
        if began is not None:
            emulator.collective_ended(began)
        mean = packed[:-1] / packed[-1].clamp_min(1e-12)
        return mean.reshape(tensor.shape).to(tensor.dtype)

    # -- faults ----------------------------------------------------------------------------------------------------
    def enter(self, phase: str, batch: Optional[int] = None, next_step: bool = False) -> None:
        """Tell the watchdog what this rank is doing (a new phase is progress)."""
        if self.faults is not None:
            trainer = _compat.trainer_of(self.strategy.lightning_module)
            step = trainer.global_step + int(next_step) if trainer is not None else None
            self.faults.enter(phase, step, batch)

    def in_phase(self, phase: str) -> Any:
        return self.faults.phase(phase) if self.faults is not None else nullcontext()

    def on_exception(self, exception: BaseException) -> None:
        if self.faults is not None:  # the others learn of it; the exception gets the job's cause as a note
            try:
                self.faults.on_exception(exception)
            except Exception as err:  # never hide the user's exception behind the watchdog's
                log.warning(f"lightning_hetero: could not report the failure to the other ranks: {err!r}")

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def on_load(self, checkpoint: dict[str, Any], path: Any) -> None:
        check_trainer_checkpoint(checkpoint, path)  # a clear error for a foreign file, not a KeyError
        # Earlier releases kept the per-rank state as a callback's state.
        state = checkpoint.get(CHECKPOINT_KEY) or checkpoint.get("callbacks", {}).get("lightning_hetero.RankState")
        if state is not None:
            self.rank_states.load_state_dict(state)

    def on_save(self, checkpoint: dict[str, Any]) -> None:
        """Every rank's state into the checkpoint (a collective: Lightning saves on every rank)."""
        checkpoint[CHECKPOINT_KEY] = self.rank_states.state_dict()
        trainer = _compat.trainer_of(self.strategy.lightning_module)
        if self.train_sampler is not None and trainer is not None:
            # The sampler knows where the epoch stood; Lightning may have recorded it as finished.
            reopen_interrupted_epoch(checkpoint, self.train_sampler.sampler.epoch, self.shares.position,
                                     trainer.num_training_batches)

    def stop_watchdog(self) -> None:
        """Before a signal's agreed exit: the other ranks must not take it for a fault."""
        if self.faults is not None:
            self.faults.stop()

    def teardown(self) -> None:
        if self.faults is not None:  # first: rank 0 keeps the store up until every rank got here
            self.faults.stop()
            self.faults = None

    def after_teardown(self) -> None:
        restore_inexact_resume_warning()
        self.shares.teardown()
        if self.emulation is not None:
            self.emulation.restore()


def _stream_loader_settings(dataloader: DataLoader) -> dict[str, Any]:
    """A stream loader's worker, memory and collation settings (what its rebuilt loader keeps)."""
    names = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
             "generator", "persistent_workers", "pin_memory_device", "in_order")
    kwargs = {name: getattr(dataloader, name) for name in names if hasattr(dataloader, name)}
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return kwargs


def core_from_arguments(strategy: Any, capacities: Any, global_batch_size: Optional[int], options: Options,
                        emulate: Any, precision_policy: Any, precision_plugin: Any) -> HeteroCore:
    """A strategy's core from its user-facing arguments, each checked with the argument named."""
    check("", "global_batch_size", global_batch_size, global_batch_size is None or (
        is_int(global_batch_size) and global_batch_size >= 1), "a positive integer or None")
    policy = parse_precision_policy(precision_policy)
    if policy is not None and precision_plugin is not None:
        raise ValueError("`precision_policy` and `precision_plugin` both set the precision: pass only one.")
    return HeteroCore(strategy, parse_capacities(capacities), global_batch_size, options, parse_emulate(emulate), policy)
