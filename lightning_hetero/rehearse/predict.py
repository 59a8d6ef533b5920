"""The job's step time, throughput and ratio to the sum of the cards' solo rates, predicted from the rehearsed ranks."""

from collections.abc import Sequence
from typing import Any, Optional, Union

from lightning_hetero.plan.split import split_batch
from lightning_hetero.plan.step_cost import LINK_GBYTES, LINK_LATENCY_S, buckets_of, ring_seconds
from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.timeline import (
    RankPhases,
    no_overlap,
    replicated_step,
    sharded_step,
    slowest,
)

# The `capacities` a real run measures across its ranks at its start.
PROFILED = ("auto", "profile")


def step_seconds(mode: str, compute: Sequence[Union[RankPhases, float]], blocks: int, param_bytes: int,
                 compute_bytes: int, link: str, measured_link: Optional[tuple[float, float]] = None,
                 bucket_bytes: Optional[Sequence[int]] = None) -> tuple[float, float, float]:
    """The step (overlap modelled, see :mod:`lightning_hetero.rehearse.timeline`), its no-overlap bound, and its
    communication time, from each rank's measured step (the rehearsed step, collectives stood in for): its phases,
    or only its total (then split as :meth:`RankPhases.split` says).

    Replicas (DDP): the gradients all-reduced bucket by bucket (``bucket_bytes`` and each rank's ``ready`` as
    measured, else ``param_bytes`` in equal 25 MiB buckets at equal intervals) through the backward. Sharded (FSDP,
    ours and Lightning's): each of ``blocks`` equal blocks all-gathered (compute dtype) before its forward and its
    backward, its gradients reduce-scattered (the same dtype: both strategies reduce in the compute dtype) after its
    backward; each rank's forward and backward spread evenly over the blocks. Either way the optimizer steps after
    the last collective, the slowest rank's last. ``measured_link``: (GB/s, seconds per hop) measured on the lab's
    link, in place of the link class's figures.
    """
    ranks = [c if isinstance(c, RankPhases) else RankPhases.split(c) for c in compute]
    world = len(ranks)
    gbytes, latency = measured_link or (LINK_GBYTES[link], LINK_LATENCY_S[link])
    optimizer = max(p.optimizer for p in ranks)
    if mode in ("hetero_ddp", "ddp"):
        measured = bucket_bytes and all(len(p.ready) == len(bucket_bytes) for p in ranks)
        if not measured:
            ranks = [RankPhases(p.forward, p.backward, p.optimizer) for p in ranks]
        sizes = list(bucket_bytes) if measured else [param_bytes / buckets_of(param_bytes)] * buckets_of(param_bytes)
        reduces = [ring_seconds("all_reduce", size, world, gbytes, latency) for size in sizes]
        slow = max(p.forward + p.backward for p in ranks)
        return replicated_step(ranks, reduces), slow + sum(reduces) + optimizer, sum(reduces)
    gather = [ring_seconds("all_gather", compute_bytes / blocks, world, gbytes, latency)] * blocks
    scatter = [ring_seconds("reduce_scatter", compute_bytes / blocks, world, gbytes, latency)] * blocks
    fwd = slowest([[p.forward / blocks] * blocks for p in ranks])
    bwd = slowest([[p.backward / blocks] * blocks for p in ranks])
    return (sharded_step(fwd, bwd, gather, scatter, optimizer), no_overlap(fwd, bwd, gather, scatter, optimizer),
            2 * sum(gather) + sum(scatter))


def rank_phases(result: Optional[RankResult], batch: float) -> Optional[RankPhases]:
    """A rank's measured phases at ``batch`` samples: its forward and backward scaled from the batch it ran, its
    optimizer step as it was (the same parameters whatever the batch). ``None``: not run, or no phases measured."""
    measured = result.phases if result is not None and result.ok else None
    if measured is None or not result or not result.batch:
        return None
    scale = batch / result.batch
    return RankPhases(measured.forward * scale, measured.backward * scale, measured.optimizer, measured.ready)


def predict(hetero: Sequence[RankResult], ddp: Sequence[RankResult], fsdp: Sequence[RankResult], strategy: str,
            link: str, measured_link: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """Step time, throughput and ratio to Σ solo of ours vs DDP vs FSDP, from the rehearsed step times.

    Each strategy's compute time on a card is that rank's own measured step time; a rank that did not run (out of
    memory) is extrapolated from our rank's rate on that card, linearly in the batch, and listed in ``estimated``.
    A card's solo rate is its best measured samples/s over the rehearsed runs. Under ``capacities`` "profile" or
    "auto" (measured at the start of a real run, which a rank alone cannot) our batches are the split of the measured
    rates (``profiled_split``), each rank's compute its measured rate at that batch. ``measured_link``: the link's
    (GB/s, seconds per hop) measured, in place of the link class's table.
    """
    rates = [r.batch / r.step_time if r.ok and r.batch and r.step_time else None for r in hetero]
    base = next((r for r in hetero if r.ok), None)
    gbytes = measured_link[0] if measured_link else LINK_GBYTES[link]
    out: dict[str, Any] = {"link": link, "link_gbytes_per_s": gbytes, "link_measured": measured_link is not None,
                           "rates": rates, "strategies": {}}
    if base is None or any(rate is None for rate in rates):
        return out
    world = len(hetero)
    global_batch = base.global_batch or sum(r.batch or 0 for r in hetero)
    solo = [max([rate] + [r.batch / r.step_time for r in (*ddp, *fsdp)  # type: ignore[operator]
                          if r.rank == i and r.ok and r.batch and r.step_time])
            for i, rate in enumerate(rates)]
    out["solo_samples_per_s"] = solo
    out["sum_solo_samples_per_s"] = sum(solo)
    ours = "hetero_fsdp" if base.memory_modes else "hetero_ddp"
    ours_batches: list[Any] = [r.batch for r in hetero]
    if base.capacities_asked in PROFILED:
        # A real run measures the ranks' speeds at its start and splits by them: the rehearsal has measured them too.
        ours_batches = out["profiled_split"] = split_batch(global_batch, rates)  # type: ignore[arg-type]
    runs = {ours: (hetero, ours_batches), "ddp": (ddp, [global_batch / world] * world),
            "fsdp": (fsdp, [global_batch / world] * world)}
    for name, (results, batches) in runs.items():
        if not results:
            continue  # not rehearsed (baselines off, or Lightning's FSDPStrategy on CPU)
        fits = all(r.ok for r in results)
        # Ours is timed where it ran the batch predicted for it; elsewhere (a profiled share) at its measured rate.
        measured = {r.rank: r.step_time for r in results
                    if r.ok and r.step_time and (name != ours or r.batch == batches[r.rank])}
        own = {r.rank: r for r in results}
        # Each rank's phases: this run's own, else our rank's on that card scaled to the batch, else the rate's total.
        phases = [rank_phases(own.get(i) if i in measured else None, b) or rank_phases(hetero[i], b)
                  or RankPhases.split(b / rate) for i, (b, rate) in enumerate(zip(batches, rates))]  # type: ignore
        compute = [measured.get(i) or p.total for i, p in enumerate(phases)]
        if any(r.phases is None for r in results if r.rank in measured):
            # A run timed without its phases (an older record): its totals, as measured.
            phases = [RankPhases.split(c) for c in compute]
        bucket_bytes = next((r.bucket_bytes for r in results if r.ok and r.bucket_bytes), None)
        # Each run's own blocks where it counted them (Lightning's FSDP), else our plan's.
        blocks = next((r.blocks for r in results if r.blocks), None) or base.blocks or 1
        step, bound, comm = step_seconds(name, phases, blocks, base.param_bytes or 0,
                                         base.compute_bytes or 0, link, measured_link, bucket_bytes)
        out["strategies"][name] = {
            "fits": fits, "batches": batches, "compute_seconds": compute, "communication_seconds": comm,
            "phase_seconds": [[p.forward, p.backward, p.optimizer] for p in phases],
            "estimated": [i for i in range(world) if i not in measured],
            "step_seconds": step, "no_overlap_step_seconds": bound,
            "samples_per_s": global_batch / step if fits else None,
            "ratio_to_sum_solo": global_batch / step / sum(solo) if fits else None,
            "oom_ranks": [r.rank for r in results if r.oom],
        }
    return out
