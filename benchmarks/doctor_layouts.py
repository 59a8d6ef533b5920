"""The doctor's predicted samples/s per layout for the seed's lab, to set beside ``bench_hybrid.py``'s measured table.

Three workloads on "A100-80GB,A100-80GB,RTX3090,RTX3090": BERT-base (seq 128, global batch 160), GPT-124M (seq 1024,
8 a card: global 32) and the 1.64B GPT of ``bench_hybrid.py`` (seq 512, 8 a card: global 32). Each is one
``doctor --compare-layouts`` (arithmetic only: no model is built, no device used; a fraction of a second after the
package's import). Writes ``doctor_<workload>.json`` / ``.txt`` and ``doctor_predictions.json`` (per workload:
``pair`` = ``ddp:0,1``, ``ddp4``, ``fsdp4``, ``hybrid4`` = ``hybrid:0,1,2,3:2+3``, and the pick) under ``--out``.

    python benchmarks/doctor_layouts.py --out $OUT
    python benchmarks/doctor_layouts.py --out /tmp/d --solo bert=A100-80GB=1900,RTX3090=420   # measured solo rates
"""

import argparse
import contextlib
import io
import json
import os
import time
from typing import Any, Optional

from lightning_hetero.__main__ import main as cli

LAB = "A100-80GB,A100-80GB,RTX3090,RTX3090"
# (parameters, tokens a sample, global batch): BERT-base as benchmarks/models.py builds it, GPT-2 small at 1024
# tokens, bench_hybrid.py's GPT-2 XL shape with its untied head.
WORKLOADS = {"bert": (132_658_746, 128, 160), "gpt124m": (124_475_904, 1024, 32), "gpt1.6b": (1_637_353_600, 512, 32)}
KEYS = {"pair": "ddp:0,1", "ddp4": "ddp:0,1,2,3", "fsdp4": "fsdp:0,1,2,3", "hybrid4": "hybrid:0,1,2,3:2+3"}


def predict(workload: str, out: str, solo: Optional[str] = None) -> dict[str, Any]:
    """One workload's doctor report, written to ``out``; its layouts under the table's keys."""
    params, tokens, batch = WORKLOADS[workload]
    args = ["doctor", "--compare-layouts", "--lab", LAB, "--params", str(params), "--tokens", str(tokens),
            "--global-batch", str(batch), "--json"] + (["--solo", solo] if solo else [])
    start, text = time.perf_counter(), io.StringIO()
    with contextlib.redirect_stdout(text):
        cli(args)
    report = json.loads(text.getvalue())
    with open(os.path.join(out, f"doctor_{workload}.json"), "w") as f:
        f.write(text.getvalue())
    with open(os.path.join(out, f"doctor_{workload}.txt"), "w") as f:
        f.write(report["text"] + "\n")
    return {**{k: report["layouts"].get(v) for k, v in KEYS.items()}, "pick": report["pick"],
            "seconds": round(time.perf_counter() - start, 3)}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--solo", action="append", default=[], help="WORKLOAD=CARD=RATE,CARD=RATE: measured solo "
                        "samples/s of a workload's card classes (repeatable)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    solo = dict(s.split("=", 1) for s in args.solo)
    table = {w: predict(w, args.out, solo.get(w)) for w in WORKLOADS}
    with open(os.path.join(args.out, "doctor_predictions.json"), "w") as f:
        json.dump(table, f, indent=1)
    print(f"{'workload':<9}" + "".join(f"{k:>9}" for k in KEYS) + "  pick (s)")
    for w, row in table.items():
        print(f"{w:<9}" + "".join(f"{row[k]:9.1f}" if row[k] else f"{'-':>9}" for k in KEYS)
              + f"  {row['pick']} ({row['seconds']})")
    return table


if __name__ == "__main__":
    main()
