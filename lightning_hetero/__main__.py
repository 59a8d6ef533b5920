"""Command line: ``python -m lightning_hetero doctor [--json]`` (also installed as ``lightning-hetero``)."""

import argparse
from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-hetero", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check this machine's devices, links and settings for a mixed lab")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from lightning_hetero.doctor import main as doctor_main

        doctor_main(as_json=args.json)


if __name__ == "__main__":
    main()
