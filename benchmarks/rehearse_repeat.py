"""How steady a rehearsed rank's step time is on this machine: the same rank rehearsed again and again, each time in
a fresh process, with the host's wait for the device at each step's end (near 0: the step is host-bound).

    python benchmarks/rehearse_repeat.py --out DIR            # the 2026-11-26 plan: FSDP ranks 0 and 1, solo, DDP
    taskset -c 2-5 python benchmarks/rehearse_repeat.py --out DIR --tag pinned --only-fsdp-rank0

Runs the 350M GPT of ``configs/rehearse_gpt_check.yaml`` on "A100-40GB,RTX3090" (emulated on this one GPU), 16 steps
per process, the first 2 untimed; prints one line per process and saves ``DIR/repeat_TAG.json``.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rehearse_check import solo_card  # noqa: E402
from lightning_hetero.registry import entry  # noqa: E402
from lightning_hetero.rehearse.job import WARMUP_STEPS, RankJob  # noqa: E402
from lightning_hetero.rehearse.launch import free_port, launch_rank  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "rehearse_gpt_check.yaml")
LAB = ["A100-40GB", "RTX3090"]
# (mode, strategy, rank, batch): rehearsed FSDP rank 0 three times and rank 1 twice, rank 0's card solo at its
# rehearsed batch twice, and rehearsed DDP rank 0 once for contrast.
PLAN = [("hetero", "hetero_fsdp", 0, None)] * 3 + [("hetero", "hetero_fsdp", 1, None)] * 2 + \
       [("solo", "hetero_fsdp", 0, 7)] * 2 + [("hetero", "hetero_ddp", 0, None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="rehearse-repeat")
    parser.add_argument("--tag", default="free")
    parser.add_argument("--only-fsdp-rank0", action="store_true", help="rehearsed FSDP rank 0, three times")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    plan = PLAN[:3] if args.only_fsdp_rank0 else PLAN
    rows = []
    with open(os.path.join(args.out, f"repeat_{args.tag}.log"), "w") as log, \
            tempfile.TemporaryDirectory() as scratch:
        for i, (mode, strategy, rank, batch) in enumerate(plan):
            lab = [solo_card(LAB, rank, "gpu")] if mode == "solo" else LAB
            job = RankJob(CONFIG, mode, 0 if mode == "solo" else rank, lab, args.steps,
                          os.path.join(scratch, f"{i}.json"), entry(strategy).class_path, "gpu", port=free_port(),
                          batch_size=batch)
            result = launch_rank(job, 300, log)
            timed, waits = result.step_seconds[WARMUP_STEPS:], result.device_wait_seconds[WARMUP_STEPS:]
            if len(timed) < 2:
                print(f"{args.tag:7} {mode:6} {strategy:11} r{rank} failed: {result.error}", flush=True)
                continue
            deciles = statistics.quantiles(timed, n=10)
            row = {"tag": args.tag, "mode": mode, "strategy": strategy, "rank": rank, "batch": result.batch,
                   "median_ms": 1e3 * statistics.median(timed), "p10_ms": 1e3 * deciles[0],
                   "p90_ms": 1e3 * deciles[-1], "wait_ms": 1e3 * statistics.median(waits),
                   "host_bound": result.host_bound, "steps_ms": [round(1e3 * s) for s in result.step_seconds],
                   "waits_ms": [round(1e3 * w, 1) for w in result.device_wait_seconds]}
            rows.append(row)
            print(f"{args.tag:7} {mode:6} {strategy:11} r{rank} b{result.batch} median {row['median_ms']:.1f} "
                  f"p10 {row['p10_ms']:.1f} p90 {row['p90_ms']:.1f} wait {row['wait_ms']:.1f}", flush=True)
    with open(os.path.join(args.out, f"repeat_{args.tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
