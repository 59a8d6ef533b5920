"""The hybrid layout rehearsed: every rank of the lab together on this one device.

A pipeline's stage ranks pass activations to each other at every micro-batch, so ``HeteroHybridStrategy`` cannot be
rehearsed one rank at a time with its collectives stood in for. Here the lab's ranks run the config's real training
step together, each in its own process on this machine's device, over gloo, capped as its card (on CUDA its memory
and SM share; on CPU the emulator's slowdown): the honesty check's ``"shared"`` run
(:class:`~lightning_hetero.rehearse.job.RankJob`). Per rank it shows its role (a data-parallel replica, or stage s of
pipeline p), its replica's share of the global batch (and a pipeline's micro-batches), the pipelines chosen
(``pipelines="auto"``: the planner's) and its peak device memory (CUDA: its own process's allocator peak under its
card's cap) against its card's. The ranks take turns on the one device, so no step time is measured or predicted.

Example::

    python -m lightning_hetero doctor --model hybrid.yaml --lab "A100-80GB,RTX3090,RTX3090"   # HeteroHybridStrategy
"""

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional, TextIO

import yaml

from lightning_hetero.registry import entry, entry_of
from lightning_hetero.rehearse.job import RankJob, RankResult
from lightning_hetero.rehearse.launch import free_port, launch_ranks
from lightning_hetero.rehearse.notes import device_notes
from lightning_hetero.rehearse.predict import PROFILED
from lightning_hetero.rehearse.rank import SUBSTITUTED_DEFAULTS
from lightning_hetero.rehearse.report import aligned, gib, host_memory_lines

HYBRID = entry("hetero_hybrid")

NOT_PREDICTED = ("not predicted: the ranks shared this one device, taking turns on it, so no rank's step time is "
                 "its card's, and the job's step time cannot be composed from them. Time a real run of the lab "
                 "(observation={'monitor': True}), or compare the layouts' estimated rates with "
                 "`doctor --compare-layouts`")

ASSUMPTIONS = (
    "memory: measured (torch.cuda.max_memory_allocated of each rank's own process, under its card's memory cap, while "
    "the lab's ranks ran together on this device); the CUDA context and communication buffers (~0.5-1 GiB on a real "
    "card) are not included",
    "ranks together: every rank of the lab in its own process on this one device, over gloo (a pipeline's activations "
    "through host memory), each capped as its card; the ranks share the device's compute and take turns on it",
)

BASELINES_NOTE = ("Lightning's DDPStrategy and FSDPStrategy are not rehearsed beside the hybrid layout: `doctor --lab "
                  "... --strategy hetero_ddp` (or hetero_fsdp) rehearses the same config in the other layouts")


def _config_strategy(config: str) -> Any:
    """The config's ``trainer.strategy`` (``None`` where it names none, or is no YAML mapping: the ranks say why)."""
    try:
        with open(config) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError:
        return None
    trainer = data.get("trainer") if isinstance(data, dict) else None
    return trainer.get("strategy") if isinstance(trainer, dict) else None


def _names_hybrid(strategy: Any) -> bool:
    """A config's strategy is the hybrid: by class path, class name or registry name (``strategy: hetero_hybrid``)."""
    class_path = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    if not isinstance(class_path, str):
        return False
    named = entry_of(class_path)
    if named is not None:
        return named == HYBRID
    return class_path.rpartition(".")[2] == HYBRID.class_path.rpartition(".")[2]


def is_hybrid(config: str, strategy: Optional[str]) -> bool:
    """Whether ``config`` is rehearsed in the hybrid layout: ``--strategy hetero_hybrid``, or no ``--strategy`` and the
    config's own strategy is ``HeteroHybridStrategy``."""
    return strategy == HYBRID.name if strategy is not None else _names_hybrid(_config_strategy(config))


def pipelines_asked(config: str) -> Any:
    """The ``pipelines`` a hybrid rehearsal asks for: the config's own (its strategy the hybrid), else the default
    a substituted hybrid gets (the planner's choice)."""
    strategy = _config_strategy(config)
    if _names_hybrid(strategy):
        init_args = strategy.get("init_args") if isinstance(strategy, dict) else None
        return (init_args or {}).get("pipelines")
    return SUBSTITUTED_DEFAULTS[HYBRID.class_path]["pipelines"]


def run_together(config: str, lab: Sequence[Any], steps: int, scratch: str, log: Any, timeout: float,
                 strategy: Optional[str], accelerator: str, script: Optional[str], stream: TextIO
                 ) -> list[RankResult]:
    """Every rank of ``lab`` run together on this device (``strategy``: the class path to rehearse in place of the
    config's); their results without step times (see :data:`NOT_PREDICTED`)."""
    port = free_port()
    jobs = [RankJob(config, "shared", r, list(lab), steps, os.path.join(scratch, f"shared-rank{r}.json"), strategy,
                    accelerator, port=port, script=script) for r in range(len(lab))]
    print(f"  rehearsing the lab's {len(lab)} ranks together on this device ...", file=stream, flush=True)
    results = [untimed(r) for r in launch_ranks(jobs, timeout, log)]
    first = first_failure(results)
    for r in results:
        print(f"  rehearsed hybrid rank {r.rank} ({r.card}): {status(r, first)}", file=stream, flush=True)
    return results


def untimed(result: RankResult) -> RankResult:
    """``result`` without its times: measured while the ranks shared one device, they are no card's."""
    return replace(result, step_seconds=[], phase_seconds=[], device_wait_seconds=[], step_started_at=[],
                   emulation_probe_seconds=None, bucket_bytes=[], bucket_ready=[])


def first_failure(results: Sequence[RankResult]) -> Optional[RankResult]:
    """The rank that failed first (ranks run together: the others then stop with it), or ``None``."""
    failed = [r for r in results if r.error]
    return min(failed, key=lambda r: (r.failed_at is None, r.failed_at or 0.0, r.rank)) if failed else None


def status(r: RankResult, first: Optional[RankResult]) -> str:
    """``"ok"``, ``"OOM"``, the rank's error, or (a rank that failed after ``first``) that it stopped with it."""
    if r.ok:
        return "ok"
    if r.oom:
        return "OOM"
    if first is not None and r is not first:
        return f"stopped (rank {first.rank} {'ran out of memory' if first.oom else 'failed'} first)"
    return f"error: {r.error}"


def role(r: RankResult) -> str:
    """A data-parallel replica, stage s of pipeline p, or ``"-"`` (the rank ended before the layout was built)."""
    if r.stage is not None:
        return r.plan or f"stage {r.stage}"
    return "data-parallel replica" if r.pipelines is not None else "-"


def together_notes(results: Sequence[RankResult], accelerator: str) -> list[str]:
    """What the user must know about the figures of ranks run together on this device."""
    out = [BASELINES_NOTE] + device_notes(results, accelerator)
    caps = sum(r.card_memory_bytes or 0 for r in results)
    local = next((r.local_memory_bytes for r in results if r.local_memory_bytes), None)
    if local and caps > local:
        out.append(f"the lab's cards hold {gib(caps)} GiB together, this device {gib(local)} GiB: the ranks share "
                   "it, so a rank can run out of this device's memory before its card's (an OOM here then proves "
                   "nothing about the card); a peak that fits is that rank's own")
    measured = sorted({r.capacities_asked for r in results if r.capacities_asked in PROFILED})
    if measured:
        out.append(f"capacities {measured} (and a pipeline's micro-batch count, where `micro_batches` is not "
                   "given) were measured by the ranks here, while they took turns on this device: the shares are "
                   "not the lab's (a real run measures its own at its start); give the cards' capacities (a list or "
                   "a mapping) to rehearse the shares the lab would train with")
    return out


def format_together(report: dict[str, Any]) -> str:
    """The report of ranks run together, as a person reads it: the pipelines, the rank table, the memory verdict,
    why there is no step time, the assumptions and notes."""
    results = [RankResult(**r) for r in report["hetero"]]
    cuda = report["accelerator"] == "gpu"
    lines = [f"Rehearsal of {report['config']} on lab {report['lab_text']} ({report['strategy']}): the lab's "
             f"{len(report['lab'])} ranks together on {report['local_device']}, over gloo, each capped as its card; "
             f"{report['steps']} steps."]
    chosen = next((r.pipelines for r in results if r.pipelines is not None), None)
    asked = report.get("pipelines_asked")
    lines.append(f"pipelines: {chosen if chosen is not None else 'not built (see the errors)'}"
                 + (" (pipelines='auto': the planner's choice; its reasons are in rank 0's output in the log)"
                    if asked == "auto" else ""))
    first = first_failure(results)
    rows = [("rank", "card", "role", "share", "batch", "micro-batches", "peak GiB", "card GiB", "headroom", "status")]
    for r in results:
        samples = round(r.share * r.global_batch) if r.share is not None and r.global_batch else None
        micro = f"{r.micro_batches} x {samples // r.micro_batches}" if r.micro_batches and samples else "-"
        peak = r.peak_allocated_bytes if cuda else None
        headroom = (r.card_memory_bytes - peak) if (peak is not None and r.card_memory_bytes) else None
        rows.append((str(r.rank), r.card, role(r), f"{r.share:.1%}" if r.share is not None else "-",
                     str(samples or "-"), micro, gib(peak), gib(r.card_memory_bytes), gib(headroom),
                     status(r, first)))
    lines += aligned(rows)
    lines.append("  share and batch: the rank's replica's (a pipeline's, for each of its stage ranks) of the global "
                 f"batch of {next((r.global_batch for r in results if r.global_batch), '-')}")
    if not cuda:
        lines += host_memory_lines(results)
    lines.append(memory_verdict(results, first, cuda))
    lines.append(f"Step time: {NOT_PREDICTED}.")
    lines += [f"assumption: {a}" for a in report["assumptions"]]
    lines += [f"NOTE: {n}" for n in report["notes"]]
    return "\n".join(lines)


def memory_verdict(results: Sequence[RankResult], first: Optional[RankResult], cuda: bool) -> str:
    """The ranks that ran out of memory, named; or every rank's peak against its card."""
    out = [r for r in results if r.oom]
    if out:
        return "OUT OF MEMORY: " + "; ".join(
            f"rank {r.rank} ({r.card}, {role(r)}) ran out of memory under its card's "
            f"{gib(r.card_memory_bytes)} GiB" for r in out)
    if first is not None:
        return "Memory: not known for every rank (a rank failed: see its error)"
    if not cuda:
        return "Memory: not measured on CPU (see the CPU note)"
    fits = ", ".join(f"rank {r.rank} {gib(r.peak_allocated_bytes)} of {gib(r.card_memory_bytes)}" for r in results)
    return f"Memory: every rank fits its card (peak of card, GiB: {fits})"

