"""``HeteroDDPStrategy``: DDP where every rank trains on a share of the global batch that matches its speed.

The composition, in the order a fit meets it: (1) the process group, the lab and (2) the loaders come from the
:class:`~lightning_hetero.strategies.core.HeteroCore`; (3) the model (:meth:`_setup_model`): one device steps aside
from DDP, several ranks wrap it in DDP (over each host only with ``periodic_sync``); (4) exact weighting, rank r's
gradient counting b_r / G: each micro-step's loss is scaled by its weight (:meth:`weigh_loss`), b_r·W/G for DDP's
C++ all-reduce when nothing is compressed and no user hook is set, else the factor of the weighting comm hook that
reduces the gradient (:meth:`_register_ddp_hooks`).
"""

from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning_hetero._compat as _compat
from lightning_hetero.config import (
    StartMethod,
    DataSplit,
    MicroBatchArg,
    Observation,
    Profiling,
    Rebalancing,
    Resilience,
    check_ddp_kwargs,
    from_flat_arguments,
)
from lightning_hetero.grad.autocompress import resolve_compression
from lightning_hetero.grad.compression import GradientCompression
from lightning_hetero.grad.compression_config import CompressionArg, parse_compression
from lightning_hetero.grad.periodic import PeriodicSyncArg, periodic_runtime
from lightning_hetero.grad.precision import PrecisionPolicyArg
from lightning_hetero.grad.weighting import WeightingState, loss_weight, scaled, weighted_allreduce_hook
from lightning_hetero.lab.link_pacing import PacedState, paced_hook
from lightning_hetero.plan.capacity import CapacitiesArg
from lightning_hetero.grad.exchange import InBackward
from lightning_hetero.strategies.arguments import parallel_arguments
from lightning_hetero.strategies.core import core_from_arguments
from lightning_hetero.strategies.facade import HeteroFacade
from lightning_hetero.strategies.lifecycle import HeteroLifecycle


# torch's error when a parameter got no gradient in the previous step (what Lightning's own hint matches).
_UNUSED_PARAMETERS = ".*Expected to have finished reduction in the prior iteration.*"


def unused_parameters_hint(strategy: object) -> str:
    """What to do when DDP finds parameters that did not contribute to the loss, naming ``strategy``'s argument."""
    return (
        "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
        "training_step. If this is intentional, let DDP detect them: "
        f"`strategy={type(strategy).__name__}(ddp_kwargs={{\"find_unused_parameters\": True}})` (YAML: "
        "`ddp_kwargs: {find_unused_parameters: true}`)."
    )


class HeteroDDPStrategy(HeteroLifecycle):
    """Data-parallel training over unequal devices, with the math of one device on the global batch.

    The flat spellings of earlier releases (``timeout=``, ``resume=``, ``monitor=``, ``profile_steps=``,
    ``balance=`` ...) still work: each folds into its group below with a ``FutureWarning`` naming the new spelling.

    Args:
        capacities: relative speed of each rank: a list (one per global rank), a mapping from device-name
            substring to weight (``{"A100": 3, "3090": 1, "*": 1}``), or ``"equal"``, ``"peak"`` (published rates),
            ``"profile"`` (measured on the model), ``"auto"`` (best available).
        global_batch_size: samples per optimizer step over all ranks. Default: the loader's ``batch_size`` × world
            size, as plain DDP, so hyper-parameters transfer unchanged. A resumed run keeps its checkpoint's.
        profiling: how ``"profile"``/``"auto"`` capacities are measured (:class:`~lightning_hetero.config.Profiling`).
        rebalance: ``True`` or a :class:`~lightning_hetero.config.Rebalancing`: re-derive shares while training.
        data: how loaders are split (:class:`~lightning_hetero.config.DataSplit`: streams, tokens, micro-batches).
        precision_policy: per-rank mixed precision, one loss scale: ``"auto"`` (bf16 on compute capability >= 8.0,
            fp16 + loss scaling below, fp32 on CPU), one mode for all, a mapping from device-name substring or
            ``"rank:N"`` to a mode, or a :class:`~lightning_hetero.PrecisionPolicy`. ``None``: the Trainer's.
        compression: gradient compression on the wire: ``"none"``, ``"auto"`` (chosen from measured links),
            ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"topk"`` or a :class:`~lightning_hetero.CastCompression` /
            ``PowerSGDCompression`` / ``TopKCompression`` (``hierarchical=True``: compress only between hosts or
            device classes). With ``periodic_sync``: the dtype of the outer exchange (none, fp16, bf16).
        periodic_sync: hosts on a slow link sync every H steps: a :class:`~lightning_hetero.PeriodicSync` (or a dict
            of its fields); exact sync inside each host, an outer step between hosts (local SGD or DiLoCo).
        emulate: emulate a mixed lab on identical devices, one entry per rank: a preset name (``"A100-40GB"``
            ...), a dict (``{"sm_share": 0.25, "memory_gib": 24, "link": "pcie", "slowdown": 3}``) or ``None``.
        resilience: fault timeout, ``resume``, ``nonfinite`` (:class:`~lightning_hetero.config.Resilience`).
        observation: the monitor and the lab table (:class:`~lightning_hetero.config.Observation`).
        ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb``, ``static_graph`` ...).
        start_method: ``"popen"`` (Lightning's script launcher; also torchrun / SLURM), ``"spawn"``, ``"fork"``, ...
        process_group_backend: ``"nccl"``, ``"gloo"`` ... (default: by device).
        accelerator: as for Lightning's ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        checkpoint_io: as for ``DDPStrategy``; default: atomic writes with a ``.sha256`` sidecar, verified on load.
        precision_plugin: as for ``DDPStrategy`` (``precision_policy`` or this, not both).
        ddp_comm_state: the state ``ddp_comm_hook`` receives.
        ddp_comm_hook: a torch comm hook; it receives the weighted gradient.
        ddp_comm_wrapper: wraps ``ddp_comm_hook``, as for ``DDPStrategy``.
    """

    strategy_name = "hetero_ddp"

    def __init__(
        self,
        capacities: CapacitiesArg = "auto",
        global_batch_size: Optional[int] = None,
        profiling: Optional[Profiling] = None,
        rebalance: Union[bool, Rebalancing] = False,
        data: Optional[DataSplit] = None,
        precision_policy: Optional[PrecisionPolicyArg] = None,
        compression: CompressionArg = "none",
        periodic_sync: Optional[PeriodicSyncArg] = None,
        emulate: Optional[list[Union[str, dict[str, Any], None]]] = None,
        resilience: Optional[Resilience] = None,
        observation: Optional[Observation] = None,
        ddp_kwargs: Optional[dict[str, Any]] = None,
        start_method: StartMethod = "popen",
        process_group_backend: Optional[str] = None,
        accelerator: Optional[Union[str, Accelerator]] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        timeout: Optional[float] = None,
        print_table: Optional[bool] = None,
        profile_steps: Optional[int] = None,
        memory_headroom: Optional[float] = None,
        max_batch_per_rank: Optional[int] = None,
        rebalance_every: Optional[int] = None,
        rebalance_threshold: Optional[float] = None,
        rebalance_smoothing: Optional[float] = None,
        monitor: Optional[bool] = None,
        stream_mode: Optional[str] = None,
        resume: Optional[str] = None,
        balance: Optional[str] = None,
        loss_denominator: Optional[str] = None,
        sample_cost: Optional[str] = None,
        micro_batch: Optional[MicroBatchArg] = None,
    ) -> None:
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        options = from_flat_arguments(profiling, rebalance, data, resilience, observation, flat={
            "timeout": timeout, "print_table": print_table, "profile_steps": profile_steps,
            "memory_headroom": memory_headroom, "max_batch_per_rank": max_batch_per_rank,
            "rebalance_every": rebalance_every, "rebalance_threshold": rebalance_threshold,
            "rebalance_smoothing": rebalance_smoothing, "monitor": monitor, "stream_mode": stream_mode,
            "resume": resume, "balance": balance, "loss_denominator": loss_denominator, "sample_cost": sample_cost,
            "micro_batch": micro_batch})
        self.compression_request = parse_compression(compression)  # "auto" is resolved at setup, per fit
        if self.compression_request is not None and (ddp_comm_hook is not None or ddp_comm_wrapper is not None):
            raise ValueError("`compression` and `ddp_comm_hook`/`ddp_comm_wrapper` both own the gradient hook.")
        super().__init__(
            **parallel_arguments(options, start_method, process_group_backend, accelerator, parallel_devices,
                                 cluster_environment, checkpoint_io, precision_plugin, ddp_comm_hook,
                                 ddp_comm_wrapper),
            ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper,
            **check_ddp_kwargs(ddp_kwargs),
        )
        self.core = core_from_arguments(self, capacities, global_batch_size, options, emulate, precision_policy,
                                        precision_plugin)
        self.periodic = periodic_runtime(periodic_sync, self.compression_request, ddp_comm_hook, ddp_comm_wrapper)
        self.compression_config = self.compression_request  # the method in use ("auto" is resolved at setup)
        self.compression: Optional[GradientCompression] = None  # bytes per step, per-rank state (after setup)
        self.weighting: Optional[WeightingState] = None  # the comm hook's weights (None: weighted on the loss)
        self.exchange = InBackward(self._hook_bytes)  # the comm hook runs in the backward
        self.hetero = DDPFacade(self)

    # -- set-up: links and compression ------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        host_link = self.core.lab.link_pacer(len(self.lab.hosts))
        self.compression_config, columns = resolve_compression(self.compression_request, self.lab, self.hetero.groups,
                                                               self.root_device, host_link, self.lightning_module)
        self.hetero.add_lab_columns(columns)
        if self.periodic is not None:  # knows the hosts now; the lab table says what crosses them
            # Its own pacer: the link probe's bytes and pauses stay out of the training step's link statistics.
            pacer = self.core.lab.link_pacer(len(self.lab.hosts))
            self.periodic.setup(self.lab, self.hetero.groups, self.global_rank, pacer)
            self.hetero.add_lab_columns({"between hosts": self.periodic.describe(self.lab)})

    # -- the model ----------------------------------------------------------------------------------------------------
    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # One device: nothing to split or all-reduce, and DDP's wrapper costs a fifth of ResNet-50's step on one GPU.
        if self.world_size == 1:
            return model
        group = self.periodic.process_group_for_ddp() if self.periodic is not None else None
        kwargs, self._ddp_kwargs = self._ddp_kwargs, {**self._ddp_kwargs, "process_group": group}
        try:  # periodic sync: DDP syncs inside the host (None: all ranks)
            return super()._setup_model(model)
        finally:
            self._ddp_kwargs = kwargs

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.compression is not None:  # optimizers exist only now, after the DDP wrap
            self.compression.check_optimizers(self.optimizers)
        if self.periodic is not None and isinstance(self.model, DistributedDataParallel):
            self.periodic.attach(self.model.module, self.optimizers)
            self.core.resilience.rank_states.register("periodic", self.periodic)

    def no_sync(self) -> Any:
        return self.model.no_sync() if isinstance(self.model, DistributedDataParallel) else nullcontext()

    @override
    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            return
        inner_hook, inner_state = self._inner_comm_hook()
        emulator = self.core.lab.emulation
        if inner_hook is None and self.periodic is None and (emulator is None or not emulator.slows_cpu):
            return  # weighted on the loss (`weigh_loss`); DDP's built-in all-reduce averages
        self.weighting = WeightingState(self.world_size, inner_hook=inner_hook, inner_state=inner_state)
        self.model.register_comm_hook(self.weighting, weighted_allreduce_hook)
        if emulator is not None and emulator.slows_cpu:
            self.weighting.observe(emulator.bucket_ready)

    def _inner_comm_hook(self) -> tuple[Optional[Callable], Any]:
        """The averaging hook that receives the weighted bucket: the user's, compression, a paced link; else None."""
        if self.periodic is not None and self.periodic.active:  # compression then is the outer exchange's
            return None, None
        hook, state, wrapper = self._ddp_comm_hook, self._ddp_comm_state, self._ddp_comm_wrapper
        config = self.compression_config
        hierarchical = config is not None and config.hierarchical
        # An emulated slow link between hosts paces the leaders' hop (hierarchical) or the whole exchange (flat).
        pacer = self.core.lab.link_pacer(len(self.lab.hosts) if hierarchical else self.world_size)
        counter = None
        if hook is None and wrapper is None:
            assert isinstance(self.model, DistributedDataParallel)
            self.compression = GradientCompression(
                config, list(self.model.module.parameters()), self.world_size, self.root_device, self.hetero.groups,
                pacer=pacer if hierarchical else None,
            )
            self.core.resilience.rank_states.register("compression", self.compression)  # restored state loads here
            hook, state = self.compression.hook, self.compression.state
            counter = self.compression.counter if hook is not None else None
            if hook is None and pacer is None:
                return None, None
        else:
            hook = wrapper(hook or default_hooks.allreduce_hook) if wrapper is not None else hook
        if pacer is not None and not hierarchical:
            return paced_hook, PacedState(hook or default_hooks.allreduce_hook, state, pacer, counter)
        return hook, state

    # -- exact weighting ----------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.weighting is None or self.core.step.share is None:
            return
        if self.periodic is not None:  # b_r / B_host after the warm-up
            self.periodic.weigh_step(self.weighting, self.core.loaders.train_sampler.rank_sizes_at(batch_idx))
        else:
            self.weighting.add_step(*self.core.step.share)

    def weigh_loss(self, loss: Tensor) -> Tensor:
        """Each micro-step's loss times its own weight, so the reduced gradient is exactly Σ_r (b_r/G) g_r: b_r·W/G
        when DDP's built-in all-reduce averages, the weighting hook's factor when it reduces."""
        share = self.core.step.share
        if share is None or self.world_size == 1:
            return loss
        if self.weighting is not None:
            return scaled(loss, self.weighting.loss_factor)
        return scaled(loss, loss_weight(share[0], share[1], self.world_size))

    def batchnorm_sync_refusal(self) -> Optional[str]:
        # One host leaves periodic sync inactive: DDP then syncs every rank each step, and so may BatchNorm.
        if self.periodic is not None and self.periodic.active:
            return ("`periodic_sync` trains each host on its own between syncs, so there is no global batch to "
                    "normalise over; leave BatchNorm unsynced.")
        return super().batchnorm_sync_refusal()

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        # The weighting keeps the batch's weight: manual optimization may run another backward in this batch.
        out = super().optimizer_step(*args, **kwargs)
        if self.periodic is not None:  # every H steps: the outer step between hosts
            self.periodic.after_optimizer_step()
        if self.compression is not None:
            self.compression.log_step(self.lightning_module)
        return out

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.periodic is not None:  # an overlapped exchange still in flight lands before the end
            self.periodic.finish()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning's hint names its own DDPStrategy, which would drop this strategy: name the argument here.
        _compat.augment_message(exception, pattern=_UNUSED_PARAMETERS, new_message=unused_parameters_hint(self))
        super().on_exception(exception)

    def _hook_bytes(self) -> Optional[int]:  # the last step's bytes on the wire, where a compression hook counts them
        return self.compression.bytes_last_step if self.compression is not None else None


class DDPFacade(HeteroFacade):
    """The façade of :class:`HeteroDDPStrategy`: its weighting comm hook, where it registered one, marks the end of
    the backward."""

    owner: HeteroDDPStrategy

    @property
    def owns_comm_hook(self) -> bool:
        return self.owner.weighting is not None

    def observe_backward_end(self, observer: Callable[[], None], observe: bool = True) -> bool:
        """Call ``observer`` as each gradient bucket enters the comm hook (the last call: the backward ended)."""
        weighting = self.owner.weighting
        if weighting is not None:
            weighting.observe(observer, observe)
        return weighting is not None
