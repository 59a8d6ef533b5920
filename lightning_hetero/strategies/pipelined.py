"""One rank's part of a pipelined replica: its stage of the model, run by ``torch.distributed.pipelining``.

The stages come from torch's tracing frontend, ``pipeline(module, mb_args, split_spec)``: it traces the
LightningModule's own ``forward`` (unmodified) and splits it where the named blocks begin; each stage module holds
the LightningModule's parameter objects under their own names, so the user's optimizer steps them as they are. The
trace specializes shapes, so a stage is traced and built once per micro-batch size (a full batch, a short last one);
the last two built are kept, so the other dimensions of a batch must stay fixed (pad sequences to one length).

The supported shape of a model (anything else fails at the first step with the reason):

- ``training_step`` calls ``self(x, ...)`` once with tensors whose first dimension is the batch (no keyword
  arguments), and computes its loss from what that call returns: ``x, y = batch; loss = f(self(x), y)``;
- the forward is traceable by ``torch.export`` (no data-dependent Python control flow) and returns one tensor;
- no parameter is used by two stages (tied weights across a split).

The stage-0 input is taken from the batch by the user's own ``training_step`` (its call of ``self(...)`` is caught),
and the last stage computes each micro-batch's loss by running the user's ``training_step`` on that micro-batch with
``self(...)`` returning the stage's output, so the loss and every ``self.log`` stay the user's. Its ``self.log``
calls are combined over micro-batches as micro-batching combines them
(:class:`~lightning_hetero.data.microbatch.LogCapture`) and the other stage ranks log the same values with weight 0
(an unsynced value, each rank's own, after the step with the replica's weight: :func:`own_view`).

Each micro-batch's forward, backward and loss run through :meth:`PipelinedReplica.work`: there a CPU rank emulating
a slower card pauses for it (so the neighbour stage waits for it as for a slow card), and the monitor's
:class:`~lightning_hetero.observe.stage_times.StageTimer`, when one is attached, times it and the schedule's waits on
its transfers.
"""

import inspect
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline
from torch.overrides import TorchFunctionMode

import lightning_hetero._compat as _compat
from lightning_hetero.lab.emulator import Emulator
from lightning_hetero.data.microbatch import LogCapture, loss_of, slice_batch
from lightning_hetero.plan.layout import micro_batch_count
from lightning_hetero.strategies.stage_memory import StageHolding
from lightning_hetero.view import running_strategy


class _Called(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("forward called")
        self.args, self.kwargs = args, kwargs


@contextmanager
def _forward_replaced(module: nn.Module, forward: Any) -> Iterator[None]:
    module.forward = forward  # an instance attribute: nn.Module.__call__ (hooks included) calls it
    try:
        yield
    finally:
        del module.forward


def forward_inputs(module: nn.Module, batch: Any, batch_idx: int, step: str = "training_step",
                   step_args: Sequence[Any] = ()) -> tuple[Tensor, ...]:
    """The positional tensors the user's ``step`` (``training_step``, ``validation_step``) hands to ``self(...)`` for
    ``batch`` (the stage-0 input), caught at the call; a ``ValueError`` for a call the pipeline cannot split."""
    def catch(*args: Any, **kwargs: Any) -> None:
        raise _Called(args, kwargs)

    # The step's `self.log` calls before its forward are silenced here: they run again where the pipeline's output
    # is known (the last stage), and would count twice.
    with _forward_replaced(module, catch), LogCapture(module).patched():
        try:
            getattr(module, step)(batch, batch_idx, *step_args)
        except _Called as called:
            args, kwargs = called.args, called.kwargs
        else:
            raise ValueError(f"a pipelined replica needs `{step}` to call `self(...)` (the model's forward).")
    if kwargs or not args or not all(isinstance(a, Tensor) and a.dim() >= 1 for a in args):
        raise ValueError(f"a pipelined replica needs `{step}` to call `self(x, ...)` with batched tensors only "
                         f"(got {len(args)} positional, keyword {sorted(kwargs)}).")
    return args


def check_stage_parameters(module: nn.Module, partition: Sequence[Sequence[str]]) -> None:
    """A ``ValueError`` naming a parameter that two stages use (a weight tied across stages, a module called again
    in a later stage): a stage rank holds its own stage's parameters alone, so no stage could train it."""
    first = {id(p): n for n, p in module.named_parameters()}
    names = {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
    for stage, stage_names in enumerate(partition):
        for name in stage_names:
            if name in names and names[name] == name:
                continue
            if name in names:
                raise ValueError(
                    f"{running_strategy()}: the weight {names[name]!r} (tied as {name!r}) is used by more than one "
                    "stage of the pipeline, but a stage rank holds its own stage's parameters alone: untie them, or "
                    "choose `split_points` that keep both in one stage.")
            called = re.sub(r"@\d+", "", name)  # torch's name for a module's later call in another stage
            raise ValueError(
                f"{running_strategy()}: the parameter {names.get(called, called)!r} is used by more than one stage "
                f"of the pipeline (its module is called again in stage {stage}), but a stage rank holds its own "
                "stage's parameters alone: choose `split_points` that keep its calls in one stage, or give the "
                "later call a module of its own.")


def gather_batch(batch: Any, real: bool, group: dist.ProcessGroup, device: torch.device) -> tuple[Any, bool]:
    """The pipelined replica's batch: its ranks' slices joined in stage order (a padding slice adds nothing);
    ``(own batch, False)`` when every slice is padding."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, move_data_to_device(batch, "cpu") if real else None, group=group)
    present = [p for p in parts if p is not None]
    if not present:
        return batch, False
    return move_data_to_device(_concat(present), device), True


def _concat(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(list(parts)) if first.dim() >= 1 else first
    if isinstance(first, Mapping):
        # A batch's mapping (dict, OrderedDict, a tokenizer's BatchEncoding) is built from a dict.
        build = cast(Callable[[dict[Any, Any]], Any], type(first))
        return build({k: _concat([p[k] for p in parts]) for k in first})
    if isinstance(first, (list, tuple)):
        if first and all(isinstance(v, (str, bytes)) for v in first):
            return type(first)(v for p in parts for v in p)
        items = [_concat([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return first


def share_logs(calls: Sequence[tuple[str, Any, tuple, dict]], src: int, group: dist.ProcessGroup,
               step: str = "training_step", uncounted: Collection[str] = ()
               ) -> tuple[list[tuple[str, float, tuple, dict]], frozenset[str]]:
    """The last stage's combined ``self.log`` calls (``src`` passes them) on every rank of the pipeline, each value a
    float, and the names among them that ``src`` computed from parameters it holds no values of (``uncounted``,
    :class:`ForeignReads`); a value that is no number (a torchmetrics ``Metric``) raises the same error on every
    rank, none waits."""
    box: list[Any] = [None]
    if dist.get_rank() == src:
        bad = [name for name, value, _, _ in calls
               if not (isinstance(value, (int, float)) or isinstance(value, Tensor) and value.numel() == 1)]
        # `log_dict` passes `batch_size=None`: left in, Lightning would weigh the value by this rank's own slice,
        # not the replica's joined batch.
        box = [([(name, float(value), args, {k: v for k, v in kwargs.items() if not (k == "batch_size" and v is None)})
                 for name, value, args, kwargs in calls], frozenset(uncounted))] if not bad else [
            f"`self.log({bad[0]!r}, ...)` in `{step}` on a pipelined replica: log a number or a one-element "
            "tensor (e.g. a metric's `compute()` or its update's value), not a torchmetrics Metric object."]
    dist.broadcast_object_list(box, src=src, group=group)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    return box[0]


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


class ForeignReads(TorchFunctionMode):
    """Marks, while it is on, every tensor computed from ``foreign`` (parameters this rank holds no values of: other
    stages'), so that a value the user logs from them (a weight norm) is known not to be this rank's to count.

    Example::

        with ForeignReads(other_stages) as reads:
            norm = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).norm()
        reads.read(norm)  # True
    """

    def __init__(self, foreign: Iterable[Tensor]) -> None:
        super().__init__()
        # Held while on: an id marked here belongs to no other tensor.
        self.marked: dict[int, Tensor] = {id(t): t for t in foreign}

    def read(self, value: Any) -> bool:
        return isinstance(value, Tensor) and id(value) in self.marked

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(self.read(t) for t in _tensors((args, kwargs))):
            self.marked.update((id(t), t) for t in _tensors(out))
        return out


_LOG_SIGNATURE = inspect.signature(LightningModule.log)


def synced(call: tuple[str, float, tuple, dict]) -> bool:
    """Whether a shared ``self.log`` call reduces over ranks (``sync_dist=True``)."""
    name, value, args, kwargs = call
    return bool(_LOG_SIGNATURE.bind(None, name, value, *args, **kwargs).arguments.get("sync_dist", False))


def own_view(calls: Sequence[tuple[str, float, tuple, dict]], mirrors: bool) -> list[tuple[str, float, tuple, dict]]:
    """The shared calls a stage rank logs after its step, not in it: where its step ``mirrors`` the replica's (a stage
    before the last, on a real batch: a padding step, counting nowhere), its unsynced values, its own view of the
    replica's step (discarded with the padding step, their epoch mean is 0 / 0, NaN, and ``EarlyStopping`` stops
    the fit)."""
    return [call for call in calls if not synced(call)] if mirrors else []


def log_shared(module: nn.Module, calls: Sequence[tuple[str, float, tuple, dict]], size: int,
               device: torch.device) -> None:
    """``module.log`` of each shared call, weighted by the replica's joined batch (``size``) unless it names one."""
    for name, value, args, kwargs in calls:
        module.log(name, torch.tensor(value, device=device), *args, **{"batch_size": size, **kwargs})


KEPT_SCHEDULES = 2  # a full batch's micro-batch shape and an epoch's short last one


class PipelinedReplica:
    """This rank's stage of a pipeline (``ranks``: the pipeline's global ranks in stage order) and its steps.

    Args:
        module: the LightningModule; this rank's device holds its stage's parameters alone (``holding``,
            :class:`~lightning_hetero.strategies.stage_memory.StageHolding`).
        ranks: the pipeline's global ranks, stage order.
        group: the process group of those ranks.
        device: this rank's device.
        split_points: module names where a stage after the first begins.
        schedule: ``"gpipe"`` or ``"1f1b"`` (GPipe where a step has fewer micro-batches than stages).
        micro_batches: the most micro-batches a step runs (``None``: 2 × stages), see
            :func:`~lightning_hetero.plan.layout.micro_batch_count`.
        emulator: this rank's emulator (:class:`~lightning_hetero.lab.emulator.Emulator`): on CPU, emulating a
            slower card, it pauses after each micro-batch's work, where the neighbour stage waits for it as for a
            slow card.
    """

    def __init__(self, module: nn.Module, ranks: Sequence[int], group: dist.ProcessGroup, device: torch.device,
                 split_points: Sequence[str], schedule: str, micro_batches: Optional[int],
                 emulator: Optional[Emulator] = None) -> None:
        self.module = module
        self.ranks = tuple(ranks)
        self.stage = self.ranks.index(dist.get_rank())
        self.group = group
        self.device = device
        self.split_points = list(split_points)
        self.schedule_name = schedule
        self.micro_batches = micro_batches
        # The fewest samples a micro-batch may hold (2 while BatchNorm trains on per-micro-batch statistics).
        self.least_micro_batch = 1
        self.last_micro_batch = 0  # the size of the last training step's micro-batches
        self.partition: Optional[list[list[str]]] = None  # every stage's parameter names
        self._foreign_params: Optional[list[Tensor]] = None  # the other stages' parameters (see `_foreign`)
        self._built: dict[tuple, Any] = {}
        self._built_forward: dict[tuple, Any] = {}  # evaluation's forward-only schedules, kept apart from training's
        self.holding = StageHolding(module, device)
        self.optimizers: Sequence[torch.optim.Optimizer] = ()  # whose state follows the stage's parameters
        self.timer: Optional[Any] = None  # the monitor's StageTimer (observe/stage_times.py)
        self.slowed: Optional[Callable[[], AbstractContextManager[None]]] = (
            emulator.slowed_in_place if emulator is not None else None)
        # Ranks sharing one GPU (lightning_hetero.lab.shared_gpu) talk over gloo, which sends host memory only.
        self.host_staged = device.type != "cpu" and dist.get_backend(group) == "gloo"

    @property
    def stages(self) -> int:
        return len(self.ranks)

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def stage_parameters(self) -> list[nn.Parameter]:
        assert self.partition is not None
        params = dict(self.module.named_parameters())
        return [params[n] for n in self.partition[self.stage]]

    def _schedule(self, inputs: tuple[Tensor, ...], count: int, forward_only: bool = False) -> Any:
        """The schedule for ``count`` micro-batches of ``inputs``' micro-batch shape (traced on first use);
        ``forward_only``: evaluation's, with no loss and no backward, traced in the module's current mode."""
        size = inputs[0].shape[0] // count
        key = (count, tuple((tuple(a.shape[1:]), a.dtype) for a in inputs), size, self.module.training)
        built = self._built_forward if forward_only else self._built
        if key in built:
            built[key] = built.pop(key)  # the most recently used, last
        else:
            example = tuple(a[:size] for a in inputs)
            try:
                pipe = pipeline(self.module, mb_args=example,
                                split_spec={name: SplitPoint.BEGINNING for name in self.split_points})
            finally:
                _compat.undo_split_annotations(self.module, self.split_points)
            if pipe.num_stages != self.stages:
                raise ValueError(f"`split_points` {self.split_points} cut the model into {pipe.num_stages} stages "
                                 f"for a pipeline of {self.stages} ranks.")
            if self.partition is None:
                partition = [[n for n, _ in pipe.get_stage_module(s).named_parameters()] for s in range(self.stages)]
                check_stage_parameters(self.module, partition)
                self.partition = partition
            # The split is known: this stage's parameters on the device, the others' nowhere on this rank.
            self.holding.keep_only(self.partition[self.stage], self.optimizers)
            stage = pipe.build_stage(self.stage, self.device, group=self.group)
            if forward_only:
                # Without a loss function a schedule runs no backward; evaluation is not the monitor's to time.
                _compat.around_stage_work(stage, self._slowed_work)
                built[key] = ScheduleGPipe(stage, n_microbatches=count)
            else:
                _compat.around_stage_work(stage, self.work)
                kind = Schedule1F1B if self.schedule_name == "1f1b" and count >= self.stages else ScheduleGPipe
                built[key] = kind(stage, n_microbatches=count, loss_fn=self._loss, scale_grads=False)
            while len(built) > KEPT_SCHEDULES:  # a traced stage per shape: the oldest goes
                built.pop(next(iter(built)))
        return built[key]

    def forget_schedules(self) -> None:
        """Drop every traced stage (profiling's micro-batch shapes are not training's)."""
        self._built.clear()
        self._built_forward.clear()

    def step(self, batch: Any, batch_idx: int, weight: float) -> tuple[Optional[Tensor], list]:
        """Forward and backward of the replica's ``batch`` through the pipeline; each micro-batch's loss scaled by
        ``weight`` × its samples (b/G spread over the micro-batches). Returns the replica's mean loss and the
        combined log calls (last stage; ``(None, [])`` elsewhere)."""
        # Contiguous: the traced stage checks its input's strides, and a slice (GPT's ``tokens[:, :-1]``) keeps its
        # parent's (profiling a 1.63B GPT's pipeline on H100 stopped: PipeliningShapeError, expected (512, 1), got
        # (513, 1)). A copy of the input tokens; every micro-batch of a contiguous batch is contiguous.
        inputs = tuple(a.contiguous() for a in forward_inputs(self.module, batch, batch_idx))
        size = inputs[0].shape[0]
        count = micro_batch_count(size, self.stages, self.micro_batches, self.least_micro_batch)
        self.last_micro_batch = size // count
        schedule = self._schedule(inputs, count)
        self._batch, self._batch_idx, self._size, self._weight = batch, batch_idx, size, weight
        self._losses: list[Tensor] = []
        self._capture = LogCapture(self.module)
        self.uncounted: set[str] = set()  # logged from other stages' parameters (`ForeignReads`)
        timer = self.timer
        with self._capture.patched(), _compat.host_staged_transfers() if self.host_staged else nullcontext():
            if timer is not None:
                timer.begin()
            with _compat.pipeline_transfers(timer.posted, timer.waited) if timer is not None else nullcontext():
                if self.stage == 0:
                    schedule.step(*inputs)
                elif self.is_last:
                    schedule.step(target=torch.arange(size, device=self.device))
                else:
                    schedule.step()
            if timer is not None:
                timer.end()
        if not self.is_last:
            return None, []
        return torch.stack(self._losses).sum(), self._capture.combined()

    def evaluate(self, batch: Any, batch_idx: int, step_args: Sequence[Any] = ()) -> tuple[Any, list]:
        """The replica's evaluation ``batch`` forward through the pipeline (no backward, in the module's mode), then,
        on the last stage, the user's ``validation_step`` on the whole batch with ``self(...)`` returning the
        pipeline's output (the micro-batches' outputs joined): what one device computes on it. Returns that step's
        output and its ``self.log`` calls (last stage; ``(None, [])`` elsewhere)."""
        step = "validation_step"
        inputs = tuple(a.contiguous() for a in forward_inputs(self.module, batch, batch_idx, step, step_args))
        count = micro_batch_count(inputs[0].shape[0], self.stages, self.micro_batches)
        schedule = self._schedule(inputs, count, forward_only=True)
        with torch.no_grad(), _compat.host_staged_transfers() if self.host_staged else nullcontext():
            output = schedule.step(*inputs) if self.stage == 0 else schedule.step()
        if not self.is_last:
            return None, []
        result = output[0] if isinstance(output, (tuple, list)) and len(output) == 1 else output
        capture = LogCapture(self.module)
        with capture.patched(), _forward_replaced(self.module, lambda *args, **kwargs: result):
            out = getattr(self.module, step)(batch, batch_idx, *step_args)
        return out, capture.combined()

    def _slowed_work(self, run: Callable[[], Any]) -> Any:
        """``run()``, slowed in place by a CPU emulator (as a slower card would take it)."""
        if self.slowed is None:
            return run()
        with self.slowed():
            return run()

    def work(self, run: Callable[[], Any]) -> Any:
        """``run()``, one micro-batch's forward, backward or loss: slowed in place by a CPU emulator, timed by the
        monitor."""
        return self._slowed_work(run) if self.timer is None else self.timer.compute(lambda: self._slowed_work(run))

    def _loss(self, output: Any, index: Tensor) -> Tensor:
        return self.work(lambda: self._micro_batch_loss(output, index))

    def _foreign(self) -> list[Tensor]:
        """The parameters of the other stages (placeholders here), found once: the partition is fixed for the fit
        and holding a stage swaps the parameters' data, not the parameters."""
        assert self.partition is not None
        if self._foreign_params is None:
            own = set(self.partition[self.stage])
            self._foreign_params = [p for n, p in self.module.named_parameters() if n not in own]
        return self._foreign_params

    def _micro_batch_loss(self, output: Any, index: Tensor) -> Tensor:
        """The user's ``training_step`` on one micro-batch, its ``self(...)`` returning the last stage's output."""
        start, end = int(index[0]), int(index[-1]) + 1
        share = (end - start) / self._size
        self._capture.weight = share
        result = output[0] if isinstance(output, (tuple, list)) and len(output) == 1 else output
        with _forward_replaced(self.module, lambda *args, **kwargs: result), ForeignReads(self._foreign()) as reads:
            loss = loss_of(self.module.training_step(slice_batch(self._batch, start, end, self._size),
                                                     self._batch_idx))
        self.uncounted.update(name for name, calls in self._capture.calls.items() if reads.read(calls[-1][0]))
        self._losses.append(loss.detach().float() * share)
        return loss * (self._weight * (end - start))
