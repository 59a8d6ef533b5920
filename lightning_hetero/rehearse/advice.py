"""What to paste into the config for the rehearsed lab: capacities from the speeds the rehearsal measured, the
per-rank memory plan the strategy chose, and the cards that cannot hold any useful share.

Example of the YAML it writes (ranks in the order of ``--lab``)::

    trainer:
      strategy:
        init_args:
          capacities: [5.44, 1.0, 1.0]  # measured samples/s: 49.6, 9.1, 9.1
          memory: {"rank:0": keep, "rank:1": checkpoint, "rank:2": checkpoint}
"""

import json
from collections.abc import Sequence
from typing import Any, Optional

from lightning_hetero.plan.split import split_batch
from lightning_hetero.rehearse.job import RankResult


def _step(batches: Sequence[int], rates: Sequence[float]) -> float:
    """The compute time of a synchronous step: its slowest rank's share over its speed."""
    return max(b / rate for b, rate in zip(batches, rates))


def useless_cards(global_batch: int, rates: Sequence[float]) -> list[int]:
    """The ranks so slow that one sample takes them as long as the other ranks' whole step without them: any share
    they hold makes the job slower, or no faster."""
    out = []
    for i in range(len(rates)):
        others = [rate for j, rate in enumerate(rates) if j != i]
        if others and 1 / rates[i] >= _step(split_batch(global_batch, others), others):
            out.append(i)
    return out


def advise(hetero: Sequence[RankResult], sharded: bool) -> dict[str, Any]:
    """The advice for the rehearsed lab (JSON-able): ``capacities`` (the measured speeds relative to the slowest
    card's; identical cards get their fastest measurement), ``rates`` (samples/s), ``split`` (of the global batch by
    them), ``memory`` (rules per rank; sharded strategies only) and ``cannot`` (per card that cannot hold a useful
    share of this job: why, in words)."""
    out: dict[str, Any] = {"capacities": None, "rates": None, "split": None, "memory": None, "cannot": []}
    for r in hetero:
        if r.oom:
            plan = f" under its plan ({r.plan})" if r.plan else ""
            remedy = ("leave it out of the lab, or lower the global batch" if sharded else
                      "rehearse `--strategy hetero_fsdp` (its shards and memory plan), or leave it out of the lab")
            out["cannot"].append(f"rank {r.rank} ({r.card}) ran out of memory with batch {r.batch or '-'}{plan}: it "
                                 f"cannot hold its share of this job: {remedy}")
    ran = [r for r in hetero if r.ok and r.batch and r.step_time]
    if len(ran) != len(hetero) or not ran:
        return out
    measured = [r.batch / r.step_time for r in ran]  # type: ignore[operator]
    # Identical cards (same card, batch and plan) get one speed, their fastest measurement: a loaded host only slows.
    fastest: dict[tuple[str, Any, Any], float] = {}
    for r, rate in zip(ran, measured):
        key = (r.card, r.batch, r.plan)
        fastest[key] = max(rate, fastest.get(key, 0.0))
    rates = [fastest[(r.card, r.batch, r.plan)] for r in ran]
    global_batch = ran[0].global_batch or sum(r.batch for r in ran)  # type: ignore[misc]
    slowest = min(rates)
    out["rates"] = [round(rate, 2) for rate in rates]
    out["capacities"] = [round(rate / slowest, 2) for rate in rates]
    out["split"] = split_batch(global_batch, out["capacities"])
    if sharded and ran[0].memory_modes:
        out["memory"] = {f"rank:{i}": mode for i, mode in enumerate(ran[0].memory_modes)}
    for i in useless_cards(global_batch, rates):
        out["cannot"].append(f"rank {i} ({ran[i].card}) is too slow to hold a useful share: at "
                             f"{rates[i]:.1f} samples/s even one sample of the global batch of {global_batch} takes "
                             "as long as the other cards' whole step, so the job is no faster with it: leave it out of "
                             "the lab (or give it other work)")
    return out


def advice_yaml(advice: dict[str, Any]) -> Optional[str]:
    """The advice as YAML to paste into the config (``None`` without measured speeds)."""
    if advice["capacities"] is None:
        return None
    speeds = ", ".join(f"{rate:g}" for rate in advice["rates"])
    lines = ["trainer:", "  strategy:", "    init_args:",
             f"      capacities: {json.dumps(advice['capacities'])}  # measured samples/s: {speeds}"]
    if advice["memory"]:
        lines.append(f"      memory: {json.dumps(advice['memory'])}")
    return "\n".join(lines)
