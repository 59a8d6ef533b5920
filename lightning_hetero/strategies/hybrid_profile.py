"""Measured shares of a hybrid layout: every replica timed as it trains, a pipeline as one replica.

A data-parallel rank times forward + backward of the whole model, as the data-parallel strategy profiles it
(:func:`~lightning_hetero.plan.profiling.time_rank`); the ranks of a pipeline time whole pipelined steps together
(:meth:`~lightning_hetero.strategies.pipelined.PipelinedReplica.step`, the bubble and the activations' send/recv
included), at half and all of its share under the capacities in force (the cards' peak rates before a measurement),
no larger than the data-parallel ranks' sizes: a stage card is one that cannot hold a replica, so the sizes a
data-parallel rank trains at say nothing of what fits it, while the share it is about to train at does
(:func:`pipeline_sizes`). A pipeline's time is its slowest stage rank's (they run in lock-step).
Unless ``micro_batches`` is given, each pipeline first times a step at a few micro-batch counts and keeps the
fastest (:func:`micro_batch_seconds`, :func:`pick_micro_batches`).
Each replica's capacity is its samples/s at the split where every replica's predicted step time is the same
(:func:`~lightning_hetero.plan.profiling.balanced_capacities`), spread over its ranks
(:meth:`~lightning_hetero.plan.layout.HybridLayout.rank_capacities`), so the sampler gives a pipeline the share of
one replica as fast as it measured.

Example::

    result = profile_layout(strategy, train_sampler, train_loader)  # a collective: every rank times its replica
    plan.adopt(result.capacities, "profile")
"""

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_hetero._compat as _compat
from lightning_hetero.plan.layout import HybridLayout, micro_batch_count
from lightning_hetero.plan.profile_run import sample_indices
from lightning_hetero.plan.profiling import (ProfileResult, RankProfile, balanced_capacities, gather_profiles,
                                             profile_sizes, profiled, sample_batches, time_rank, training_loss)
from lightning_hetero.plan.shares import PlannedSampler
from lightning_hetero.strategies.pipelined import PipelinedReplica
from lightning_hetero.view import running_strategy


def time_pipeline(replica: PipelinedReplica, batches: dict[int, Any], steps: int,
                  step_context: Callable[[], AbstractContextManager]) -> RankProfile:
    """Fastest seconds of a pipelined step (forward and backward of every micro-batch, loss weight 0) at each batch
    size; the first step at a size is untimed (it traces the stages for that micro-batch shape). Every rank of the
    pipeline calls it with the same sizes."""
    start = time.perf_counter()
    sizes, seconds = [], []
    for size in sorted(batches):
        times = []
        for _ in range(1 + steps):
            t0 = time.perf_counter()
            with step_context():
                replica.step(batches[size], 0, 0.0)
            if replica.device.type == "cuda":
                torch.cuda.synchronize(replica.device)
            times.append(time.perf_counter() - t0)
        sizes.append(size)
        seconds.append(min(times[1:]))  # noise only adds time to a fixed workload
    return RankProfile(tuple(sizes), tuple(seconds), cost_s=time.perf_counter() - start)


def micro_batch_seconds(replica: PipelinedReplica, batch: Any, size: int, steps: int,
                        step_context: Callable[[], AbstractContextManager]) -> dict[int, float]:
    """Fastest seconds of a pipelined step of ``batch`` (``size`` samples) at each candidate micro-batch count:
    stages, 2 × and 4 × stages, each cut to a divisor of ``size``
    (:func:`~lightning_hetero.plan.layout.micro_batch_count`). More micro-batches shrink the bubble, smaller ones
    run less efficiently: the fastest is measured, not guessed."""
    seconds: dict[int, float] = {}
    for requested in (replica.stages, 2 * replica.stages, 4 * replica.stages):
        count = micro_batch_count(size, replica.stages, requested, replica.least_micro_batch)
        if count not in seconds:
            replica.micro_batches = count
            seconds[count] = time_pipeline(replica, {size: batch}, steps, step_context).seconds[0]
    return seconds


def pick_micro_batches(layout: HybridLayout, timings: Sequence[Optional[dict[int, float]]]) -> list[int]:
    """Per pipeline, the micro-batch count whose slowest stage rank's step is the fastest (every stage rank of a
    pipeline timed the same counts).

    Example::

        >>> layout = HybridLayout.from_pipelines([[1, 2]], world_size=3)
        >>> pick_micro_batches(layout, [None, {2: 0.5, 4: 0.4}, {2: 0.5, 4: 0.6}])
        [2]
    """
    return [min(timings[p[0]], key=lambda c: max(timings[r][c] for r in p))  # type: ignore[index]
            for p in layout.pipelines]


def pipeline_sizes(sizes: Sequence[int], share: int) -> tuple[int, int]:
    """The batch sizes a pipeline is timed at: half and all of its ``share`` (at least 2, so two points fit a line),
    each no larger than the data-parallel ranks' ``sizes``.

    Example::

        >>> pipeline_sizes((5, 10), share=3), pipeline_sizes((32, 64), share=128)
        ((1, 3), (32, 64))
    """
    top = min(sizes[-1], max(2, share))
    return min(sizes[0], max(1, top // 2)), top


def slowest(profiles: Sequence[RankProfile]) -> RankProfile:
    """A pipeline's profile: at each size, its slowest stage rank's seconds (all its ranks timed the same sizes)."""
    seconds = tuple(max(column) for column in zip(*(p.seconds for p in profiles)))
    return RankProfile(profiles[0].sizes, seconds, cost_s=max(p.cost_s for p in profiles))


def replica_capacities(layout: HybridLayout, profiles: Sequence[RankProfile], global_batch_size: int) -> list[float]:
    """Samples/s of each replica (data-parallel ranks in order, then pipelines) at the balanced split."""
    replicas = [profiles[r] for r in layout.data_parallel] + [slowest([profiles[r] for r in p])
                                                              for p in layout.pipelines]
    return balanced_capacities(replicas, global_batch_size)


def profile_layout(strategy: Any, sampler: PlannedSampler, dataloader: Any) -> Optional[ProfileResult]:
    """Time this rank's replica (a collective over all ranks) and plan every rank's capacity from all replicas'
    times; ``None`` when a data-parallel rank's ``training_step`` gave no loss to time."""
    module, layout, replica = strategy.lightning_module, strategy.layout, strategy.replica
    device, steps = strategy.root_device, strategy.core.profiler.steps
    emulator = strategy.core.lab.emulation
    step_context = emulator.work if emulator is not None else nullcontext
    count = len(layout.data_parallel) + len(layout.pipelines)
    global_batch_size = sampler.global_batch_size
    sizes = profile_sizes(global_batch_size, count)
    if replica is not None:
        split = strategy.plan.split  # the same on every rank
        sizes = pipeline_sizes(sizes, sum(split[r] for r in replica.ranks)) if split else sizes
    indices = sample_indices(sampler)
    if replica is not None:
        # The ranks of a pipeline run one step together: the first stage rank's samples, so every stage traces the
        # same shapes (a padding collate's sequence length follows the samples).
        box = [indices]
        dist.broadcast_object_list(box, src=replica.ranks[0], group=replica.group)
        indices = box[0]
    choose = strategy.micro_batches is None  # the user's count is kept
    picks: list[int] = []
    with profiled(module):
        batches = sample_batches(dataloader.dataset, dataloader.collate_fn, indices, sizes,
                                 lambda b: _compat.move_batch_to_device(module, b, device))
        if choose:
            timings: list[Any] = [None] * dist.get_world_size()
            mine = None
            if replica is not None:
                with strategy.precision_plugin.train_step_context():
                    mine = micro_batch_seconds(replica, batches[sizes[-1]], sizes[-1], steps, step_context)
            dist.all_gather_object(timings, mine)
            picks = pick_micro_batches(layout, timings)
            if replica is not None:
                replica.micro_batches = picks[layout.pipelines.index(replica.ranks)]
        if replica is None:
            local = time_rank(module, batches, training_loss(module), device, steps=steps,
                              forward_context=strategy.precision_plugin.forward_context, step_context=step_context)
        else:
            with strategy.precision_plugin.train_step_context():
                local = time_pipeline(replica, batches, steps, step_context)
    if replica is not None:
        replica.forget_schedules()
    profiles = gather_profiles(local)
    if any(p is None for p in profiles):
        return None
    rates = replica_capacities(layout, profiles, global_batch_size)  # type: ignore[arg-type]
    capacities = layout.rank_capacities(rates)
    names = [f"rank {r}" for r in layout.data_parallel] + [f"pipeline {list(p)}" for p in layout.pipelines]
    chosen = f"; micro-batches per pipeline {picks} (the fastest measured)" if picks else ""
    rank_zero_info(f"{running_strategy()} profiled each replica (samples/s at the balanced split): "
                   + ", ".join(f"{n} {rate:.4g}" for n, rate in zip(names, rates)) + chosen)
    return ProfileResult(tuple(profiles), global_batch_size, tuple(capacities), None,  # type: ignore[arg-type]
                         extra={"replicas": names, "replica_rates": rates, "micro_batches": picks})
