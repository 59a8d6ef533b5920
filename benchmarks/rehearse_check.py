"""The rehearsal's honesty check on this machine's one device (see docs/plan-your-lab.md):

    python benchmarks/rehearse_check.py --model configs/rehearse_gpt_check.yaml --lab "A100-40GB,RTX3090" --out DIR
    python benchmarks/rehearse_check.py --model configs/rehearse_gpt.yaml --lab "A100-80GB,RTX3090" \
        --real-gpus --runs hetero_fsdp:keep,hetero_fsdp:offload,hetero_ddp,ddp,fsdp --out DIR
        # against the lab really run, one GPU per card (NCCL): benchmarks/rehearse_real.py

Rehearses the lab one rank at a time, then runs the same ranks together on this device and each card alone, and
prints rehearsed vs measured (plan, split, peak memory, step time); ``DIR/check.json`` holds every figure. The
tests import :func:`honesty_check` from here (``tests/rehearse/test_rehearse.py`` on CPU,
``tests/gpu/test_gpu_rehearse.py``): it checks the rehearsal and is no part of the command.
"""

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hetero.lab.emulated_device import alone  # noqa: E402
from lightning_hetero.lab.emulation_spec import parse_emulate  # noqa: E402
from lightning_hetero.registry import entry, names  # noqa: E402
from lightning_hetero.rehearse.cards import card_label  # noqa: E402
from lightning_hetero.rehearse.command import rehearse  # noqa: E402
from lightning_hetero.rehearse.job import RankJob, RankResult  # noqa: E402
from lightning_hetero.rehearse.launch import free_port, launch_rank, launch_ranks  # noqa: E402
from lightning_hetero.rehearse.report import aligned, bound_label, gib, step_ms  # noqa: E402
from lightning_hetero.rehearse.together import is_hybrid  # noqa: E402

# Prediction and measurement agree when within this fraction of each other.
AGREEMENT = 0.10


def _relative(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    return None if not predicted or not measured else predicted / measured - 1.0


def solo_card(lab: Sequence[Any], rank: int, accelerator: str) -> Any:
    """The lab's card ``rank`` as a lab of one that keeps its speed in the lab (CPU slowdowns are lab-relative)."""
    specs = parse_emulate(list(lab)) or ()
    spec = alone(specs[rank], specs, "cuda" if accelerator == "gpu" else "cpu")
    return lab[rank] if spec is specs[rank] or spec is None else spec.as_dict()


def honesty_check(config: str, lab_text: str, steps: int = 6, out_dir: str = "rehearsal-check",
                  strategy: Optional[str] = None, timeout: float = 900.0) -> dict[str, Any]:
    """Rehearse ``lab_text``, then run the same ranks for real, together on this one device (gloo, each capped as
    its card), and each card alone (emulated solo, its rehearsed batch): the rehearsed plan, shares and peak memory
    against the real run's, and each card's rehearsed step time against its solo step time. Differences beyond
    :data:`AGREEMENT` are named in ``report["disagreements"]``."""
    if is_hybrid(config, strategy):
        # Its rehearsal already runs the lab's ranks together and predicts no step: nothing to hold it against here.
        raise ValueError("the honesty check compares a one-rank-at-a-time rehearsal with the ranks really run; the "
                         "hybrid layout is rehearsed with its ranks together (`doctor --model CONFIG --lab ...` "
                         "shows its roles, shares and memory): `--model` names a HeteroHybridStrategy config, or "
                         "`--strategy` is hetero_hybrid.")
    report = rehearse(config, lab_text, strategy, steps=steps, out_dir=out_dir, baselines=False, timeout=timeout)
    lab = report["lab"]
    accelerator = report["accelerator"]
    rehearsed = [RankResult(**r) for r in report["hetero"]]
    rehearsed += [RankResult("hetero", r, card_label(lab[r]), error="not rehearsed (rank 0 failed)")
                  for r in range(len(rehearsed), len(lab))]
    chosen = entry(strategy).class_path if strategy else None
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hetero-rehearse-check-") as scratch, \
            open(os.path.join(out_dir, "check.log"), "w") as log:
        shared = launch_ranks([RankJob(config, "shared", r, lab, steps, os.path.join(scratch, f"shared-rank{r}.json"),
                                       chosen, accelerator, port=port) for r in range(len(lab))], timeout, log)
        solo = [launch_rank(RankJob(config, "solo", 0, [solo_card(lab, r, accelerator)], steps,
                                    os.path.join(scratch, f"solo-rank{r}.json"),
                                    chosen, accelerator, port=free_port(), batch_size=rehearsed[r].batch), timeout,
                            log) if rehearsed[r].ok else RankResult("solo", r, rehearsed[r].card, error="not rehearsed")
                for r in range(len(lab))]
    rows, disagreements = [], []
    for r, (mine, real, solo_run) in enumerate(zip(rehearsed, shared, solo)):
        row, differs = compare_rank(r, mine, real, solo_run, cuda=accelerator == "gpu")
        rows.append(row)
        disagreements += differs
    # Every run's own record (its step times included), so that a disagreement can be looked into afterwards.
    check = {"rows": rows, "disagreements": disagreements, "agreement": AGREEMENT,
             "shared": [asdict(r) for r in shared], "solo": [asdict(r) for r in solo]}
    report["check"] = check
    with open(os.path.join(out_dir, "check.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(format_check(check))
    return report


def compare_rank(r: int, mine: RankResult, real: RankResult, solo: RankResult, cuda: bool
                 ) -> tuple[dict[str, Any], list[str]]:
    """Rank ``r`` rehearsed (``mine``) against the same rank really run together with the others (``real``: plan,
    split, peak memory) and its card emulated alone (``solo``: step time); the row, and each difference in words."""
    row: dict[str, Any] = {
        "rank": r, "card": mine.card,
        "plan": [mine.plan, real.plan], "split": [mine.split, real.split],
        "peak_bytes": [mine.peak_allocated_bytes, real.peak_allocated_bytes] if cuda else None,
        "step_seconds": [mine.step_time, solo.step_time],
        "step_spread": [mine.step_spread, solo.step_spread],
        "host_bound": [mine.host_bound, solo.host_bound],
    }
    row["peak_error"] = _relative(*row["peak_bytes"]) if cuda else None
    row["step_error"] = _relative(*row["step_seconds"])
    differs = []
    if mine.plan != real.plan or mine.split != real.split:
        differs.append(f"rank {r}: rehearsed plan {mine.plan} split {mine.split}, real {real.plan} {real.split}"
                       + (f" ({real.error})" if real.error else ""))
    if row["peak_error"] is None and cuda:
        differs.append(f"rank {r}: peak not compared ({mine.error or real.error})")
    elif row["peak_error"] is not None and abs(row["peak_error"]) > AGREEMENT:
        differs.append(f"rank {r}: rehearsed peak {gib(mine.peak_allocated_bytes)} GiB vs "
                       f"{gib(real.peak_allocated_bytes)} GiB really run together ({row['peak_error']:+.1%})")
    if row["step_error"] is None:
        differs.append(f"rank {r}: step time not compared ({mine.error or solo.error})")
    elif abs(row["step_error"]) > AGREEMENT:
        why = ("; host-bound (rehearsed/solo: " + "/".join(bound_label(b) for b in row["host_bound"]) + "): the times "
               "are this machine's CPU speed, which varies with its load") if any(row["host_bound"]) else ""
        differs.append(f"rank {r}: rehearsed step {step_ms(mine, ' ms')} vs emulated solo {step_ms(solo, ' ms')} "
                       f"({row['step_error']:+.1%}){why}")
    return row, differs


def format_check(check: dict[str, Any]) -> str:
    rows = [("rank", "card", "plan (reh/real)", "peak GiB (reh/real)", "err", "step ms (reh/solo)", "err",
             "bound (reh/solo)")]
    for row in check["rows"]:
        peaks = row["peak_bytes"] or [None, None]
        steps = [f"{s * 1e3:.1f}" if s else "-" for s in row["step_seconds"]]
        rows.append((str(row["rank"]), row["card"], "/".join(map(str, row["plan"])),
                     f"{gib(peaks[0])}/{gib(peaks[1])}",
                     f"{row['peak_error']:+.1%}" if row["peak_error"] is not None else "n/a",
                     "/".join(steps), f"{row['step_error']:+.1%}" if row["step_error"] is not None else "n/a",
                     "/".join(bound_label(b) for b in row["host_bound"])))
    lines = ["Honesty check: rehearsed vs the same ranks really run together on this device (peak) and each card "
             "emulated solo (step time)"]
    lines += aligned(rows)
    lines += [f"DIFFERS (> {check['agreement']:.0%}): {d}" for d in check["disagreements"]] or \
        [f"all within {check['agreement']:.0%}"]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--lab", required=True)
    parser.add_argument("--strategy", choices=names())
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="rehearsal-check")
    parser.add_argument("--real-gpus", action="store_true",
                        help="compare with the lab really run, one GPU per card (needs that many GPUs), not with the "
                             "ranks sharing this one")
    parser.add_argument("--runs", help="with --real-gpus: comma-separated runs, each ours ('hetero_fsdp:offload', "
                                       "'hetero_ddp') or Lightning's ('ddp', 'fsdp'); default: --strategy's")
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu",
                        help="with --real-gpus: 'cpu' runs the same paths on CPU (gloo), to exercise them")
    parser.add_argument("--timeout", type=float, default=400.0,
                        help="with --real-gpus: seconds one launch of a run's ranks may take")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.real_gpus:
        from benchmarks.rehearse_real import real_check

        runs = args.runs.split(",") if args.runs else [args.strategy or "hetero_fsdp"]
        checked = real_check(args.model, args.lab, runs, args.steps, args.out, args.timeout, args.accelerator)
        raise SystemExit(1 if checked["disagreements"] else 0)
    report = honesty_check(args.model, args.lab, args.steps, args.out, args.strategy)
    raise SystemExit(1 if report["check"]["disagreements"] else 0)
