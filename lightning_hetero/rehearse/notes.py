"""What the user must know about a rehearsal's figures, in words."""

from collections.abc import Sequence
from typing import Any, Optional

from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.predict import PROFILED
from lightning_hetero.rehearse.report import gib, step_ms


def notes(hetero: Sequence[RankResult], accelerator: str, prediction: Optional[dict[str, Any]] = None) -> list[str]:
    """What the user must know about this rehearsal's figures: ranks the local device could not hold, caps it
    could not apply, shares a real run measures (with ``prediction``: the split of the speeds measured here)."""
    out = device_notes(hetero, accelerator)
    measured = {r.capacities_asked for r in hetero if r.capacities_asked in PROFILED}
    profiled = (prediction or {}).get("profiled_split")
    if measured and hetero[0].capacity_source and profiled:
        speeds = ", ".join(f"{rate:.1f}" for rate in prediction["rates"])  # type: ignore[index]
        out.append(f"capacities {sorted(measured)} are measured across the ranks at the start of a real run; each "
                   f"rehearsed rank ran alone on the '{hetero[0].capacity_source}' split "
                   f"{hetero[0].split}, at the speeds (samples/s) {speeds}: a real run would split the batch "
                   f"{profiled} by them, and the prediction uses that split")
    elif measured and hetero[0].capacity_source:
        out.append(f"capacities {sorted(measured)} are measured across the ranks at the start of a real run; the "
                   f"rehearsal cannot (each rank runs alone) and used '{hetero[0].capacity_source}' (the cards' "
                   "published rates, or equal where there are none); the real shares follow the measured speeds")
    for r in hetero:
        if r.host_bound:
            out.append(f"rank {r.rank} ({r.card}): host-bound: the device had finished its work when the host issued "
                       f"the step's last (it waited {r.device_wait * 1e3:.1f}"  # type: ignore[operator]
                       f" ms of {r.step_time * 1e3:.1f} ms), so this step time is this machine's CPU speed, not the "
                       "card's: on the lab the host's CPU and load set it, and the prediction is no better than that")
    if accelerator != "gpu":
        out.append("CPU: speeds are the emulator's CPU slowdowns, not the cards': their ratios are the cards' "
                   "published ones")
    return out


def device_notes(hetero: Sequence[RankResult], accelerator: str) -> list[str]:
    """What the local device could not show of the cards' memory: cards larger than it, a lab none of whose ranks it
    held, and on CPU that no device memory is capped or measured."""
    out = []
    for r in hetero:
        smaller = r.local_memory_bytes is not None and r.card_memory_bytes is not None and \
            r.local_memory_bytes < r.card_memory_bytes
        if smaller:
            out.append(f"rank {r.rank} ({r.card}): this device has {gib(r.local_memory_bytes)} GiB, the card "
                       f"{gib(r.card_memory_bytes)} GiB: rehearsed with less memory than the card has"
                       + (" (its OOM here does not prove an OOM on the card)" if r.oom else ""))
    if hetero and all(r.oom for r in hetero):
        reason = "; ".join(f"rank {r.rank}: {'OOM' if r.oom else r.error}" for r in hetero)
        out.append(f"the local device ({accelerator}) could not hold even one rank of this lab ({reason}): rehearse "
                   "on a device with at least the smallest card's memory, or lower the batch / choose a memory plan.")
    if accelerator != "gpu":
        out.append("CPU rehearsal: no device memory is capped or measured, so the memory columns cannot tell whether "
                   "a card holds its share (peaks n/a). They can tell the plan the strategy chose from each card's "
                   "memory (plan column, with its estimate where the strategy makes one) and the host RSS of each "
                   "rank's process, which holds the model, optimizer state and activations of the share on top of "
                   "Python and its libraries. Rehearse on a GPU for measured peaks")
    return out


# Identical cards with the same batch and plan whose step times differ by more than this factor were not measured
# alike: the host (or the device) was busy with something else while one of them ran.
TWIN_SPREAD = 1.5


def uneven_twins(hetero: Sequence[RankResult]) -> list[str]:
    """Warnings for identical cards (the same card, batch and plan) whose rehearsed step times differ by more than
    :data:`TWIN_SPREAD`: one of them was measured on a loaded machine, and the prediction takes the slowest."""
    groups: dict[tuple[Optional[str], Optional[int], Optional[str]], list[RankResult]] = {}
    for r in hetero:
        if r.ok and r.step_time:
            groups.setdefault((r.card, r.batch, r.plan), []).append(r)
    out = []
    for (card, batch, _), twins in groups.items():
        fast = min(twins, key=lambda r: r.step_time)  # type: ignore[arg-type, return-value]
        slow = max(twins, key=lambda r: r.step_time)  # type: ignore[arg-type, return-value]
        ratio = slow.step_time / fast.step_time  # type: ignore[operator]
        if ratio > TWIN_SPREAD:
            out.append(f"ranks {fast.rank} and {slow.rank} are the same card ({card}, batch {batch}) but stepped in "
                       f"{step_ms(fast, ' ms')} and {step_ms(slow, ' ms')} ({ratio:.1f}x): this machine was likely "
                       "loaded by other work while one of them ran (see `uptime`, `top`); the prediction takes the "
                       "slowest: rehearse again on an idle machine")
    return out
