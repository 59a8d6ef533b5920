"""The throughput goals of one GPU run, read off the benchmarks' JSON: one line per goal, then one file for all.

    python benchmarks/goals.py --lab out/p3/bench_lab.json out/p1/bench_lab.json out/p2/bench_lab.json \
        --hosts out/p7/bench_hosts.json --out $OUT

Goals (each figure a median over the run's rounds, with min-max; every emulated rank checked):

- P1 mix2 (one card at 1/4 of the SMs, PCIe class): ours / Σ solo >= 0.92, ResNet-50 and GPT-124M;
- P2 mix4 (1, 1, 1/2, 1/4): ours / Σ solo >= 0.90;
- P3 identical cards (same2 on NVLink, same2-pcie): ours (equal shares) / Lightning DDP >= 0.99;
- P7 two emulated hosts on 10 GbE: periodic sync / Lightning DDP >= 2.5 in samples/s, held-out loss within 1 %.

Writes ``goals.json`` (the goal lines and every input file's content) and prints the goal table last.
"""

import argparse
import json
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lab import format_table  # noqa: E402

# (goal, scenario, ours, measure, threshold): measure "ideal" = ours / Σ solo, "ddp" = ours / Lightning DDP.
LAB_GOALS = (
    ("P1", "mix2", "hetero-explicit", "ratio_to_ideal", 0.92),
    ("P1 lever bf16", "mix2", "hetero-explicit-bf16", "ratio_to_ideal", 0.92),
    ("P1 lever view", "mix2", "hetero-explicit-view", "ratio_to_ideal", 0.92),
    ("P1 profile", "mix2", "hetero-profile", "ratio_to_ideal", 0.92),
    ("P2", "mix4", "hetero-explicit", "ratio_to_ideal", 0.90),
    ("P2 lever bf16", "mix4", "hetero-explicit-bf16", "ratio_to_ideal", 0.90),
    ("P3 NVLink", "same2", "hetero-equal", "ratio_to_ddp", 0.99),
    ("P3 PCIe", "same2-pcie", "hetero-equal", "ratio_to_ddp", 0.99),
)


def _spread(value: Optional[dict[str, float]]) -> str:
    if not value:
        return "-"
    return f"{value['median']:.3f} ({value['min']:.3f}-{value['max']:.3f})"


def lab_lines(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The goal lines a bench_lab result holds."""
    out = []
    summary = result.get("summary", [])
    for goal, scenario, config, measure, threshold in LAB_GOALS:
        for line in summary:
            if line["scenario"] != scenario or line["config"] != config:
                continue
            lightning = next((s for s in summary if (s["scenario"], s["model"], s["config"]) ==
                              (scenario, line["model"], "ddp")), None)
            value = line.get(measure)
            out.append({
                "goal": goal, "scenario": scenario, "model": line["model"], "config": config,
                "measure": "ours / Σ solo" if measure == "ratio_to_ideal" else "ours / Lightning DDP",
                "value": value, "threshold": threshold, "rounds": line["rounds"],
                "met": None if not value else value["median"] >= threshold,
                "lightning_to_ideal": lightning.get("ratio_to_ideal") if lightning else None,
                "emulated": not line["unemulated_ranks"] and not (lightning or {}).get("unemulated_ranks"),
                "device": result.get("device"), "commit": result.get("commit"),
            })
    return out


def hosts_lines(result: dict[str, Any]) -> list[dict[str, Any]]:
    """P7: the periodic rows of a bench_hosts result."""
    out = []
    for row in result.get("rows", []):
        if row.get("config") != "periodic":
            continue
        ratio, held = row.get("ratio_to_ddp"), row.get("held_out_vs_ddp")
        ddp = next((r for r in result["rows"] if (r["model"], r["link"], r["config"]) ==
                    (row["model"], row["link"], "ddp")), {})
        out.append({
            "goal": "P7", "scenario": f"hosts {result.get('layout')} {row['link']}", "model": row["model"],
            "config": f"periodic H={result.get('every')}", "measure": "periodic / Lightning DDP",
            "value": {"median": ratio, "min": ratio, "max": ratio} if ratio else None, "threshold": 2.5,
            "rounds": 1, "held_out_vs_ddp": held,
            "met": None if ratio is None or held is None else ratio >= 2.5 and abs(held) <= 0.01,
            "lightning_to_ideal": None,
            "emulated": False not in (row.get("capped") or []) and False not in (ddp.get("capped") or []),
            "same_samples": not row.get("stopped_early") and not ddp.get("stopped_early"),
            "device": result.get("device"), "commit": result.get("commit"),
        })
    return out


def table(lines: list[dict[str, Any]]) -> str:
    rows = []
    for line in lines:
        extra = ""
        if line.get("held_out_vs_ddp") is not None:
            extra = f"held-out {100 * line['held_out_vs_ddp']:+.2f}% (<= 1 %)"
            if not line.get("same_samples", True):
                extra += " NOT same samples (stopped early)"
        rows.append([line["goal"], line["scenario"], line["model"], line["config"], line["measure"],
                     _spread(line["value"]), f">= {line['threshold']}",
                     {True: "MET", False: "no", None: "-"}[line["met"]], str(line["rounds"]),
                     _spread(line["lightning_to_ideal"]), "ok" if line["emulated"] else "NOT EMULATED", extra])
    return format_table(["goal", "scenario", "model", "config", "measure", "median (min-max)", "goal", "met", "n",
                         "Lightning / Σ solo", "emulated", "notes"], rows)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lab", nargs="*", default=[], help="bench_lab.json files")
    p.add_argument("--hosts", nargs="*", default=[], help="bench_hosts.json files")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    inputs: dict[str, Any] = {}
    lines: list[dict[str, Any]] = []
    for path, read in [(x, lab_lines) for x in args.lab] + [(x, hosts_lines) for x in args.hosts]:
        if not os.path.exists(path):
            print(f"[goals] {path}: missing (that benchmark did not finish)")
            continue
        with open(path) as f:
            inputs[path] = json.load(f)
        lines += read(inputs[path])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "goals.json"), "w") as f:
        json.dump({"goals": lines, "inputs": inputs}, f, indent=1)
    devices = sorted({str(line["device"]) for line in lines})
    commits = sorted({str(line["commit"]) for line in lines})
    print(f"[goals] {', '.join(devices)}; commit {', '.join(commits)}; emulated labs (bench_lab / bench_hosts): "
          "SM caps are green contexts on the host GPU (multiples of 8 SMs), links NCCL settings / pacing")
    print(table(lines))
    return lines


if __name__ == "__main__":
    main()
