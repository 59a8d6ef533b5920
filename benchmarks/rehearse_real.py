"""The rehearsal held against the same lab really run, one GPU per card (``rehearse_check.py --real-gpus``).

For each run (ours, sharded with a memory plan or replicated, and Lightning's ``DDPStrategy`` / ``FSDPStrategy``),
the lab is rehearsed (each rank alone with the fake process group, as ``doctor --lab`` does; here rank r on GPU r, all
at once, to save time: each rank is still one process on one GPU) and then run for real (rank r on GPU r, NCCL, every
rank emulated as its card by its own process). Per rank: the rehearsed peak against the real one, the memory plan's
estimate (made before the first step) against the real peak, and the rank's emulation at work (a fixed workload timed
under it: across ranks the times go as the inverse of the emulated speeds, a rank left unemulated stands out). Per
run: the predicted step (overlap modelled) and its no-overlap bound against the real step (the slowest rank's), with
the link class's table bandwidth and again with the link measured first on these GPUs under the emulator's NCCL
settings (``benchmarks/link_rank.py``: all-gathers and reduce-scatters of 1 MiB and 128 MiB).

    python benchmarks/rehearse_check.py --model configs/rehearse_gpt_check.yaml \\
        --lab "A100-80GB,RTX3090,RTX3090,A100-40GB" --real-gpus \\
        --runs hetero_fsdp:keep,hetero_fsdp:offload,hetero_ddp,ddp,fsdp --steps 5 --out DIR
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_hetero.lab.emulation_env import job_link_class
from lightning_hetero.lab.emulation_spec import parse_emulate
from lightning_hetero.registry import entry
from lightning_hetero.rehearse.cards import parse_lab
from lightning_hetero.rehearse.job import WARMUP_STEPS, RankJob, RankResult
from lightning_hetero.rehearse.launch import free_port, launch_ranks
from lightning_hetero.rehearse.predict import predict
from lightning_hetero.rehearse.report import aligned, gib

# Issue 37's bars: rehearsed peaks within 5 %, the plan's estimate and the predicted step within 10 %.
PEAK_AGREEMENT, ESTIMATE_AGREEMENT, STEP_AGREEMENT = 0.05, 0.10, 0.10
# An emulated rank's workload time against the one its emulated speed implies (rank 0 the reference).
EMULATION_AGREEMENT = 0.25
LIGHTNING = {"ddp": ("ddp", "real_ddp"), "fsdp": ("fsdp", "real_fsdp")}
# Steps of a run whose ranks offload to host memory (its step takes seconds): the warm-up and one timed step.
OFFLOAD_STEPS = WARMUP_STEPS + 1


@dataclass(frozen=True)
class Run:
    """One strategy to hold against the real lab: ``"hetero_fsdp:offload"`` (ours, a ``memory`` rule for every
    rank), ``"hetero_ddp"``, or Lightning's ``"ddp"`` / ``"fsdp"`` (equal batches)."""

    name: str
    strategy: Optional[str]  # our strategy's registry name; None for Lightning's
    memory: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "Run":
        name, _, memory = text.partition(":")
        if name in LIGHTNING:
            if memory:
                raise ValueError(f"`--runs` {text!r}: Lightning's {name} takes no memory rule")
            return cls(text, None)
        entry(name)  # a clear error for an unknown strategy
        return cls(text, name, memory or None)

    def modes(self) -> tuple[str, str]:
        """The rehearsed and the real rank mode."""
        return LIGHTNING[self.name] if self.strategy is None else ("hetero", "real")

    def steps(self, asked: int) -> int:
        """The steps this run takes: ``asked``, or :data:`OFFLOAD_STEPS` at most where ranks offload."""
        return min(asked, OFFLOAD_STEPS) if (self.memory or "").startswith("offload") else asked


def run_jobs(config: str, lab: list[Any], run: Run, mode: str, steps: int, scratch: str, accelerator: str,
             timeout: float, log: Any) -> list[RankResult]:
    """Every rank of ``run`` at once in ``mode``, rank r on GPU r."""
    port = free_port()
    chosen = entry(run.strategy).class_path if run.strategy else None
    tag = run.name.replace(":", "-")
    jobs = [RankJob(config, mode, r, lab, steps, os.path.join(scratch, f"{tag}-{mode}-rank{r}.json"), chosen,
                    accelerator, port=port, gpu=r if accelerator == "gpu" else None, memory=run.memory)
            for r in range(len(lab))]
    log.write(f"\n===== {run.name} {mode} =====\n")
    log.flush()
    return launch_ranks(jobs, timeout, log)


def measure_link(world: int, link: str, scratch: str, timeout: float) -> Optional[dict[str, Any]]:
    """The lab's link measured on this machine's first ``world`` GPUs (rank r on GPU r): GB/s and seconds per ring
    hop fitted to all-gathers of two sizes (reduce-scatters beside them), or ``None`` if the measurement failed."""
    from benchmarks.link_rank import SIZES

    port = str(free_port())
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "link_rank.py")
    outs = [os.path.join(scratch, f"link{r}.json") for r in range(world)]
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    processes = [subprocess.Popen([sys.executable, script, str(r), str(world), port, link, outs[r]],
                                  env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible[r] if r < len(visible) else str(r)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(world)]
    try:
        for process in processes:
            process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for process in processes:
            process.kill()
    if not all(os.path.exists(o) for o in outs):
        return None
    with open(outs[0]) as f:
        seconds = json.load(f)["seconds"]
    small, large = SIZES
    ring = (world - 1) / world
    fitted: dict[str, Any] = {"seconds": seconds}
    for kind in ("all_gather", "reduce_scatter"):
        t_small, t_large = seconds.get(f"{kind}:{small}"), seconds.get(f"{kind}:{large}")
        if t_small is None or t_large is None or t_large <= t_small:
            continue
        gbytes = ring * (large - small) / (t_large - t_small) / 1e9
        fitted[kind] = (gbytes, max(0.0, (t_small - ring * small / (gbytes * 1e9)) / max(1, world - 1)))
    if "all_gather" not in fitted:
        return None
    # One figure for the model's collectives: the slower of the two kinds measured.
    fitted["gbytes_per_s"], fitted["latency_s"] = min((fitted[k] for k in ("all_gather", "reduce_scatter")
                                                       if k in fitted), key=lambda pair: pair[0])
    return fitted


def emulation_rows(results: Sequence[RankResult]) -> list[dict[str, Any]]:
    """Each rank's workload time under its emulation, against rank 0's scaled by the emulated speeds."""
    base = results[0] if results else None
    rows = []
    for r in results:
        expected = measured = None
        if base and base.emulation_probe_seconds and r.emulation_probe_seconds:
            measured = r.emulation_probe_seconds / base.emulation_probe_seconds
            if base.emulated_speed and r.emulated_speed:
                expected = base.emulated_speed / r.emulated_speed
        rows.append({"rank": r.rank, "speed": r.emulated_speed, "probe_seconds": r.emulation_probe_seconds,
                     "ratio": measured, "expected_ratio": expected})
    return rows


def _relative(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    return None if not value or not reference else value / reference - 1.0


def _phases(result: RankResult) -> Optional[list[float]]:
    phases = result.phases
    return None if phases is None else [phases.forward, phases.backward, phases.optimizer]


def start_skew(real: Sequence[RankResult]) -> dict[str, Optional[float]]:
    """How far apart the really run ranks start their timed steps (the latest start less the earliest, median over
    the steps: near 0 when a per-step collective holds them together) and the step's period (rank 0's start to
    start, the time a step really takes, waits outside the timed window included)."""
    starts = [r.step_started_at for r in real]
    steps = min((len(s) for s in starts), default=0)
    timed = range(min(WARMUP_STEPS, max(0, steps - 1)), steps)
    skews = [max(s[i] for s in starts) - min(s[i] for s in starts) for i in timed] if starts else []
    periods = [starts[0][i + 1] - starts[0][i] for i in timed if i + 1 < steps] if starts else []
    return {"start_skew_seconds": statistics.median(skews) if skews else None,
            "period_seconds": statistics.median(periods) if periods else None}


def compare_run(run: Run, rehearsed: list[RankResult], real: list[RankResult], prediction: dict[str, Any],
                measured: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], list[str]]:
    """One run's rows (per rank) and summary, and each miss of the bars in words."""
    differs: list[str] = []
    emulation = emulation_rows(real)
    ranks = []
    for r, (mine, theirs) in enumerate(zip(rehearsed, real)):
        row = {"rank": r, "card": theirs.card, "plan": [mine.plan, theirs.plan], "batch": [mine.batch, theirs.batch],
               "peak_bytes": [mine.peak_allocated_bytes, theirs.peak_allocated_bytes],
               "estimate_bytes": theirs.estimated_bytes, "estimate_source": theirs.estimate_source,
               "step_seconds": [mine.step_time, theirs.step_time], "errors": [mine.error, theirs.error],
               "phase_seconds": [_phases(mine), _phases(theirs)], "emulation": emulation[r],
               "host_phase_seconds": [mine.host_phases, theirs.host_phases],
               "host_bound": [mine.host_bound, theirs.host_bound], "peak_reached": [mine.peak_reached,
                                                                                    theirs.peak_reached],
               "cpus": [sorted(set(mine.step_cpus)), sorted(set(theirs.step_cpus))],
               "involuntary_switches": [mine.involuntary_switches, theirs.involuntary_switches]}
        row["peak_error"] = _relative(mine.peak_allocated_bytes, theirs.peak_allocated_bytes)
        row["estimate_error"] = _relative(theirs.estimated_bytes, theirs.peak_allocated_bytes)
        ranks.append(row)
        where = f"{run.name} rank {r} ({theirs.card})"
        if mine.error or theirs.error:
            differs.append(f"{where}: {mine.error or theirs.error}")
        if row["peak_error"] is not None and abs(row["peak_error"]) > PEAK_AGREEMENT:
            differs.append(f"{where}: rehearsed peak {gib(mine.peak_allocated_bytes)} GiB vs real "
                           f"{gib(theirs.peak_allocated_bytes)} ({row['peak_error']:+.1%}); reached: rehearsed "
                           f"{mine.peak_reached or '?'}, real {theirs.peak_reached or '?'}; set-up peaks "
                           f"{gib(mine.setup_peak_bytes)} / {gib(theirs.setup_peak_bytes)} GiB")
        if row["estimate_error"] is not None and abs(row["estimate_error"]) > ESTIMATE_AGREEMENT:
            differs.append(f"{where}: plan estimate {gib(theirs.estimated_bytes)} GiB ({theirs.estimate_source}) vs "
                           f"real peak {gib(theirs.peak_allocated_bytes)} ({row['estimate_error']:+.1%})")
        e = emulation[r]
        if e["speed"] is None and e["probe_seconds"] is not None:
            differs.append(f"{where}: NOT EMULATED (no emulator in the rank's process)")
        elif e["ratio"] and e["expected_ratio"] and abs(e["ratio"] / e["expected_ratio"] - 1) > EMULATION_AGREEMENT:
            differs.append(f"{where}: workload {e['ratio']:.2f}x rank 0's under its emulation, expected "
                           f"{e['expected_ratio']:.2f}x from the emulated speeds")
    real_step = max((r.step_time for r in real if r.step_time), default=None)
    predicted = next(iter(prediction.get("strategies", {}).values()), None)
    with_link = next(iter((measured or {}).get("strategies", {}).values()), None)
    summary = {"run": run.name, "ranks": ranks, "real_step_seconds": real_step,
               "predicted_step_seconds": predicted["step_seconds"] if predicted else None,
               "no_overlap_step_seconds": predicted["no_overlap_step_seconds"] if predicted else None,
               "measured_link_step_seconds": with_link["step_seconds"] if with_link else None,
               "compute_seconds": predicted["compute_seconds"] if predicted else None,
               "predicted_phase_seconds": predicted.get("phase_seconds") if predicted else None,
               **start_skew(real)}
    summary["step_error"] = _relative(summary["predicted_step_seconds"], real_step)
    summary["measured_link_step_error"] = _relative(summary["measured_link_step_seconds"], real_step)
    if summary["step_error"] is not None and abs(summary["step_error"]) > STEP_AGREEMENT:
        differs.append(f"{run.name}: predicted step {summary['predicted_step_seconds'] * 1e3:.1f} ms vs real "
                       f"{real_step * 1e3:.1f} ms ({summary['step_error']:+.1%})")
    return summary, differs


def real_check(config: str, lab_text: str, runs: Sequence[str], steps: int = 5, out_dir: str = "rehearsal-check",
               timeout: float = 400.0, accelerator: str = "gpu") -> dict[str, Any]:
    """Each of ``runs`` (see :class:`Run`) rehearsed and really run on ``lab_text``, one GPU per card; writes
    ``out_dir/real_check.json`` and returns it. ``accelerator="cpu"`` runs the same paths on CPU (gloo; no peaks,
    Lightning's FSDPStrategy left out), to exercise them."""
    lab = parse_lab(lab_text)
    link = job_link_class(list(parse_emulate(lab) or ()))
    parsed = [Run.parse(text) for text in runs]
    if accelerator != "gpu":
        parsed = [run for run in parsed if run.name != "fsdp"]
    results: dict[str, Any] = {"config": config, "lab": lab, "link": link, "steps": steps, "runs": [],
                               "disagreements": []}
    ours_rehearsed: list[RankResult] = []
    with tempfile.TemporaryDirectory(prefix="hetero-real-check-") as scratch, \
            open(os.path.join(out_dir, "real.log"), "w") as log:
        link_measured = measure_link(len(lab), link, scratch, timeout)
        results["measured_link"] = link_measured
        pair = (link_measured["gbytes_per_s"], link_measured["latency_s"]) if link_measured else None
        print(f"  link {link}: " + (f"{pair[0]:.1f} GB/s, {pair[1] * 1e6:.0f} us a hop (measured)" if pair else
                                   "not measured"), flush=True)
        for run in parsed:
            rehearsed_mode, real_mode = run.modes()
            taken = run.steps(steps)
            rehearsed = run_jobs(config, lab, run, rehearsed_mode, taken, scratch, accelerator, timeout, log)
            real = run_jobs(config, lab, run, real_mode, taken, scratch, accelerator, timeout, log)
            ours_rehearsed = ours_rehearsed or (rehearsed if run.strategy is not None else [])
            prediction, measured = (predicted_step(run, rehearsed, ours_rehearsed, link, measured_link)
                                    for measured_link in (None, pair))
            summary, differs = compare_run(run, rehearsed, real, prediction, measured if pair else None)
            summary["rehearsed"] = [asdict(r) for r in rehearsed]
            summary["real"] = [asdict(r) for r in real]
            results["runs"].append(summary)
            results["disagreements"] += differs
            # Written after every run: a check cut short by a time limit keeps what it measured.
            with open(os.path.join(out_dir, "real_check.json"), "w") as f:
                json.dump(results, f, indent=2)
            print(f"  {run.name}: rehearsed and run ({len(differs)} misses)", flush=True)
    print(format_real_check(results))
    return results


def predicted_step(run: Run, rehearsed: list[RankResult], ours: list[RankResult], link: str,
                   measured_link: Optional[tuple[float, float]]) -> dict[str, Any]:
    """The rehearsal's prediction for ``run`` alone (Lightning's from its own rehearsed ranks, ours giving each card's
    rate)."""
    if run.strategy is not None:
        return predict(rehearsed, [], [], run.strategy, link, measured_link)
    base = ours or rehearsed
    prediction = predict(base, *((rehearsed, []) if run.name == "ddp" else ([], rehearsed)), "", link,
                         measured_link)
    prediction["strategies"] = {k: v for k, v in prediction.get("strategies", {}).items() if k == run.name}
    return prediction


def _ms(seconds: Optional[float]) -> str:
    return f"{seconds * 1e3:.1f}" if seconds is not None else "-"


def _pct(value: Optional[float]) -> str:
    return f"{value:+.1%}" if value is not None else "n/a"


def peak_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("run", "rank", "card", "plan", "batch", "peak GiB reh/real", "err", "estimate GiB (from)", "err",
             "probe x rank0 (expected)")]
    for run in results["runs"]:
        for row in run["ranks"]:
            e = row["emulation"]
            probe = "-" if e["ratio"] is None else f"{e['ratio']:.2f} ({e['expected_ratio'] or 0:.2f})"
            if e["speed"] is None and e["probe_seconds"] is not None:
                probe += " NOT EMULATED"
            peaks = row["peak_bytes"]
            rows.append((run["run"], str(row["rank"]), row["card"], str(row["plan"][1]), str(row["batch"][1]),
                         f"{gib(peaks[0])}/{gib(peaks[1])}", _pct(row["peak_error"]),
                         f"{gib(row['estimate_bytes'])} ({row['estimate_source'] or '-'})"
                         if row["estimate_bytes"] else "-", _pct(row["estimate_error"]), probe))
    return rows


def phase_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("run", "rank", "batch", "forward / backward / rest ms: rehearsed", "really run",
             "on the host: rehearsed", "really run", "host-bound", "CPUs reh | real", "real start skew ms",
             "real period ms")]
    for run in results["runs"]:
        for row in run["ranks"]:
            mine, theirs = row.get("phase_seconds") or (None, None)
            host_mine, host_theirs = row.get("host_phase_seconds") or (None, None)
            bound = "/".join({True: "yes", False: "no"}.get(b, "-") for b in row.get("host_bound") or (None, None))
            first = row["rank"] == 0
            rows.append((run["run"], str(row["rank"]), str(row["batch"][1]), _phase_text(mine),
                         _phase_text(theirs), _phase_text(host_mine), _phase_text(host_theirs), bound,
                         " | ".join(",".join(map(str, c)) or "-" for c in row.get("cpus") or ([], [])),
                         _ms(run.get("start_skew_seconds")) if first else "",
                         _ms(run.get("period_seconds")) if first else ""))
    return rows


def _phase_text(phases: Optional[Sequence[float]]) -> str:
    return " / ".join(_ms(p) for p in phases) if phases else "-"


def step_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("run", "compute ms per rank (rehearsed)", "predicted ms", "of it: fwd+bwd / optimizer", "no-overlap ms",
             "real ms", "err", "with link measured ms", "err")]
    for run in results["runs"]:
        compute = "/".join(_ms(c) for c in run["compute_seconds"] or [])
        predicted, phases = run["predicted_step_seconds"], run.get("predicted_phase_seconds")
        optimizer = max(p[2] for p in phases) if phases and predicted else None
        split = f"{_ms(predicted - optimizer)} / {_ms(optimizer)}" if optimizer is not None else "-"
        rows.append((run["run"], compute or "-", _ms(predicted), split, _ms(run["no_overlap_step_seconds"]),
                     _ms(run["real_step_seconds"]), _pct(run["step_error"]), _ms(run["measured_link_step_seconds"]),
                     _pct(run["measured_link_step_error"])))
    link = results.get("measured_link")
    if link:
        rows.append(("link measured:", f"{link['gbytes_per_s']:.1f} GB/s", f"{link['latency_s'] * 1e6:.0f} us/hop",
                     "", "", "", "", "", ""))
    return rows


def format_real_check(results: dict[str, Any], peaks: bool = True) -> str:
    """The check's tables (peaks and plan estimates, each rank's phases, the steps) and its misses; without
    ``peaks``, the step-time tables alone."""
    lines = [f"Rehearsed vs really run, one GPU per card: {results.get('config', '')} on {results.get('lab', '')} "
             f"(link {results['link']}); peaks torch.cuda.max_memory_allocated; estimate: the memory plan's, made "
             "before the first step"]
    lines += (aligned(peak_rows(results)) + [""] if peaks else []) + aligned(phase_rows(results)) + [""]
    lines += aligned(step_rows(results))
    lines += [f"MISS: {d}" for d in results["disagreements"]] or ["every figure within its bar"]
    return "\n".join(lines)


if __name__ == "__main__":
    # The step-time tables of one or more checks' `real_check.json`, e.g. two labs checked one after the other.
    for path in sys.argv[1:]:
        with open(path) as f:
            print(format_real_check(json.load(f), peaks=False) + "\n")
