"""The rehearsal's honesty check on this machine's one device (see docs/plan-your-lab.md):

    python benchmarks/rehearse_check.py --model configs/rehearse_gpt_check.yaml --lab "A100-40GB,RTX3090" --out DIR

Rehearses the lab one rank at a time, then runs the same ranks together on this device and each card alone, and
prints rehearsed vs measured (plan, split, peak memory, step time); ``DIR/check.json`` holds every figure.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hetero.rehearse.rank import honesty_check  # noqa: E402
from lightning_hetero.registry import names  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--lab", required=True)
    parser.add_argument("--strategy", choices=names())
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="rehearsal-check")
    args = parser.parse_args()
    report = honesty_check(args.model, args.lab, args.steps, args.out, args.strategy)
    raise SystemExit(1 if report["check"]["disagreements"] else 0)
