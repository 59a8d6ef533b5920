"""Offline analysis of :class:`~lightning_hetero.observe.monitor.HeteroMonitor`'s per-step records: per-rank time
split, exposed communication vs waiting, advice when a threshold is crossed, and the end-of-fit summary table.

Plain functions of plain numbers (no process group, no Trainer), so ``python -m lightning_hetero report`` and tests
can call them on saved windows.

Example::
    >>> window = analyse([[[0.10, 0.01, 0.02, 32, 0]], [[0.10, 0.01, 0.05, 16, 0]]])
    >>> advice(window)
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from lightning_hetero.observe.stage_times import NO_STAGE, STAGE_FIELDS, split_transfers, stage_names

# Per-step record columns (seconds, counts), exchanged on logging steps; a data-parallel rank's stage fields are 0.
# Then the strategy's gradient exchange: the rank's time blocked in it where the strategy times it (the hybrid
# layout's stage exchange; part of sync) and the bytes the rank handed to the step's gradient collectives where the
# strategy counts them (NaN otherwise).
EXCHANGE_FIELDS = ("exchange", "comm_bytes")
NO_EXCHANGE = (0.0, math.nan)
STEP_FIELDS = ("cycle", "data", "sync", "samples", "tokens") + STAGE_FIELDS + EXCHANGE_FIELDS
BUSY_THRESHOLD = 0.85
COMM_RATIO_THRESHOLD = 0.3


def analyse(steps: Union[torch.Tensor, Sequence[Sequence[Sequence[float]]]], first_step: int = 0,
            pipelines: Optional[Sequence[Sequence[int]]] = None) -> dict[str, Any]:
    """Per-rank means per step of a window of records (rank, step, field: ``STEP_FIELDS``; rows of the first five
    fields alone are a job without pipelines, without the last two one without a timed or counted exchange) and the
    job-level figures.

    The rank with the least sync time in a step arrived last at its collectives: that sync is the step's exposed
    communication; everything any rank spent in sync beyond it is waiting for slower ranks. A stage rank of one of
    ``pipelines`` (global ranks, stage order) also spends its step's pipeline waits in send/recv and bubble
    (:func:`~lightning_hetero.observe.stage_times.split_transfers`); its compute is what remains. ``exchange`` (where
    the strategy timed its exchange) is the part of each rank's sync blocked in it, ``comm_bytes`` (where the strategy
    counted them) its bytes per step. (Plain Python over
    the table's few hundred numbers: a chain of small tensor operations cost ten times as much on rank 0's step.)
    """
    # [rank][step][field]
    table = steps.tolist() if isinstance(steps, torch.Tensor) else steps
    table = [[_padded(row) for row in rows] for rows in table]
    world, n = len(table), (len(table[0]) if table else 0)
    comm_steps = [min(table[r][i][2] for r in range(world)) for i in range(n)]
    comm_total = sum(comm_steps)
    cycle, data, wait, compute, samples, tokens = ([0.0] * world for _ in range(6))
    sendrecv, bubble, stage_span, stage_compute, exchange, nbytes = ([0.0] * world for _ in range(6))
    # [rank][step]: (send/recv, bubble) of a stage rank's pipeline waits
    waits = [[(0.0, 0.0)] * n for _ in range(world)]
    for ranks in pipelines or ():
        for i in range(n):
            for r, split in zip(ranks, split_transfers([table[r][i][5:5 + len(STAGE_FIELDS)] for r in ranks])):
                waits[r][i] = split
    for r, rows in enumerate(table):
        for (c, d, sync, b, t, span, work, *_, blocked, sent), comm, (transfer, idle) in zip(rows, comm_steps,
                                                                                          waits[r]):
            cycle[r] += c
            data[r] += d
            wait[r] += sync - comm
            compute[r] += max(c - d - sync - transfer - idle, 0.0)
            samples[r] += b
            tokens[r] += t
            sendrecv[r] += transfer
            bubble[r] += idle
            stage_span[r] += span
            stage_compute[r] += work
            exchange[r] += blocked
            nbytes[r] += sent
    # The cycles agree across ranks up to clock skew: their mean
    wall = sum(cycle) / world if world else 0.0
    per_step = 1.0 / n if n else 0.0
    solo = [s / c if c > 0 else 0.0 for s, c in zip(samples, compute)]
    total_samples, total_tokens = sum(samples), sum(tokens)
    rate = total_samples / wall if wall > 0 else 0.0
    ideal = sum(solo)
    slowest = max(compute, default=0.0)
    staged = {
        "pipelines": [list(p) for p in pipelines],
        "sendrecv": [v * per_step for v in sendrecv],
        "bubble": [v * per_step for v in bubble],
        "stage_span": [v * per_step for v in stage_span],
        "stage_compute": [v * per_step for v in stage_compute],
    } if pipelines else {}
    exchanged = {"exchange": [v * per_step for v in exchange]} if any(v > 0 for v in exchange) else {}
    if not all(math.isnan(v) for v in nbytes):
        exchanged["comm_bytes"] = [v * per_step for v in nbytes]
    return {
        "first_step": int(first_step),
        "steps": int(n),
        "compute": [v * per_step for v in compute],
        "wait": [v * per_step for v in wait],
        "data": [v * per_step for v in data],
        "comm": [comm_total * per_step] * world,
        "cycle": [v * per_step for v in cycle],
        **staged,
        **exchanged,
        "samples": samples,
        "tokens": tokens,
        # As trained
        "shares": [s / total_samples for s in samples] if total_samples > 0 else None,
        "busy": [c / t if t > 0 else 0.0 for c, t in zip(compute, cycle)],
        "solo": solo,
        "step_s": wall * per_step,
        "samples_per_s": rate,
        "tokens_per_s": total_tokens / wall if wall > 0 and total_tokens > 0 else None,
        "ideal_fraction": rate / ideal if ideal > 0 else None,
        "comm_compute_ratio": comm_total / slowest if slowest > 0 else None,
    }


def _padded(row: Sequence[float]) -> list[float]:
    """A record with every ``STEP_FIELDS`` column: a shorter one's stage and exchange fields as none ran."""
    stage_end = 5 + len(STAGE_FIELDS)
    return list(row[:5]) + (list(row[5:stage_end]) or list(NO_STAGE)) + (list(row[stage_end:]) or list(NO_EXCHANGE))


# Per-rank seconds per step of every window, those of pipelined jobs' windows, and the gradient exchange's time and
# bytes where the strategy timed or counted them.
_PARTS = ("compute", "wait", "data", "comm", "cycle")
_OPTIONAL_PARTS = ("sendrecv", "bubble", "stage_span", "stage_compute") + EXCHANGE_FIELDS


def accumulate(totals: Optional[dict[str, list[float]]], window: Mapping[str, Any]) -> dict[str, list[float]]:
    """Running sums (seconds and samples per rank, steps) of the windows after warm-up."""
    n = window["steps"]
    add = {k: [v * n for v in window[k]] for k in _PARTS + _OPTIONAL_PARTS if k in window}
    add["samples"] = list(window["samples"])
    add["tokens"] = list(window["tokens"])
    add["steps"] = [float(n)]
    if totals is None:
        return add
    return {k: [a + b for a, b in zip(totals.get(k, [0.0] * len(v)), v)] for k, v in add.items()}


# Capacity sources that already come from measuring the model (see SharePlan.source).
_MEASURED_SOURCES = ("profile", "rebalanced", "restored")
# Advice is given only where it would make steps at least this much shorter...
MIN_GAIN = 0.10
# ... and hide at least this much loading per step: a loader worker hands each batch over through a queue (about a
# millisecond), so less than this is not won back by more workers.
MIN_DATA_S = 0.005


def totals_window(totals: Mapping[str, Sequence[float]], steps: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The per-step means of the summary's totals, in the layout of :func:`analyse`'s windows (for :func:`advice`)."""
    n = max(totals["steps"][0], 1.0)
    per_step = {k: [v / n for v in totals[k]] for k in _PARTS + _OPTIONAL_PARTS if k in totals}
    total = sum(totals["samples"])
    slowest = max(per_step["compute"])
    return {
        **per_step,
        "first_step": (steps[0] - 1) if steps else 0,
        "steps": int(n),
        "samples": list(totals["samples"]),
        "shares": [s / total for s in totals["samples"]] if total > 0 else None,
        "busy": [c / t if t > 0 else 0.0 for c, t in zip(per_step["compute"], per_step["cycle"])],
        "solo": [s / c if c > 0 else 0.0 for s, c in zip(totals["samples"], totals["compute"])],
        "comm_compute_ratio": per_step["comm"][0] / slowest if slowest > 0 else None,
    }


def _gain(saved_s: float, step_s: float) -> str:
    return f"up to {saved_s / step_s:.0%} shorter steps ({1000 * saved_s:.3g} of {1000 * step_s:.3g} ms)"




def advice(window: Mapping[str, Any], nvml_util: Sequence[float] = (), capacity_source: Optional[str] = None,
           rebalance: Optional[bool] = None, sharded: bool = False) -> list[tuple[str, str]]:
    """(kind, message) for each change that would make the window's steps at least ``MIN_GAIN`` shorter: each
    message names the window's steps (its numbers are those steps' means), says what to change and how much it would
    gain, leaving out what the run already does (``capacity_source``: the lab's, ``rebalance``: whether shares follow
    drifting speeds; ``None``: unknown) and what the strategy refuses (``sharded``: no profiled capacities, no
    rebalancing)."""
    out = []
    world = len(window["busy"])
    first = int(window.get("first_step", 0))
    span = f"HeteroMonitor, steps {first + 1}-{first + int(window.get('steps', 0))}:"
    step_s = max(window["cycle"]) or 1e-12
    solo = window["solo"]
    # All ranks' compute ending together at the measured rates (fixed per-step costs counted as per-sample: "up to").
    balanced_s = sum(window["samples"]) / sum(solo) if sum(solo) > 0 and "samples" in window else None
    for r in range(world):
        cycle = window["cycle"][r] or 1e-12
        wait, data = window["wait"][r] / cycle, window["data"][r] / cycle
        util = nvml_util[r] if r < len(nvml_util) and not math.isnan(nvml_util[r]) else None
        busy = window["busy"][r]
        if busy >= BUSY_THRESHOLD and (util is None or util >= 100 * BUSY_THRESHOLD):
            continue
        saved = max(window["compute"]) - balanced_s if balanced_s is not None else window["wait"][r]
        if wait >= 0.1 and world > 1 and saved >= MIN_GAIN * step_s:
            by_speed = ", ".join(f"{v / sum(solo):.0%}" for v in solo) if sum(solo) > 0 else "?"
            now = ", ".join(f"{v:.0%}" for v in window["shares"] or [])
            if sharded:  # a sharded step is timed in lockstep: the capacities must come from elsewhere
                todo = ["capacities in proportion to those speeds (a mapping or weights)"]
            else:
                todo = [] if capacity_source in _MEASURED_SOURCES else ["capacities='profile' (or 'auto')"]
                todo += [] if rebalance else ["rebalance=True (speeds drift: throttling, co-tenants)"]
            use = f"use {' and '.join(todo)}. " if todo else "capacities are measured and rebalanced already. "
            out.append(("wait", (
                f"{span} rank {r} computes only {busy:.0%} of each step and waits {wait:.0%} for slower ranks "
                f"(goal: busy >= 85%). Shares by measured speed would be [{by_speed}] (now [{now}]), "
                f"{_gain(saved, step_s)}: {use}If the wait stays, the slower ranks' steps are dominated by fixed "
                "per-step costs that no split moves: raise the batch size.")))
        elif data >= 0.1 and window["data"][r] >= max(MIN_DATA_S, MIN_GAIN * step_s):
            out.append(("data", (
                f"{span} rank {r} spends {data:.0%} of each step loading data (busy {busy:.0%}, goal >= 85%): "
                f"raise the DataLoader's num_workers (and pin_memory=True on GPUs), "
                f"{_gain(window['data'][r], step_s)}.")))
        elif util is not None and util < 100 * BUSY_THRESHOLD:
            out.append(("util", (
                f"{span} GPU of rank {r} is {util:.0f}% utilised (NVML, goal >= 85%): the batch may be too "
                "small for the card (raise the global batch) or the host too slow to feed it.")))
    ratio = window.get("comm_compute_ratio")
    # fp16 / bf16 on the wire halves the bytes: at best half the exposed communication is saved; under the hybrid
    # layout, half its stage exchange's (the least time a rank was blocked in it: the others waited there too).
    exchange = window.get("exchange")
    saved = (min(exchange) if exchange else window["comm"][0]) / 2
    if ratio is not None and ratio > COMM_RATIO_THRESHOLD and saved >= MIN_GAIN * step_s:
        if exchange:  # the hybrid layout's stage exchange: its own levers
            how = (f"overlap_stage_exchange=True begins each stage's exchange during the backward (where it is off), "
                   f"stage_compression='bf16' halves the bytes between hosts, {_gain(saved, step_s)} where the "
                   "link's bandwidth (not its latency) is the limit ('powersgd' or 'topk' send far less, lossy); or "
                   "a larger global batch.")
        else:
            how = (f"compression='fp16'/'bf16' halves the bytes, {_gain(saved, step_s)} where the link's bandwidth "
                   "(not its latency) is the limit ('powersgd' sends far less on slow links); a larger "
                   "ddp_kwargs={'bucket_cap_mb': ...} when many small buckets are sent (smaller buckets overlap more "
                   "with the backward), or a larger global batch.")
        out.append(("comm", f"{span} exposed gradient communication is {ratio:.2f}x the compute time (goal <= "
                            f"{COMM_RATIO_THRESHOLD}): {how}"))
    return out


def summary_rows(totals: Mapping[str, Sequence[float]], shares: Optional[Sequence[float]] = None,
                 pipelines: Optional[Sequence[Sequence[int]]] = None) -> list[list[str]]:
    """Rows of the end-of-fit table: per rank time split (ms per step and % of the step) and rates; with
    ``pipelines``, each stage rank named by its pipeline and stage, and its send/recv and bubble; the gradient
    exchange's time and bytes (MB per step) where the totals hold them."""
    steps = max(totals["steps"][0], 1.0)
    names = stage_names(pipelines)
    rows = []
    for r in range(len(totals["compute"])):
        cycle = totals["cycle"][r] or 1e-12

        def cell(key: str) -> str:
            return f"{1000 * totals[key][r] / steps:.2f} ({totals[key][r] / cycle:.0%})"

        solo = totals["samples"][r] / totals["compute"][r] if totals["compute"][r] > 0 else 0.0
        share = f"{shares[r]:.1%}" if shares else "-"
        row = [str(r) + (f" ({names[r]})" if r in names else ""), share, cell("compute"), cell("wait"),
               cell("data"), cell("comm")]
        if "exchange" in totals:
            row.append(cell("exchange"))
        if "comm_bytes" in totals:
            sent = totals["comm_bytes"][r]
            row.append("-" if math.isnan(sent) else f"{sent / steps / 1e6:.4g}")
        if pipelines:
            row += [cell("sendrecv"), cell("bubble")] if r in names else ["-", "-"]
        rows.append(row + [f"{1000 * cycle / steps:.2f}", f"{solo:.4g}"])
    return rows


SUMMARY_HEADERS = ["rank", "share", "compute ms", "wait ms", "data ms", "comm ms", "step ms", "solo/s"]
# With pipelines, before the step: a stage rank's time in its pipeline's transfers, and idle waiting for neighbours.
STAGE_HEADERS = ["send/recv ms", "bubble ms"]
# After comm, where the totals hold them: the rank's time blocked in the strategy's gradient exchange, and its bytes.
EXCHANGE_HEADERS = {"exchange": "exchange ms", "comm_bytes": "comm MB"}


def summary_headers(pipelines: Optional[Sequence[Sequence[int]]] = None,
                    totals: Optional[Mapping[str, Sequence[float]]] = None) -> list[str]:
    extra = [header for key, header in EXCHANGE_HEADERS.items() if key in (totals or {})]
    return SUMMARY_HEADERS[:6] + extra + (STAGE_HEADERS if pipelines else []) + SUMMARY_HEADERS[6:]


def summary_text(totals: Mapping[str, Sequence[float]], pipelines: Optional[Sequence[Sequence[int]]] = None
                 ) -> tuple[list[list[str]], str]:
    steps = max(totals["steps"][0], 1.0)
    wall = sum(totals["cycle"]) / len(totals["cycle"])
    rate = sum(totals["samples"]) / wall if wall > 0 else 0.0
    ideal = sum(s / c for s, c in zip(totals["samples"], totals["compute"]) if c > 0)
    slowest = max(totals["compute"])
    comm = totals["comm"][0]
    foot = (f"{int(steps)} steps; {rate:.4g} samples/s = {rate / ideal:.0%} of ideal {ideal:.4g}; "
            f"exposed comm / compute {comm / slowest if slowest else 0:.2f}") if ideal > 0 else f"{int(steps)} steps"
    if sum(totals["tokens"]) > 0 and wall > 0:
        foot += f"; {sum(totals['tokens']) / wall:.4g} tokens/s"
    notes = [foot]
    if ideal > 0:
        notes.append("ideal: the sum of solo/s, samples per second of each rank's whole compute in these steps, "
                     "optimizer and per-step overhead included, unlike the profile's forward + backward rates")
    if len(totals["cycle"]) > 1:
        # Equal columns would read as one rank's figures copied to the others: say which are the job's, and why.
        notes.append("comm: the job's exposed communication (the time in collectives of the rank that arrived last), "
                     "the same on every rank")
        notes.append("data: each rank's own time between batches, Lightning's per-batch broadcast included: about "
                     "the same on ranks that end their steps together")
    if pipelines:
        notes.append("send/recv: a stage rank's time in its pipeline's transfers; bubble: its time idle in them, "
                     "waiting for a neighbour stage; its compute is what remains (micro-batches, optimizer)")
    if "exchange" in totals:
        notes.append("exchange: the rank's time blocked in the stage gradient exchange after its backward (what the "
                     "backward did not hide), part of its comm + wait: a rank its stage groups waited for shows the "
                     "exchange's own cost, the others the wait for that rank too")
    if "comm_bytes" in totals:
        notes.append("comm MB: what the rank handed to the step's gradient collectives, 10^6 bytes per step")
    total = sum(totals["samples"])
    shares = [s / total for s in totals["samples"]] if total > 0 else None
    return summary_rows(totals, shares, pipelines), "\n".join(notes)


def print_summary(totals: Mapping[str, Sequence[float]], steps: Optional[Sequence[int]] = None,
                  pipelines: Optional[Sequence[Sequence[int]]] = None) -> None:
    """The end-of-fit table on stdout (``rich`` when installed). ``steps``: the first and last optimizer step the
    totals cover, for the title (the warnings during the run give single windows' means, these are all steps');
    ``pipelines``: the job's pipelined replicas (their stage ranks get send/recv and bubble columns)."""
    rows, foot = summary_text(totals, pipelines)
    headers = summary_headers(pipelines, totals)
    title = "HeteroMonitor: where each rank's step time went (after warm-up)"
    if steps:
        title = (f"HeteroMonitor: where each rank's step time went, steps {steps[0]}-{steps[-1]} (after warm-up; "
                 "the means of all these steps)")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [title, fmt.format(*headers)]
        lines += [fmt.format(*row) for row in rows] + [foot]
        print("\n".join(lines), flush=True)
        return
    table = Table(title=title, caption=foot, caption_justify="left")
    for h in headers:
        table.add_column(h, justify="left" if h == "rank" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        # A log file or a pipe: rich would cut the table to 80 columns ("sha…", "2.5e+…")
        console = Console(width=max(console.width, console.measure(table, options=console.options.update(
            max_width=1000)).maximum))
    console.print(table)
