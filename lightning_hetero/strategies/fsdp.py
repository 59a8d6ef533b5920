"""``HeteroFSDPStrategy``: sharded data parallelism (FSDP2) over unequal devices, with one device's math.

The composition (what this module adds to the :class:`~lightning_hetero.strategies.core.HeteroCore`), in the order a
fit meets it:

1. the process group, the lab and the loaders (core), as for DDP: capacities, shares, profiling, rebalancing, data
   sources, per-rank precision, the watchdog, emulation, per-rank checkpoint state;
2. the memory plan (:mod:`lightning_hetero.plan.memory`): how many blocks each rank offloads to host memory and how
   many recompute their activations, from the ``memory`` policy and the lab's memory (a rank that runs its share as
   micro-batches is planned with the model gathered across them and one micro-batch's activations); a job that
   cannot fit fails here with every rank's numbers, and again before the first step once the real shares, micro-batch
   limits and optimizer are known, each rank's step then measured by trial forwards and backwards of half its share
   (or micro-batch) and the whole of it (:func:`~lightning_hetero.plan.activations.measured_samples`,
   :mod:`lightning_hetero.strategies.trial_step`) in place of the counted activations;
   after the first steps each rank's measured peak is logged beside its estimate;
3. the model (:func:`~lightning_hetero.grad.sharding.shard_module`): blocks, then the root, sharded on a 1-D mesh
   (one host) or a 2-D HSDP mesh (equal hosts), never splitting a tied parameter; the optimizers are built on the
   shards;
4. the steps (:meth:`FSDP2Lifecycle.run_step`): each runs through the sharded root's ``__call__`` with its
   ``forward`` redirected to the step, as Lightning runs DDP's wrapper, so the root's parameters are gathered whatever
   the step calls;
5. exact weighting (:meth:`HeteroFSDPStrategy.weigh_loss`): each rank's loss times b_r·W/G, so FSDP's averaging
   reduce-scatter gives Σ_r (b_r/G) g_r; accumulation steps skip the reduce-scatter (:meth:`block_backward_sync`);
   a rank's micro-batches keep its parameters gathered, so every rank joins the same collectives (:meth:`no_sync`);
6. checkpoints (:mod:`lightning_hetero.resilience.sharded`): sharded directories written atomically with torch's
   distributed checkpoint, resumable on another world size, exportable to one file.

Lightning's own FSDP2 strategy (``ModelParallelStrategy``) needs the model to shard itself in ``configure_model`` and
launches by script only, so :class:`FSDP2Lifecycle` below is built on the lifecycle (``DDPStrategy`` for its process
group and launchers), and never builds a DDP wrapper. The chain: ``DDPStrategy`` ← ``HeteroLifecycle`` ←
``FSDP2Lifecycle`` (FSDP2's Lightning overrides) ← ``HeteroFSDPStrategy`` (the memory plan and the weighting).
"""

import importlib
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero.config import (
    DataSplit,
    Observation,
    Profiling,
    Rebalancing,
    Resilience,
    StartMethod,
    check,
    from_flat_arguments,
)
from lightning_hetero.data.microbatch import micro_limits
from lightning_hetero.grad.host_optimizer import HostStep, install_host_steps
from lightning_hetero.grad.precision import PrecisionPolicyArg
from lightning_hetero.grad.sharding import (
    check_ties,
    device_mesh,
    gathered_across_micro_batches,
    is_sharded,
    keep_blocks_gathered,
    mixed_precision,
    set_gradient_sync,
    shard_module,
)
from lightning_hetero.grad.weighting import loss_weight, scaled
from lightning_hetero.plan.activations import StepBytes, measure_step_bytes, resident_bytes
from lightning_hetero.plan.blocks import default_blocks, tied_parameters
from lightning_hetero.plan.capacity import CapacitiesArg
from lightning_hetero.plan.memory import (
    MemoryFitError,
    MemoryPolicy,
    MemoryPolicyArg,
    ModelFootprint,
    RankMemory,
    device_budget,
    memory_column,
    micro_batches,
    optimizer_slots,
    parse_memory_policy,
    report_peaks,
    resolve_memory,
)
from lightning_hetero.lab.shared_gpu import shared_device_backend
from lightning_hetero.resilience.checkpoint import CheckpointError, verify_manifest, write_manifest
from lightning_hetero.resilience.sharded import is_sharded_checkpoint, load_sharded, save_sharded
from lightning_hetero.strategies.arguments import parallel_arguments
from lightning_hetero.strategies.core import core_from_arguments
from lightning_hetero.strategies.facade import HeteroFacade
from lightning_hetero.strategies.lifecycle import HeteroLifecycle, StepName, connected_module
from lightning_hetero.strategies.trial_step import sample_batches, trial_steps


_ROOT_REDIRECTION = _compat.ForwardRedirection()
# Each step's precision context, as Lightning's own steps enter it.
_STEP_CONTEXTS: dict[str, Callable[[Precision], AbstractContextManager[Any]]] = {
    "training_step": lambda p: p.train_step_context(), "validation_step": lambda p: p.val_step_context(),
    "test_step": lambda p: p.test_step_context(), "predict_step": lambda p: p.predict_step_context()}

# The measured peaks are compared with the plan after this many optimizer steps (the optimizer state exists by then).
PEAK_AFTER_STEPS = 2


class FSDP2Lifecycle(HeteroLifecycle):
    """The lifecycle with FSDP2 sharding instead of the DDP wrapper, and sharded checkpoints. What each rank shards,
    recomputes and offloads is the strategy's (its ``configure_ddp`` shards the model in place)."""

    @override
    def connect(self, model: Any) -> None:
        super().connect(model)
        # Before `configure_model`: a module that shards itself there must keep these ties.
        self._ties_before_sharding = tied_parameters(model)

    # -- steps: through the sharded root's `__call__`, so FSDP2's root pre-forward gathers the root's parameters ----
    @override
    def run_step(self, name: StepName, *args: Any, **kwargs: Any) -> Any:
        # The root is the LightningModule itself, so Lightning's own steps call it unwrapped: a step that uses
        # `self.model(...)` would meet the root's parameters (embeddings, heads) still sharded.
        module = connected_module(self)
        with _STEP_CONTEXTS[name](self.precision_plugin):
            return _ROOT_REDIRECTION(module, module, name, *args, **kwargs)

    @override
    def model_to_device(self) -> None:
        # Fitting: `fully_shard` places each shard (on the device, or in host memory where offloaded); moving the
        # whole model first would need it to fit the smallest card.
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            super().model_to_device()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        set_gradient_sync(self.lightning_module, False)  # accumulation: each rank sums locally, no reduce-scatter
        try:
            yield
        finally:
            set_gradient_sync(self.lightning_module, True)

    # -- checkpoints: a directory of shards, written by every rank ------------------------------------------------
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
        return {}  # `save_checkpoint` writes the shards

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def write_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        # Rank 0 writes the directory's checksum manifest once every shard is on disk, before it is published.
        save_sharded(self.broadcast(str(filepath)), checkpoint, self.lightning_module, list(self.optimizers),
                     self.global_rank, self.barrier, before_publish=write_manifest)

    @override
    def read_checkpoint(self, path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        path = self.broadcast(str(path))
        if not is_sharded_checkpoint(path):
            return super().read_checkpoint(path, weights_only)  # one full file (e.g. from one device)
        problem = self.broadcast(verify_manifest(path) if self.global_rank == 0 else None)  # one verdict for all
        if problem is not None:
            raise CheckpointError(f"cannot resume from {path!r}: {problem}")
        checkpoint = load_sharded(path, self.lightning_module, list(self.optimizers),
                                  strict=self.lightning_module.strict_loading)
        checkpoint["state_dict"] = {}  # loaded already; Lightning's own model load is a no-op
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if checkpoint.get("state_dict"):  # a full file: every rank keeps its shard of it
            set_model_state_dict(self.lightning_module, checkpoint["state_dict"],
                                 options=StateDictOptions(full_state_dict=True, strict=strict))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        module = self._lightning_module
        if module is not None and is_sharded(module) and not getattr(module, "_hetero_full_state", False):
            # After fit, `state_dict()` returns whole tensors, as after DDP (the spawn/fork launchers hand rank 0's to
            # the main process). Each call gathers: every rank calls it, as those launchers do.
            module.register_state_dict_post_hook(_gather_whole_tensors)
            module._hetero_full_state = True
        # As Lightning's FSDPStrategy, the optimizer state stays where it is: the base teardown copies all of it to
        # the host, and where offloaded blocks already fill host memory that copy gets the rank killed at the fit's
        # end (a 13B GPT on 52 + 22 GiB, 251 GiB of host memory).
        with _compat.optimizers_set_aside(self):
            super().teardown()


class HeteroFSDPStrategy(FSDP2Lifecycle):
    """Sharded training over unequal devices: per-rank batch shares, per-rank memory modes, one device's math.

    Args:
        memory: what each rank keeps in device memory: ``"auto"`` (per rank, the fewest offloaded blocks, then the
            fewest recomputed blocks, that fit), per-block counts (``"offload:4,checkpoint:all"``), whole-rank modes
            (``"keep"``, ``"checkpoint"``, ``"offload"``, ``"checkpoint_offload"``), a mapping from device-name
            substring or ``"rank:N"`` to one of those, or a :class:`~lightning_hetero.MemoryPolicy`. A job that
            cannot fit fails before its first step with every rank's numbers.
        blocks: dotted class paths (``"mypkg.model.Block"``) of the modules to shard one by one (one all-gather
            each). Default: the entries of the model's ``nn.ModuleList`` s, else every module with parameters of its
            own. A model that shards itself in ``configure_model`` keeps its sharding.
        hybrid: on several hosts with equal GPU counts, shard inside each host and replicate across hosts (HSDP), so
            only the replicated gradient all-reduce crosses the slow link. Unequal hosts shard over all ranks.
        capacities: relative speed of each rank, as for :class:`~lightning_hetero.HeteroDDPStrategy`, except that a
            sharded step lasts as long as the slowest rank's, so ``"auto"`` takes the published rates (equal where
            there are none) and ``"profile"`` is refused.
        global_batch_size: samples per optimizer step over all ranks, as for ``HeteroDDPStrategy``.
        profiling: how the memory caps are profiled (:class:`~lightning_hetero.config.Profiling`).
        rebalance: refused (``ValueError``): a sharded step lasts as long as the slowest rank's, so a rank's wait
            for the others would count as its own time. Keep the default ``False``.
        data: how loaders are split (:class:`~lightning_hetero.config.DataSplit`); with ``micro_batch`` a rank runs
            its share in several pieces, its parameters gathered once for all of them (see ``docs/fsdp.md``).
        precision_policy: per-rank mixed precision, as for ``HeteroDDPStrategy`` (bf16 all-gather and
            reduce-scatter when every rank trains in bf16; fp32 master weights always).
        emulate: emulate a mixed lab on identical devices, as for ``HeteroDDPStrategy``.
        resilience: fault timeout, ``resume``, ``nonfinite`` (:class:`~lightning_hetero.config.Resilience`).
        observation: the monitor and the lab table (:class:`~lightning_hetero.config.Observation`).
        start_method: ``"popen"`` (Lightning's script launcher; also torchrun / SLURM), ``"spawn"`` or ``"fork"``.
        process_group_backend: ``"nccl"``, ``"gloo"`` ... (default: by device).
        accelerator: as for Lightning's ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``; one CUDA index repeated (``one_gpu(2)`` from
            :mod:`lightning_hetero.lab.shared_gpu`) puts several ranks on one GPU (gloo; memory and correctness, not
            speed).
        cluster_environment: as for ``DDPStrategy``.
        checkpoint_io: as for ``DDPStrategy``; default: atomic writes, verified by their checksums.
        precision_plugin: as for ``DDPStrategy`` (``precision_policy`` or this, not both).
    """

    strategy_name = "hetero_fsdp"
    sharded = True

    def __init__(
        self,
        memory: MemoryPolicyArg = "auto",
        blocks: Optional[list[str]] = None,
        hybrid: bool = True,
        capacities: CapacitiesArg = "auto",
        global_batch_size: Optional[int] = None,
        profiling: Optional[Profiling] = None,
        rebalance: Union[bool, Rebalancing] = False,
        data: Optional[DataSplit] = None,
        precision_policy: Optional[PrecisionPolicyArg] = None,
        emulate: Optional[list[Union[str, dict[str, Any], None]]] = None,
        resilience: Optional[Resilience] = None,
        observation: Optional[Observation] = None,
        start_method: StartMethod = "popen",
        process_group_backend: Optional[str] = None,
        accelerator: Optional[Union[str, Accelerator]] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self.memory_policy: MemoryPolicy = parse_memory_policy(memory)
        self._block_paths = _check_blocks(blocks)
        check("", "hybrid", hybrid, isinstance(hybrid, bool), "True or False")
        self.hybrid = hybrid
        options = from_flat_arguments(profiling, rebalance, data, resilience, observation, flat={})
        # Several ranks on one GPU (an emulation mode): gloo, and no device binding (lightning_hetero.lab.shared_gpu).
        process_group_backend = shared_device_backend(parallel_devices, process_group_backend)
        super().__init__(**parallel_arguments(options, start_method, process_group_backend, accelerator,
                                              parallel_devices, cluster_environment, checkpoint_io, precision_plugin))
        self.core = core_from_arguments(self, capacities, global_batch_size, options, emulate, precision_policy,
                                        precision_plugin, sharded=self.sharded)
        self.hetero = ShardedFacade(self)
        self._ties_before_sharding: list[tuple[str, ...]] = []  # recorded when Lightning connects the model
        self.memory_plan: Optional[list[RankMemory]] = None  # every rank's mode and estimate (after setup)
        self.memory_peaks: Optional[list[Optional[int]]] = None  # measured after the first steps (CUDA)
        self._footprint: Optional[ModelFootprint] = None
        self.host_steps: list[HostStep] = []  # the wrapped steps of the optimizers with offloaded parameters

    @property
    def blocks(self) -> Optional[tuple[type[nn.Module], ...]]:
        """The block classes given by ``blocks`` (``None``: chosen from the model at setup)."""
        return None if self._block_paths is None else tuple(_import_class(p) for p in self._block_paths)

    # -- memory plan and sharding ---------------------------------------------------------------------------------
    @override
    def configure_ddp(self) -> None:
        module = connected_module(self)  # sharded in place: `self.model` stays the LightningModule
        blocks = self.blocks or default_blocks(module)
        # The choices that decide which collectives every rank joins (one host's config that differs would hang the
        # first all-gather until the resilience timeout instead).
        _same_on_every_rank({"blocks": sorted(f"{b.__module__}.{b.__qualname__}" for b in blocks),
                             "memory.keep_gathered": self.memory_policy.keep_gathered}, self.world_size)
        self._footprint = ModelFootprint.of(module, blocks, optimizer_slots(None))
        # The plan's split of an explicit global batch (none yet otherwise: the shares are known at the loader).
        # Explicit micro-batch limits are known here, before the loader; "auto" ones follow the profiled caps and
        # are counted by the check before the first step.
        samples = list(self.plan.split) or [0] * self.world_size
        self.memory_plan = self._plan_memory(samples, self.memory_policy, self._micro_limits())
        plan = self.memory_plan[self.global_rank]
        hosts = self.lab.hosts if self.hybrid else {"all": tuple(range(self.world_size))}
        modes = self.core.precision.modes or (str(getattr(self.precision_plugin, "precision", "32-true")),)
        shard_module(module, device_mesh(hosts, self.root_device.type), blocks, checkpoint=plan.checkpoint_blocks,
                     offload=plan.offload_blocks, mp_policy=mixed_precision(modes),
                     reshard_after_forward=not plan.keep_gathered)
        check_ties(module, self._ties_before_sharding)
        self.hetero.add_lab_columns({"memory": memory_column(self.memory_plan, self.memory_policy)})

    def _plan_memory(self, samples: list[int], policy: MemoryPolicy, micro: Optional[list[Optional[int]]],
                     steps: Optional[list[Optional[StepBytes]]] = None) -> list[RankMemory]:
        assert self._footprint is not None
        hosts = self.lab.hosts
        equal_hosts = self.hybrid and len(hosts) > 1 and len({len(r) for r in hosts.values()}) == 1
        shard_ranks = len(next(iter(hosts.values()))) if equal_hosts else self.world_size
        budgets = [device_budget(d, policy.headroom) for d in self.lab.devices]
        return resolve_memory(policy, self._footprint, self.lab.devices, samples, budgets, shard_ranks,
                              micro_limits=micro, steps=steps)

    def _micro_limits(self) -> Optional[list[Optional[int]]]:
        """Every rank's samples per forward/backward, as the loader split derives them (``None``: no micro-batches)."""
        return micro_limits(self.core.loaders.micro_batch, self.plan.caps, self.world_size)

    @override
    def on_train_start(self) -> None:
        """Before the first step: the plan's modes checked again with the real shares and optimizer; the host step
        of the offloaded parameters installed (:mod:`lightning_hetero.grad.host_optimizer`)."""
        super().on_train_start()
        self.host_steps, note = install_host_steps(self.optimizers, self.lightning_module.trainer,
                                                   self.lightning_module, self.memory_policy.host)
        notes: list[Any] = [note] * self.world_size
        if self.world_size > 1:
            torch.distributed.all_gather_object(notes, note)
        rank_zero_info("; ".join(f"rank {r}: {n}" for r, n in enumerate(notes)))
        sampler = self.core.loaders.train_sampler
        if sampler is None or self._footprint is None or self.memory_plan is None:
            return
        slots = optimizer_slots(self.optimizers[0] if self.optimizers else None)
        self._footprint = replace(self._footprint, optimizer_slots=slots)
        chosen = replace(self.memory_policy, rules={f"rank:{p.rank}": p.mode for p in self.memory_plan},
                         keep_gathered=self.memory_plan[0].keep_gathered)
        samples = list(sampler.split_at(0, sampler.global_batch_len(0)))
        steps = self._measure_steps(samples[self.global_rank])
        try:
            try:
                self.memory_plan = self._plan_memory(samples, chosen, self._micro_limits(), steps)
            except MemoryFitError:
                if not chosen.keep_gathered or self.memory_policy.keep_gathered != "auto":
                    raise
                # "auto" kept the blocks gathered by the count at setup; the step as it runs has no room: reshard
                # (the same verdict on every rank: the plan is derived from every rank's numbers).
                keep_blocks_gathered(self.lightning_module, False)
                chosen = replace(chosen, keep_gathered=False)
                rank_zero_info("memory plan: no room for the blocks kept gathered (`memory.keep_gathered` 'auto') "
                               "once the step is counted: resharded after forward.")
                steps = self._measure_steps(samples[self.global_rank])
                self.memory_plan = self._plan_memory(samples, chosen, self._micro_limits(), steps)
        except MemoryFitError as err:
            unknown = _unknown_at_setup(self.memory_policy, steps, self.plan.global_batch_size is None,
                                        self.core.loaders.micro_batch == "auto")
            if not unknown:
                raise
            # The model was sharded before the loader existed: its plan could not count what only the loader knows.
            raise MemoryFitError(f"{err} The plan was chosen at setup, before the batch shares, memory caps and "
                                 f"step bytes were known: {'; '.join(unknown)}.") from None
        self.hetero.add_lab_columns({"memory": memory_column(self.memory_plan, self.memory_policy)})
        near = [p for p in self.memory_plan if p.near_budget]
        if near and self.global_rank == 0:
            rank_zero_warn("the memory plan fills its budget to within 2 % on " + "; ".join(p.describe() for p in near)
                           + ": one allocator fragment more may run the rank out of memory; raise `memory.headroom`, "
                           "lower its share or allow it to checkpoint/offload more blocks.")

    def _measure_steps(self, share: int) -> Optional[list[Optional[StepBytes]]]:
        """Every rank's step bytes, measured by trial forward/backward passes under its plan (a collective: every
        rank runs the same trials); ``None`` (the plan counts them) where no rank can build a sample batch."""
        module = self.lightning_module
        why = ""
        if not self.memory_policy.measure:
            why = "`memory.measure` is off"
        elif self.memory_policy.activation_bytes_per_sample is not None:
            why = "`memory.activation_bytes_per_sample` is given"
        elif not module.automatic_optimization:
            why = "manual optimization (the training step runs its own backward)"
        batches, no_batches = sample_batches(module.trainer.train_dataloader) if not why else (None, why)
        if batches is None:
            rank_zero_info(f"memory plan: counted, not measured: {no_batches}.")
            return None

        # A rank that splits its share measures one micro-batch, as its forward/backward runs it.
        limits = self._micro_limits()
        # BatchNorm layers that train need two samples (torch refuses one) and the synced layer
        # synchronises only inside a step.
        batch_norm = any(isinstance(m, _compat.BatchNormBase) and m.training for m in module.modules())
        resident = resident_bytes(self.root_device, module, self.optimizers)
        trials = trial_steps(module, self.root_device, lambda batch: self.run_step("training_step", batch, 0),
                             self.batch_to_device)
        # On the step's stream: the trials allocate the kernel workspaces a step does.
        with trials as trial, self.core.lab.emulated_stream():
            step = measure_step_bytes(lambda samples: trial(batches(samples)),
                                      micro_batches(share, limits[self.global_rank] if limits else None)[1],
                                      self.root_device, least=2 if batch_norm else 1)
        step = replace(step, resident=resident)
        if self.world_size == 1:
            return [step]
        gathered: list[Optional[StepBytes]] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, step)
        return gathered

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.lightning_module.trainer.global_step == PEAK_AFTER_STEPS:
            self._report_peaks()

    @override
    def on_train_end(self) -> None:
        self._report_peaks()  # a run shorter than PEAK_AFTER_STEPS steps
        for host in self.host_steps:
            host.uninstall()
        super().on_train_end()

    def _report_peaks(self) -> None:
        """Every rank's measured peak beside its estimate, once (a collective: every rank calls it)."""
        if self.memory_plan is None or self.memory_peaks is not None:
            return
        self.memory_peaks = report_peaks(self.memory_plan, self.lab.devices, self.memory_policy.headroom,
                                         self.root_device, self.lightning_module.trainer.global_step, self.global_rank)

    def no_sync(self) -> Any:
        """Around each micro-batch but a rank's last: the parameters stay gathered and gradients accumulate
        unsharded, so every rank joins the same collectives whatever number of micro-batches it runs."""
        return gathered_across_micro_batches(self.lightning_module)

    # -- exact weighting --------------------------------------------------------------------------------------------
    def weigh_loss(self, loss: Tensor) -> Tensor:
        """b_r·W/G times the loss: FSDP's reduce-scatter averages over the W ranks (both mesh dimensions with HSDP),
        which leaves Σ_r (b_r/G) g_r, exact per micro-step (accumulation with partial batches included)."""
        share = self.core.step.share
        if share is None or self.world_size == 1:
            return loss
        return scaled(loss, loss_weight(share[0], share[1], self.world_size))


class ShardedFacade(HeteroFacade):
    """The façade of :class:`HeteroFSDPStrategy`: its memory plan."""

    owner: "HeteroFSDPStrategy"

    @property
    def memory_plan(self) -> Optional[list[Any]]:
        return self.owner.memory_plan


def _unknown_at_setup(policy: MemoryPolicy, steps: Optional[list[Optional[StepBytes]]], no_global_batch: bool,
                      auto_micro_batch: bool) -> list[str]:
    """What the plan made when the model was sharded could not count, each with the argument that gives it."""
    unknown = []
    if steps is not None and any(rule == "auto" for _, rule in policy.rank_rules.rules):
        # "auto" chose its blocks when the model was sharded, before the step could be measured: with the measured
        # bytes per sample given, it plans with them there.
        most = max(s.per_sample for s in steps if s is not None)
        unknown.append(f"give `memory.activation_bytes_per_sample` >= {most} (the most a sample measured here) so "
                       "that `auto` plans with it when the model is sharded")
    if no_global_batch:
        unknown.append("give `global_batch_size` so that it counts each rank's activations")
    if auto_micro_batch:
        unknown.append("give `data.micro_batch` as numbers so that it counts the micro-batches")
    return unknown


def _same_on_every_rank(mine: dict[str, Any], world_size: int) -> None:
    """Refuse, naming the field and every rank's value, a setting in ``mine`` that differs between ranks (a
    collective: every rank calls it).

        >>> _same_on_every_rank({"memory.keep_gathered": False}, world_size=2)
    """
    every: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(every, mine)
    for field in mine:
        values = [e[field] for e in every]
        if any(v != values[0] for v in values):
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"`{field}` differs between ranks ({each}): it must be the same on every rank of a "
                             "sharded job.")


def _gather_whole_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[name] = _full_tensor(value)


def _full_tensor(value: DTensor) -> Tensor:
    """The whole tensor on ``value``'s device, also after teardown moved the shards to the CPU while the mesh is a
    CUDA one. A mesh of gloo groups (ranks sharing a GPU) gathers CPU copies: DTensor's all-gather runs gloo's
    coalesced all-gather, which hands CUDA pointers to the host and kills the process with SIGSEGV (torch 2.11,
    pytorch/pytorch#152645; ``tests/gpu/repro_gloo_cuda_gather.py``). NCCL cannot gather CPU tensors: there a shard
    is gathered on the mesh's device.

        >>> whole = _full_tensor(model.weight)   # every rank calls it: a collective
    """
    mesh = value.device_mesh
    if mesh.device_type == "cpu" or (value.device.type == mesh.device_type and not _gloo_mesh(mesh)):
        return value.full_tensor()
    if _gloo_mesh(mesh):
        mesh, device = _cpu_mesh(mesh), torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
    local = value.to_local().to(device)
    moved = DTensor.from_local(local, mesh, value.placements, shape=value.shape, stride=value.stride())
    return moved.full_tensor().to(value.device)


def _gloo_mesh(mesh: DeviceMesh) -> bool:
    return all("gloo" in torch.distributed.get_backend(mesh.get_group(dim)) for dim in range(mesh.ndim))


def _cpu_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``'s ranks and groups as a CPU mesh: no new group (ranks sharing a GPU over gloo cannot create one), no
    collective."""
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    if mesh.ndim == 1:
        return DeviceMesh.from_group(groups[0], "cpu", mesh_dim_names=mesh.mesh_dim_names)
    return DeviceMesh.from_group(groups, "cpu", mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)


def _check_blocks(blocks: Optional[list[str]]) -> Optional[tuple[str, ...]]:
    ok = blocks is None or (isinstance(blocks, (list, tuple)) and len(blocks) > 0 and all(
        isinstance(b, str) and "." in b for b in blocks))
    check("", "blocks", blocks, ok, "None or a non-empty list of dotted class paths ('package.module.Class')")
    return None if blocks is None else tuple(blocks)


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(module_name), name, None)
    check("", "blocks", path, isinstance(found, type) and issubclass(found, nn.Module), "nn.Module classes")
    return found  # type: ignore[return-value]
