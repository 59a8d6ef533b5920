# ruff: noqa: F401, E402
"""Every private Lightning / torch name the package uses, in one place.

Each entry says which public API is missing. Nothing else in the package imports a ``_``-prefixed name from
``lightning`` or ``torch``: when an upstream release moves one of these, this file is the only one to change.
"""

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

# Checkpoint paths: Lightning's `_PATH` alias has no public spelling.
PathType = Union[str, PathLike]

# Whether a path is on the local file system (atomic rename and fsync apply): Lightning has no public helper;
# fsspec's own protocol test is what `_is_local_file_protocol` wraps.
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol as is_local_path  # noqa: E402

# Every generator's state (torch, numpy, random, CUDA) in the layout Lightning's checkpoints use: public
# `seed_everything` sets seeds but cannot capture or restore a running state.
from lightning.fabric.utilities.seed import _collect_rng_states as collect_rng_states  # noqa: E402
from lightning.fabric.utilities.seed import _set_rng_states as set_rng_states  # noqa: E402

# The process group set-up with our own rendezvous store: `DDPStrategy.setup_distributed` builds its store inside,
# and takes none from outside.
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: E402

# Whether a tensor is a view of another (FSDP2 warns when a sharded module returns one): no public predicate.
def is_view(tensor: object) -> bool:
    return getattr(tensor, "_base", None) is not None


# Rewriting a known error's message in place, as Lightning's strategies do in `on_exception`: no public helper.
from lightning.pytorch.utilities.exceptions import _augment_message as augment_message  # noqa: E402

# The prediction loop's index-tracking batch-sampler wrapper: no public name, and a rebuilt prediction loader must
# keep it for `return_predictions` / `BasePredictionWriter` batch indices.
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper as IndexBatchSamplerWrapper  # noqa: E402

# PowerSGD's building blocks: torch exposes only the whole hook, not its orthogonalisation or the compress test.
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (  # noqa: E402
    _orthogonalize as powersgd_orthogonalize,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (  # noqa: E402
    _orthogonalize_gram_schmidt as powersgd_orthogonalize_gram_schmidt,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (  # noqa: E402
    _should_compress as powersgd_should_compress,
)

# A DataLoader's constructor arguments as the user wrote them: Lightning records them while its `*_dataloader` hooks
# run (the same record its own sampler injection re-instantiates from); there is no public accessor.
_SAVED = ("__pl_saved_args", "__pl_saved_kwargs", "__pl_saved_arg_names")


def recorded_loader_arguments(dataloader: object) -> "Optional[tuple[tuple, dict, tuple]]":
    """``(args, kwargs, positional names)`` Lightning recorded for ``dataloader``, or ``None``."""
    if not all(hasattr(dataloader, name) for name in _SAVED):
        return None
    args, kwargs, names = (getattr(dataloader, name) for name in _SAVED)
    return tuple(args), dict(kwargs), tuple(names)


# Re-instantiate an object of a class Lightning wrapped, replaying the attribute assignments it recorded after
# `__init__` (what Lightning's own loader re-instantiation does).
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls as reinstantiate  # noqa: E402


def prediction_records(trainer: Any) -> "list[list[list]]":
    """Per predict loader, the lists the prediction loop appends one entry per step to: the outputs it keeps (for
    ``return_predictions`` and epoch writers; a private attribute) and their batch indices (epoch writers). Edited in
    place to leave a step out: Lightning has no public way to."""
    loop = trainer.predict_loop
    outputs, indices = getattr(loop, "_predictions", []), loop.epoch_batch_indices
    return [[kept[i] for kept in (outputs, indices) if i < len(kept) and isinstance(kept[i], list)]
            for i in range(max(len(outputs), len(indices)))]


def unwrap_index_batch_sampler(batch_sampler: object) -> object:
    """The batch sampler inside the prediction loop's index wrapper (it exposes it under a private name only)."""
    if isinstance(batch_sampler, IndexBatchSamplerWrapper):
        return getattr(batch_sampler, "_batch_sampler")
    return batch_sampler


# Lightning's process launchers (popen script re-execution, spawn/fork), subclassed to resolve `resume` before `fit`
# selects its checkpoint: strategies choose their launcher class, but the classes have no public names.
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher  # noqa: E402
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher  # noqa: E402


def trainer_of(module: object) -> "Optional[Trainer]":
    """The trainer a LightningModule is attached to, or ``None``: the public ``module.trainer`` raises when detached."""
    return getattr(module, "_trainer", None)


def inside_lightning_hook(module: object) -> bool:
    """Whether Lightning is running one of ``module``'s hooks now (``self.log`` is allowed only there)."""
    return getattr(module, "_current_fx_name", None) is not None


# The name of the trainer method a launcher runs for `fit`: launchers receive the bound method, with no public marker
# of which entry point it is.
FIT_FUNCTION_NAME = "_fit_impl"


def move_batch_to_device(module: object, batch: object, device: object) -> object:
    """The batch through the module's transfer hooks to ``device``, as the training loop moves it (no public call
    runs all three hooks)."""
    return module._apply_batch_transfer_handler(batch, device=device)  # type: ignore[attr-defined]


def queue_after_backward(callback: "Callable[[], None]") -> None:
    """Run ``callback`` once the running backward pass has accumulated every gradient: autograd's engine has no
    public way to queue it (DDP uses the same call for its end-of-backward work)."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> object:
    """The default process group's rendezvous store (torch has no public accessor)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def init_process_group(strategy: object, store: object, bind_device: bool) -> None:
    """Lightning's ``setup_distributed`` for ``strategy`` with our own rendezvous ``store`` (Lightning's builds its
    store inside and takes none from outside; the backend and timeout live in the strategy's private fields).
    ``bind_device``: bind the process group to the rank's device (``device_id``)."""
    strategy.set_world_ranks()  # type: ignore[attr-defined]
    strategy._process_group_backend = strategy._get_process_group_backend()  # type: ignore[attr-defined]
    root = strategy.root_device  # type: ignore[attr-defined]
    init_dist_connection(strategy.cluster_environment, strategy._process_group_backend,  # type: ignore[attr-defined]
                         timeout=strategy._timeout, store=store,  # type: ignore[attr-defined]
                         device_id=root if bind_device else None)


# Activation checkpointing applied to a module in place (parameter names unchanged, so a checkpointed rank's state
# dict matches the others'): torch's composable `checkpoint` has no public import path; the public
# `torch.utils.checkpoint.checkpoint` needs a wrapper module, which renames every parameter.
from torch.distributed._composable import checkpoint as checkpoint_module_in_place  # noqa: E402

def fsdp_offloads(module: object) -> bool:
    """Whether ``fully_shard`` gave ``module``'s own parameters a CPU offload policy: FSDP2 keeps the policy in its
    private per-module state and has no public accessor (tests read it to check a per-block plan was applied)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return any(isinstance(group.offload_policy, CPUOffloadPolicy) for group in _fsdp_param_groups(module))


def _fsdp_param_groups(module: object) -> list[Any]:
    """An FSDP2 module's parameter groups: torch 2.13 keeps a list per module, earlier releases one group (or None)."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [getattr(state, "_fsdp_param_group", None)]
    return [g for g in groups if g is not None]


def host_gradient_waits(module: object) -> Optional[list[tuple[Any, Callable[[], None]]]]:
    """For each parameter of ``module``'s own that FSDP2 keeps in host memory (a CPU offload policy): the parameter
    and a call that returns once its gradient's copy to host memory has finished. FSDP2 records that copy's event in
    its private per-parameter state (``grad_offload_event``, ``None`` when the copy blocked or FSDP already waited)
    and waits for it only at the end of the backward; ``None`` where this torch keeps no such record (a gradient is
    then known complete only after the backward)."""
    records = [r for g in _fsdp_param_groups(module) for r in g.fsdp_params if getattr(r, "offload_to_cpu", False)]
    if any(not hasattr(r, "grad_offload_event") for r in records):
        return None

    def waiter(record: Any) -> Callable[[], None]:
        def wait() -> None:
            event = record.grad_offload_event
            if event is not None:
                event.synchronize()
        return wait

    return [(r.sharded_param, waiter(r)) for r in records]


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels (``fused=True``) run on: torch's list is private; a torch
    without it (before 2.4) has no fused CPU kernel."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:
        return ["cuda"]
    return list(_get_fused_kernels_supported_devices())


def remove_warnings_filter(entry: tuple) -> None:
    """Remove one entry of ``warnings.filters``: the module adds filters in public (``filterwarnings``) but has no
    public call to remove one, and its per-module caches must be told that the list changed."""
    import warnings

    try:
        warnings.filters.remove(entry)
    except ValueError:  # already gone (e.g. `warnings.resetwarnings()`)
        return
    warnings._filters_mutated()  # type: ignore[attr-defined]

def slurm_requeue(trainer: object, signum: int) -> None:
    """Lightning's SLURM auto-requeue (save the HPC checkpoint, ``scontrol requeue`` on rank 0): only reachable as
    the signal connector's private handler, which must not run inside a signal handler here (it saves, a collective).
    """
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)  # type: ignore[attr-defined]


def skip_sigterm_broadcast(trainer: object) -> Callable[[], None]:
    """Turn off the training loop's per-step broadcast of Lightning's SIGTERM flag; returns the undo.

    Lightning's training loop (2.6; releases without the method have nothing to turn off) makes rank 0's flag a
    device tensor, broadcasts it and reads it back with ``.item()`` before every training batch with several ranks: on
    GPUs the host waits for the device at every step, and the device idles while the host fetches the next batch. No
    public switch turns it off.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
        return lambda: None
    loop._broadcast_sigterm_tensor = lambda: None  # an instance attribute over the method: this trainer only

    def undo() -> None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    return undo


def weights_only_argument(load: Callable[..., Any], weights_only: Optional[bool]) -> dict[str, Optional[bool]]:
    """``{"weights_only": weights_only}`` when ``load`` takes that argument, else ``{}``.

    Lightning 2.6 added ``weights_only`` to ``Strategy.load_checkpoint`` and ``CheckpointIO.load_checkpoint``; 2.5 has
    it on neither (and never passes it), so an override that forwards it must leave it out there.
    """
    return {"weights_only": weights_only} if "weights_only" in inspect.signature(load).parameters else {}


def launcher_strategy(launcher: object) -> object:
    """The strategy a Lightning process launcher was made for (kept under a private name)."""
    return launcher._strategy  # type: ignore[attr-defined]


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Join torch's fake process group as ``rank`` of ``world_size``: collectives return at once with outputs of the
    right shapes (all-gathers copy the local input), so one process can run one rank of a job alone. torch ships it
    only under ``torch.testing._internal`` (there is no public no-communication backend for dry runs)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # The fake group's broadcast leaves a receiver's buffers as they were, so `broadcast_object_list` would unpickle
    # garbage sizes there: in a rehearsal every rank keeps its own objects (paths, flags: alike on every rank).
    dist.broadcast_object_list = _keep_local_objects


def _keep_local_objects(object_list: list, src: Optional[int] = None, group: Any = None, device: Any = None,
                        group_src: Optional[int] = None) -> None:
    return None


def init_rehearsal_process_group(strategy: object, rank: int, world_size: int) -> None:
    """:func:`init_process_group` for a rehearsal: the strategy's ranks set, its (private) backend field named
    "fake", and the fake process group joined."""
    strategy.set_world_ranks()  # type: ignore[attr-defined]
    strategy._process_group_backend = "fake"  # type: ignore[attr-defined]
    init_fake_process_group(rank, world_size)


def logged_results(trainer: object) -> "Optional[Any]":
    """The running loop's collection of ``self.log`` accumulations (``{key: _ResultMetric}``), or ``None``.

    A padding step's logged values must leave the epoch's accumulations as they were: Lightning has no public hook
    between ``self.log`` and its epoch-end reduction.
    """
    return getattr(trainer, "_results", None)


# A step routed through a module's `__call__` with its `forward` redirected to the step: Lightning's strategies use it
# for their wrappers (DDP, FSDP1), with no public name. The sharded root's `__call__` runs FSDP2's root pre-forward.
from lightning.pytorch.strategies.strategy import _ForwardRedirection as ForwardRedirection  # noqa: E402


def fsdp_flags(module: object) -> tuple[bool, bool, bool]:
    """An FSDP2 module's (reshard after forward, reshard after backward, gradient sync): ``FSDPModule`` has the
    setters (``set_reshard_after_forward``, ``set_reshard_after_backward``, ``set_requires_gradient_sync``) but no
    getters; these are the fields of its parameter groups that the setters write."""
    groups = _fsdp_param_groups(module)
    if not groups:
        return False, False, True
    return (any(g.post_forward_mesh_info is not None for g in groups), all(g.reshard_after_backward for g in groups),
            all(g.reduce_grads for g in groups))


# The common base of BatchNorm1d/2d/3d and SyncBatchNorm (running statistics, momentum, the shared forward): torch
# exports no public one.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: E402

# Lightning's dimension-agnostic BatchNorm, what its own `TorchSyncBatchNorm.revert` gives back: no public name.
from lightning.pytorch.plugins.layer_sync import _BatchNormXd as BatchNormXd  # noqa: E402


def layer_sync(strategy: object) -> "Optional[Any]":
    """The strategy's layer-sync plugin (``Trainer(sync_batchnorm=True)`` or a ``LayerSync`` in ``plugins``), which
    the trainer's connector writes to ``_layer_sync``: strategies have no public accessor."""
    return getattr(strategy, "_layer_sync", None)


def set_layer_sync(strategy: object, plugin: "Optional[Any]") -> None:
    """Replace the plugin that Lightning's ``DDPStrategy.setup`` applies and its ``teardown`` reverts."""
    strategy._layer_sync = plugin  # type: ignore[attr-defined]


def in_backward() -> bool:
    """True while this thread runs an autograd backward: a module's forward called then is activation
    checkpointing's recomputation (``torch.utils.checkpoint``, FSDP's ``checkpoint``), which torch does not flag
    publicly. The engine's current graph task is -1 outside a backward."""
    import torch

    return torch._C._current_graph_task_id() != -1


def undo_split_annotations(module: object, names: "list[str]") -> None:
    """Give the modules named ``names`` back their own ``forward``: ``torch.distributed.pipelining.pipeline``
    wraps it in place for its split points (an instance ``forward`` and ``_orig_forward``) and leaves the wrapper,
    so a second trace of the same module recurses. No public API traces out of place."""
    for name in names:
        target = module.get_submodule(name)  # type: ignore[attr-defined]
        for attribute in ("forward", "_orig_forward"):
            target.__dict__.pop(attribute, None)


# A hook on every tensor operation, to follow the bytes of CPU tensors as they are created (the memory plan's peak
# where no caching allocator keeps one): torch exposes the dispatch mode under a private module only.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def around_stage_work(stage: object, around: "Callable[[Callable[[], Any]], Any]") -> None:
    """Run each micro-batch forward and backward of a ``torch.distributed.pipelining`` stage as ``around(work)``
    (``work()`` does it and returns its result): the stage (``_PipelineStageBase``) has no public hook around its
    ``forward_one_chunk`` / ``backward_one_chunk``, which the schedules call by name."""
    import functools

    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(stage, name, functools.partial(_around_work, around, getattr(stage, name)))


def _around_work(around: "Callable[[Callable[[], Any]], Any]", work: "Callable[..., Any]", *args: Any,
                 **kwargs: Any) -> Any:
    return around(lambda: work(*args, **kwargs))


class _TimedWork:
    """One P2P work of a pipeline schedule, whose ``wait`` runs through the monitor's timer."""

    __slots__ = ("work", "receives", "waiting")

    def __init__(self, work: Any, receives: bool, waiting: "Callable[[bool, Callable[[], Any]], Any]") -> None:
        self.work, self.receives, self.waiting = work, receives, waiting

    def wait(self, *args: Any) -> Any:
        return self.waiting(self.receives, lambda: self.work.wait(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextmanager
def pipeline_transfers(posting: "Callable[[Callable[[], Any]], Any]",
                       waiting: "Callable[[bool, Callable[[], Any]], Any]") -> "Iterator[None]":
    """While open, a ``torch.distributed.pipelining`` schedule posts each batch of its send/recv operations as
    ``posting(post)``, and each wait on one of their works runs as ``waiting(receives, wait)`` (``receives``: the
    work holds a receive). The single-stage schedules post through the module's private ``_batch_p2p`` (looked up
    at each call) and wait on the works it returns, inline or through ``_wait_batch_p2p`` as the release has it: no
    public hook. A release without ``_batch_p2p`` leaves the transfers untimed."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    post = getattr(schedules, "_batch_p2p", None)
    if post is None:
        yield
        return

    def posted(ops: list, *args: Any, **kwargs: Any) -> Any:
        works = posting(lambda: post(ops, *args, **kwargs))
        receives = [op.op in (dist.irecv, dist.recv) for op in ops]
        if works is None or not isinstance(works, list):  # older releases (gloo hung there): one work, or None
            return None if works is None else _TimedWork(works, any(receives), waiting)
        if len(works) != len(ops):  # coalesced into fewer works: each may hold any of the operations
            receives = [any(receives)] * len(works)
        return [_TimedWork(work, r, waiting) for work, r in zip(works, receives)]

    schedules._batch_p2p = posted
    try:
        yield
    finally:
        schedules._batch_p2p = post


class _StagedReceive:
    """One P2P work of a pipeline schedule whose device tensors were received into host copies: ``wait`` copies
    them into the device tensors the schedule reads."""

    __slots__ = ("work", "copies")

    def __init__(self, work: Any, copies: list) -> None:
        self.work, self.copies = work, copies

    def wait(self, *args: Any) -> Any:
        done = self.work.wait(*args)
        for device_tensor, host in self.copies:
            device_tensor.copy_(host)
        self.copies = []
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextmanager
def host_staged_transfers() -> "Iterator[None]":
    """While open, a ``torch.distributed.pipelining`` schedule sends and receives its device tensors through host
    copies. gloo (the backend of ranks that share one GPU) takes CUDA tensors for its collectives but sends and
    receives a tensor's memory as host memory, and the schedules post every transfer through the module's private
    ``_batch_p2p`` (looked up at each call): no public hook. A release without it is left as it is."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    post = getattr(schedules, "_batch_p2p", None)
    if post is None:
        yield
        return

    def staged(ops: list, *args: Any, **kwargs: Any) -> Any:
        host_ops, copies = [], []
        for op in ops:
            if op.tensor.device.type == "cpu":
                host_ops.append(op)
                copies.append([])
                continue
            receives = op.op in (dist.irecv, dist.recv)
            host = (torch.empty(op.tensor.shape, dtype=op.tensor.dtype) if receives
                    else op.tensor.detach().cpu().contiguous())
            host_ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
            copies.append([(op.tensor, host)] if receives else [])
        works = post(host_ops, *args, **kwargs)
        if isinstance(works, list) and len(works) == len(ops):
            return [_StagedReceive(work, pairs) if pairs else work for work, pairs in zip(works, copies)]
        # Coalesced into fewer works: the receives land once every one of them is done.
        for work in works if isinstance(works, list) else [works]:
            work.wait()
        for device_tensor, host in (pair for pairs in copies for pair in pairs):
            device_tensor.copy_(host)
        return works

    schedules._batch_p2p = staged
    try:
        yield
    finally:
        schedules._batch_p2p = post


def cuda_spin(cycles: int) -> None:
    """Queue a kernel that spins ``cycles`` GPU clock cycles on the current stream (the emulator's time dilation):
    torch has no public GPU-side sleep; ``torch.cuda._sleep`` is what its own stream tests use."""
    import torch

    torch.cuda._sleep(int(cycles))


@contextmanager
def optimizers_set_aside(strategy: object) -> "Iterator[None]":
    """Inside, ``strategy`` lists no optimizers, its ``optimizers`` untouched otherwise: Lightning's
    ``Strategy.teardown`` moves every optimizer's state to the CPU and has no switch to leave it (its
    ``FSDPStrategy`` skips that base teardown altogether)."""
    optimizers = strategy._optimizers  # type: ignore[attr-defined]
    strategy._optimizers = []  # type: ignore[attr-defined]
    try:
        yield
    finally:
        strategy._optimizers = optimizers  # type: ignore[attr-defined]
