"""The rehearsal as a person reads it: the rank table, the prediction, the assumptions and notes, and the PNG."""

from collections.abc import Sequence
from typing import Any, Optional

from lightning_hetero.plan.memory import GIB
from lightning_hetero.rehearse.advice import advice_yaml
from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.predict import LINK_GBYTES, LINK_LATENCY_S


def gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def aligned(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """``rows`` (the first one the header) as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def step_ms(r: RankResult, unit: str = "") -> str:
    """The median step in ms, with half the steps' interquartile spread where there are enough of them."""
    if not r.step_time:
        return "-"
    spread = r.step_spread
    return f"{r.step_time * 1e3:.1f}{unit}" + (f" ±{spread / 2:.0%}" if spread is not None else "")


def bound_label(host_bound: Optional[bool]) -> str:
    return "-" if host_bound is None else "host" if host_bound else "device"


def format_rehearsal(report: dict[str, Any]) -> str:
    hetero = [RankResult(**r) for r in report["hetero"]]
    lines = [f"Rehearsal of {report['config']} on lab {report['lab_text']} ({report['strategy']}), one rank at a time "
             f"on {report['local_device']} with the fake process group; {report['steps']} steps per rank."]
    cuda = report["accelerator"] == "gpu"
    rows = [("rank", "card", "plan", "share", "batch", "peak GiB", "card GiB", "headroom", "step ms", "bound",
             "status")]
    for r in hetero:
        peak = r.peak_allocated_bytes if cuda else None
        headroom = (r.card_memory_bytes - peak) if (peak is not None and r.card_memory_bytes) else None
        rows.append((str(r.rank), r.card, str(r.plan or "-"), f"{r.share:.1%}" if r.share is not None else "-",
                     str(r.batch or "-"), gib(peak), gib(r.card_memory_bytes), gib(headroom), step_ms(r),
                     bound_label(r.host_bound), "ok" if r.ok else ("OOM" if r.oom else f"error: {r.error}")))
    lines += aligned(rows)
    if not cuda:
        lines += host_memory_lines(hetero)
    for name in ("ddp", "fsdp"):
        results = [RankResult(**r) for r in report[name]]
        if not results:
            continue
        parts = []
        for r in results:
            peak = f", peak {gib(r.peak_allocated_bytes)} GiB" if cuda and r.ok else ""
            verdict = "fits" if r.ok else ("OOM" if r.oom else f"error ({r.error})")
            parts.append(f"rank {r.rank} {r.card} batch {r.batch or '-'}: {verdict}{peak}")
        lightning = "DDPStrategy" if name == "ddp" else "FSDPStrategy"
        lines.append(f"Lightning {lightning} (equal batches): " + "; ".join(parts))
    prediction = report["prediction"]
    lines.append("")
    if not prediction.get("strategies"):
        lines.append("Speed: not predicted (a rank of our strategy did not run).")
    else:
        lines.append(f"Predicted step (from the measured step times; link {prediction['link']} at "
                     f"{prediction['link_gbytes_per_s']:g} GB/s):")
        rows = [("strategy", "compute ms (per rank)", "comm ms", "step ms", "no-overlap ms", "samples/s",
                 "vs sum solo")]
        for name, s in prediction["strategies"].items():
            compute = "/".join(f"{c * 1e3:.1f}" + ("*" if i in s["estimated"] else "")
                               for i, c in enumerate(s["compute_seconds"]))
            failed = f"OOM on ranks {s['oom_ranks']}" if s["oom_ranks"] else "failed"
            rows.append((name, compute, f"{s['communication_seconds'] * 1e3:.1f}", f"{s['step_seconds'] * 1e3:.1f}",
                         f"{s['no_overlap_step_seconds'] * 1e3:.1f}",
                         f"{s['samples_per_s']:.1f}" if s["samples_per_s"] else failed,
                         f"{s['ratio_to_sum_solo']:.2f}" if s["ratio_to_sum_solo"] else "-"))
        lines += aligned(rows, indent="  ")
        solo = ", ".join(f"{rate:.1f}" for rate in prediction["solo_samples_per_s"])
        lines.append(f"  sum of the cards' solo rates: {prediction['sum_solo_samples_per_s']:.1f} samples/s ({solo}: "
                     "each card's best measured rate)")
        if any(s["estimated"] for s in prediction["strategies"].values()):
            lines.append("  * not measured at that batch (the rank did not run, or a profiled share differs from the "
                         "rehearsed one): our rank's rate on that card, linear in the batch")
    lines += advice_lines(report.get("advice"))
    lines += [f"assumption: {a}" for a in report["assumptions"]]
    lines += [f"NOTE: {n}" for n in report["notes"]]
    lines += [f"WARNING: {w}" for w in report.get("warnings", ())]
    return "\n".join(lines)


def host_memory_lines(hetero: Sequence[RankResult]) -> list[str]:
    """A CPU rehearsal's memory figures: each rank process's host RSS, and the strategy's estimates where it made
    them."""
    rss = ", ".join(f"rank {r.rank} {gib(r.host_rss_bytes)}" for r in hetero)
    lines = [f"  CPU: no device memory cap or peak (n/a); host-side peak RSS per rank process (GiB): {rss}"]
    if any(r.estimated_bytes for r in hetero):
        estimates = ", ".join(f"rank {r.rank} {gib(r.estimated_bytes)} of {gib(r.card_memory_bytes)}" for r in hetero)
        lines.append(f"  the strategy's estimate of each card's memory under its plan (GiB): {estimates}")
    return lines


def advice_lines(advice: Optional[dict[str, Any]]) -> list[str]:
    """The advice to paste (:mod:`lightning_hetero.rehearse.advice`), and the cards that cannot hold a share."""
    if not advice:
        return []
    lines = []
    text = advice_yaml(advice)
    if text:
        lines += ["", "Advice for the config, from the speeds measured here (ranks in the order of --lab):"]
        lines += ["  " + line for line in text.splitlines()]
    lines += [f"CANNOT: {c}" for c in advice["cannot"]]
    return lines


ASSUMPTIONS = (
    "memory: measured (torch.cuda.max_memory_allocated of the rank's own process under the card's memory cap); "
    "the CUDA context and NCCL buffers (~0.5-1 GiB on a real card) are not included",
    "compute: each rank's step time, in its phases (forward, backward, optimizer step), measured on this device "
    "under the card's SM share (CPU: the emulator's slowdown), with collectives stood in for, for ours and "
    "Lightning's DDP/FSDP alike",
    "link: the slowest link class of the lab; bandwidths (GB/s) " + ", ".join(f"{k} {v:g}" for k, v in
                                                                            LINK_GBYTES.items())
    + " (NCCL between two H200s with the emulator's settings); ring collectives",
    "overlap: FSDP's prefetch (a block's all-gather during the block before; reduce-scatters during the next "
    "backward block) and DDP's bucketed all-reduce during the backward (each bucket once every rank has it, as "
    "measured), on one communication stream, ranks meeting at each collective; the optimizer step after the last "
    "collective, the slowest rank's; per-hop latency "
    + ", ".join(f"{k} {v * 1e6:g} us" for k, v in LINK_LATENCY_S.items())
    + " (assumed); no-overlap ms: the bound where no collective overlaps compute",
    "gradients uncompressed, in the parameters' dtype; FSDP all-gathers in the compute dtype",
)


def draw(report: dict[str, Any], path: str) -> Optional[str]:
    """Memory per card against its capacity, and the predicted throughput of the three strategies (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hetero = [RankResult(**r) for r in report["hetero"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r.rank}: {r.card}" for r in hetero]
    cuda = report["accelerator"] == "gpu"
    peaks = [(r.peak_allocated_bytes if cuda else r.host_rss_bytes) or 0 for r in hetero]
    left.bar(labels, [p / GIB for p in peaks], label="peak measured" if cuda else "host RSS (CPU: no device cap)")
    left.scatter(labels, [(r.card_memory_bytes or 0) / GIB for r in hetero], color="red", marker="_", s=900,
                 label="card memory")
    left.set_ylabel("GiB")
    left.set_title("memory per card")
    left.legend()
    strategies = report["prediction"].get("strategies", {})
    names = list(strategies)
    values = [strategies[n]["samples_per_s"] or 0 for n in names]
    right.bar(names, values, color=["tab:green", "tab:blue", "tab:orange"][: len(names)])
    for i, n in enumerate(names):
        if not strategies[n]["fits"]:
            right.text(i, 0, "OOM", ha="center", va="bottom", color="red")
    right.set_ylabel("predicted samples/s")
    right.set_title("predicted throughput")
    if not names:  # the ranks ran together on one device: no step time to predict from
        right.text(0.5, 0.5, "not predicted", ha="center", va="center", transform=right.transAxes)
        right.set_xticks([])
        right.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
