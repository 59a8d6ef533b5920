"""Command line (also installed as ``lightning-hetero``):

    python -m lightning_hetero doctor [--json]                                  # this machine's devices and links
    python -m lightning_hetero doctor --model CONFIG [--script S] [--steps N]   # + a short monitored dry run
    python -m lightning_hetero doctor --model CONFIG --lab "A100-80GB,RTX3090,RTX3090" [--strategy hetero_fsdp]
                                      [--script S] [--json]                     # rehearse a lab on this machine
    python -m lightning_hetero doctor --compare-layouts --params 1.5e9 --lab "A100-80GB,A100-80GB,RTX3090,RTX3090"
                                      [--global-batch 64] [--tokens 512] [--optimizer adamw] [--solo A100-80GB=90]
                                      [--json]                                  # which layout, on which cards
    python -m lightning_hetero report LOGDIR [--out PNG]                        # plot a monitored run
"""

import argparse
from typing import Optional

from lightning_hetero.registry import names

# Training steps per rehearsed rank (the first 2 are not timed).
DEFAULT_REHEARSAL_STEPS = 6


# Parameter-sized optimizer state tensors per parameter.
OPTIMIZER_SLOTS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}


def compare(args: argparse.Namespace) -> None:
    """``doctor --compare-layouts``: every layout on the ``--lab`` cards and their fastest classes alone."""
    import json

    from lightning_hetero.observe.doctor import layouts_report, parse_solo
    from lightning_hetero.rehearse.cards import lab_cards

    if args.lab is None or args.params is None:
        raise ValueError("`--compare-layouts` needs `--lab` (the cards) and `--params` (a positive count).")
    report = layouts_report(lab_cards(args.lab), args.params, OPTIMIZER_SLOTS[args.optimizer], args.global_batch,
                            args.tokens, args.mfu, args.link, parse_solo(args.solo))
    print(json.dumps(report, indent=2) if args.json else report["text"])


def main(argv: Optional[list[str]] = None) -> None:
    # Raw: the usage lines of the description stay one per line.
    parser = argparse.ArgumentParser(prog="lightning-hetero", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor", help="check this machine's devices, links and settings for a mixed lab",
        description="Check this machine for a mixed lab: its devices and their published rates, suggested "
                    "capacities and precision, peer-to-peer access and NCCL advice. With --model CONFIG, also train "
                    "the config for a few monitored steps and say what each card computes, waits and sends.")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--model", metavar="CONFIG", help="also train this LightningCLI config for a few steps with "
                        "the monitor: what each card will compute, wait and send")
    doctor.add_argument("--script", help="the LightningCLI script the config belongs to, for the dry run and --lab "
                        "alike (default: a generic CLI, for configs whose model and data have a class_path)")
    doctor.add_argument("--steps", type=int, default=None, help="optimizer steps of the dry run (default 20; with "
                        "--lab: per rehearsed rank, default 6)")
    doctor.add_argument("--lab", help="rehearse the --model config on this lab on this machine (one rank at a time; "
                        "the hybrid layout's ranks together): "
                        "preset names ('A100-80GB,RTX3090,RTX3090') or a JSON list of profiles")
    doctor.add_argument("--strategy", choices=names(), help="with --lab: the strategy to "
                        "rehearse when the config's is not one of ours")
    doctor.add_argument("--out", help="with --lab: the folder for rehearsal.log/.json/.png (default ./rehearsal-TIME)")
    doctor.add_argument("--compare-layouts", action="store_true", help="with --lab and --params: whether data "
                        "parallel, sharded and hybrid fit every card, their predicted rates, and which to pick")
    doctor.add_argument("--params", type=float, help="with --compare-layouts: the model's parameter count (fp32)")
    doctor.add_argument("--optimizer", choices=sorted(OPTIMIZER_SLOTS), default="adamw",
                        help="with --compare-layouts: the optimizer (its state per parameter)")
    doctor.add_argument("--global-batch", type=int, default=64, help="with --compare-layouts: samples per step")
    doctor.add_argument("--tokens", type=int, default=512, help="with --compare-layouts: tokens per sample (a "
                        "sample costs 6 x params x tokens FLOPs)")
    doctor.add_argument("--mfu", type=float, default=0.4, help="with --compare-layouts: the fraction of each card's "
                        "published rate a step reaches (assumed)")
    doctor.add_argument("--link", choices=["nvlink", "pcie", "ethernet"], help="with --compare-layouts: every "
                        "card's link class (default: each preset's)")
    doctor.add_argument("--solo", help="with --compare-layouts: samples/s each card class measured alone, e.g. "
                        "'A100-80GB=1900,RTX3090=420' (in place of the published rates)")
    report = commands.add_parser(
        "report", help="draw a monitored run's per-rank timeline and share history (PNG)",
        description="Draw a monitored run's per-rank timeline and share history as a PNG, from the "
                    "hetero_monitor.jsonl a run with observation={'monitor': True} wrote under its logger's directory.")
    report.add_argument("logdir", help="the logger's directory (hetero_monitor.jsonl is searched below it)")
    report.add_argument("--out", help="PNG path (default: beside hetero_monitor.jsonl)")
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            from lightning_hetero.observe.doctor import DRY_RUN_STEPS, dry_run
            from lightning_hetero.observe.doctor import main as doctor_main

            if args.compare_layouts:
                compare(args)
                return
            if args.lab is not None:
                import json
                import sys

                from lightning_hetero.rehearse.command import rehearse

                if not args.model:
                    raise ValueError("`--lab` needs `--model CONFIG` (the job to rehearse).")
                # With --json, stdout carries the report alone: the progress and the tables go to stderr.
                rehearsal = rehearse(args.model, args.lab, args.strategy, out_dir=args.out, script=args.script,
                                  steps=DEFAULT_REHEARSAL_STEPS if args.steps is None else args.steps,
                                  stream=sys.stderr if args.json else sys.stdout)
                if args.json:
                    print(json.dumps(rehearsal, indent=2))
                if rehearsal["failed"]:
                    parser.exit(1, f"lightning-hetero doctor: error: {rehearsal['failed']}\n")
                return
            doctor_main(as_json=args.json)
            if args.model:
                raise SystemExit(dry_run(args.model, args.script, DRY_RUN_STEPS if args.steps is None else args.steps))
        elif args.command == "report":
            from lightning_hetero.observe.report import main as report_main

            report_main(args.logdir, args.out)
    except (OSError, ValueError) as err:  # what the user gave is wrong: one line saying what to do, no traceback
        parser.exit(2, f"lightning-hetero {args.command}: error: {err}\n")


if __name__ == "__main__":
    main()
