"""Calibrate the emulator's presets on this GPU: measure, fit, check.

Three sub-commands (each prints a table last)::

    # on one GPU: step speed of one workload at every green-context SM count, relative to the whole GPU
    CUDA_VISIBLE_DEVICES=0 python benchmarks/calibrate_presets.py sweep --workload bert --out /tmp/cal
    # the calibration file (the package's format) from the sweeps, and each preset's fitted knob
    python benchmarks/calibrate_presets.py fit --sweeps /tmp/cal --out h200.json
    # on one GPU: each preset through the real emulator path (SM cap + dilation) against its published speed
    CUDA_VISIBLE_DEVICES=0 python benchmarks/calibrate_presets.py validate --calibration h200.json --workload bert \
        --out /tmp/cal
    # the validations of several workloads in one JSON and one table
    python benchmarks/calibrate_presets.py report --validations /tmp/cal --out validate.json

Workloads (bf16 autocast, AdamW, forward + backward + optimizer step on the emulator's stream): BERT-base seq 128
batch 32 (``bert``), ResNet-50 224 px batch 64 (``resnet``), GPT-2 small seq 512 batch 8 (``gpt``). ``--device cpu
--tiny`` is a dry run: tiny shapes, no SM caps, and ``sweep`` writes a synthetic curve (marked so) in place of the
measured one, so that ``fit`` and ``validate`` run their real code on it.
"""

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lightning_hetero.lab.calibration import (  # noqa: E402
    CALIBRATION_ENV,
    fit_calibration,
    load_calibration,
    target_speed,
)
from lightning_hetero.lab.cards import PUBLISHED, REFERENCE, WORKLOADS, training_speed  # noqa: E402
from lightning_hetero.lab.devices import DeviceInfo, describe_device  # noqa: E402
from lightning_hetero.lab.emulated_device import resolve  # noqa: E402
from lightning_hetero.lab.emulation_spec import EmulationSpec  # noqa: E402
from lightning_hetero.lab.emulator import Emulator  # noqa: E402
from models import GPT, Bert, BertConfig, GPTConfig, mlm_batch, resnet50, tiny_resnet  # noqa: E402

# A dry run on CPU pretends to be this host, so that the calibration's code paths run as on the GPU.
DRY_RUN_HOST = DeviceInfo(rank=0, host="dry-run", type="cuda", name="NVIDIA H200 (dry run)", capability=(9, 0),
                          memory_bytes=141 * 2**30, multiprocessors=132)
# Synthetic curve exponents of the dry run: speed = (SMs / all) ** exponent.
_DRY_RUN_EXPONENTS = {"bert": 0.6, "resnet": 0.5, "gpt": 0.7}

Step = Callable[[], None]


# Batches large enough that a step on a whole H200 is bound by the GPU, not by the host launching its kernels (at
# BERT-base batch 32 a step took 29.6 ms on all 132 SMs and 28.6 ms on 64: the host's pace, not the GPU's).
GPU_BOUND_BATCH = {"bert": 128, "resnet": 128, "gpt": 16}


def build_step(workload: str, device: torch.device, tiny: bool, batch: int = 0) -> tuple[Step, int]:
    """A closure running one training step of ``workload`` (forward, backward, AdamW) and its batch size (``0``: the
    workload's :data:`GPU_BOUND_BATCH`)."""
    torch.manual_seed(0)
    batch = 4 if tiny else (batch or GPU_BOUND_BATCH[workload])
    if workload == "bert":
        cfg = BertConfig.tiny() if tiny else BertConfig(seq=128)
        model: torch.nn.Module = Bert(cfg)
        inputs, labels = (t.to(device) for t in mlm_batch(cfg, batch))

        def loss() -> torch.Tensor:
            return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)
    elif workload == "resnet":
        size = 32 if tiny else 224
        model = tiny_resnet() if tiny else resnet50()
        images = torch.randn(batch, 3, size, size, device=device)
        classes = torch.randint(0, 10 if tiny else 1000, (batch,), device=device)

        def loss() -> torch.Tensor:
            return F.cross_entropy(model(images), classes)
    elif workload == "gpt":
        cfg = GPTConfig.tiny() if tiny else GPTConfig.gpt2_small(seq=512)
        model = GPT(cfg)
        tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device=device)

        def loss() -> torch.Tensor:
            return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    else:
        raise ValueError(f"`--workload`={workload!r} must be one of {WORKLOADS}.")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(emulator: Emulator, step: Step, device: torch.device, warmup: int, timed: int) -> float:
    """Seconds per step of ``step`` run as the strategy runs it (inside ``emulator.work()``), after ``warmup``."""
    for _ in range(warmup):
        with emulator.work():
            step()
    _sync(device)
    begin = time.perf_counter()
    for _ in range(timed):
        with emulator.work():
            step()
    _sync(device)
    return (time.perf_counter() - begin) / timed


def _host(device: torch.device) -> DeviceInfo:
    return describe_device(device, 0) if device.type == "cuda" else DRY_RUN_HOST


def _emulator(spec: EmulationSpec, host: DeviceInfo, device: torch.device) -> Emulator:
    # No memory cap: the calibration times speed, and one process runs every preset (a cap set for a big card
    # would stay in force under the next, smaller one's).
    emulated = replace(resolve(spec, host), memory_bytes=None)
    emulator = Emulator(emulated, device, "nvlink")
    emulator.activate()
    return emulator


def sweep_counts(host_sms: int, step: int = 8) -> list[int]:
    """The SM counts a sweep measures: the whole GPU first, then multiples of ``step`` up from the smallest."""
    if step < 1:
        raise SystemExit(f"`--sms-step`={step} must be a positive SM count.")
    return [host_sms] + list(range(step, host_sms, step))


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cpu":
        torch.set_num_threads(1)  # dry runs side by side on a small machine
    return device


def cmd_sweep(args: argparse.Namespace) -> None:
    device = _device(args.device)
    host = _host(device)
    step, batch = build_step(args.workload, device, args.tiny, args.batch)
    points: dict[str, dict[str, float]] = {}
    began = time.perf_counter()
    counts = [args.only] if args.only else sweep_counts(host.multiprocessors, args.sms_step)
    path = None
    for sms in counts:
        if time.perf_counter() - began > args.time_cap:
            print(f"time cap {args.time_cap:.0f} s reached: {sms} SMs and fewer not measured", flush=True)
            break
        if args.fresh and not args.only:
            # cuDNN keeps the kernels it planned under another SM count, and ResNet-50's then fail
            # (CUDNN_STATUS_EXECUTION_FAILED at the first point after the whole GPU): one process per point.
            point = _point_in_child(args, sms)
            if point is None:
                continue
        else:
            emulator = _emulator(EmulationSpec(sm_share=sms / host.multiprocessors), host, device)
            small = sms <= 16  # slow points: fewer steps
            seconds = time_steps(emulator, step, device, warmup=2 if small else 3, timed=3 if small else 5)
            point = {"step_s": seconds, "samples_per_s": batch / seconds}
        points[str(sms)] = point
        print(f"{args.workload} {sms:4d} SMs  {point['step_s'] * 1e3:8.1f} ms/step  {point['samples_per_s']:9.1f} "
              "samples/s", flush=True)
        if args.only or str(host.multiprocessors) in points:
            # Written after every point: a run stopped from outside keeps what it measured.
            path = _write_sweep(args, host, batch, points, time.perf_counter() - began)
    print(f"wrote {path} ({time.perf_counter() - began:.0f} s)")


def _point_in_child(args: argparse.Namespace, sms: int) -> "dict[str, float] | None":
    """One SM count measured by a fresh process of this script (``sweep --only``)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, os.path.abspath(__file__), "sweep", "--workload", args.workload, "--out", folder,
                   "--device", args.device, "--only", str(sms), "--batch", str(args.batch)] + (["--tiny"] if args.tiny
                                                                                             else [])
        done = subprocess.run(command, capture_output=True, text=True)
        found = list(Path(folder).glob("point_*.json"))
        if done.returncode != 0 or not found:
            print(f"{args.workload} {sms:4d} SMs  failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}",
                  flush=True)
            return None
        return json.loads(found[0].read_text())


def _write_sweep(args: argparse.Namespace, host: DeviceInfo, batch: int, points: dict[str, dict[str, float]],
                 seconds: float) -> Path:
    if args.only:  # a child of `--fresh`: its one point, for the parent to read
        path = Path(args.out) / f"point_{args.only}.json"
        path.write_text(json.dumps(points[str(args.only)]))
        return path
    full = points[str(host.multiprocessors)]["samples_per_s"]
    relative = {s: p["samples_per_s"] / full for s, p in points.items()}
    synthetic = host is DRY_RUN_HOST
    if synthetic:  # no SMs to cap on CPU: a made-up curve, so that `fit` and `validate` have one to run on
        relative = {s: (int(s) / host.multiprocessors) ** _DRY_RUN_EXPONENTS[args.workload] for s in points}
    out = {"workload": args.workload, "host": host.name, "host_sms": host.multiprocessors, "batch": batch,
           "synthetic": synthetic, "points": points, "relative": relative, "seconds": seconds}
    path = Path(args.out) / f"sweep_{args.workload}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return path


def cmd_fit(args: argparse.Namespace) -> None:
    sweeps = [json.loads(p.read_text()) for p in sorted(Path(args.sweeps).glob("sweep_*.json"))]
    if not sweeps:
        raise SystemExit(f"no sweep_*.json in {args.sweeps}: run `sweep` first.")
    hosts = {(s["host"], s["host_sms"]) for s in sweeps}
    if len(hosts) != 1:
        raise SystemExit(f"the sweeps come from different hosts {sorted(hosts)}: fit one host at a time.")
    host, host_sms = hosts.pop()
    curves = {s["workload"]: {int(k): float(v) for k, v in s["relative"].items()} for s in sweeps}
    table = fit_calibration(host, host_sms, curves)
    out = {**table.as_dict(), "synthetic": any(s["synthetic"] for s in sweeps),
           "sweeps": {s["workload"]: s["points"] for s in sweeps}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    workloads = [w for w in WORKLOADS if w in curves]
    synthetic = "  [SYNTHETIC dry run]" if out["synthetic"] else ""
    print(f"calibration of {host} ({host_sms} SMs) -> {args.out}{synthetic}")
    head = "".join(f" {'target ' + w:>12} {'curve':>6} {'d_' + w:>7}" for w in workloads)
    print(f"{'preset':<10} {'SMs':>4} {'d':>6} {'worst':>6}" + head)
    for preset, knob in table.presets:
        cells = "".join(f" {target_speed(preset, w):12.3f} {curves[w][knob.sms]:6.3f} {knob.dilation(w):7.2f}"
                        for w in workloads)
        print(f"{preset:<10} {knob.sms:4d} {knob.default:6.2f} {math.expm1(knob.worst_error) * 100:5.1f}%" + cells)


def cmd_validate(args: argparse.Namespace) -> None:
    os.environ[CALIBRATION_ENV] = str(Path(args.calibration).resolve())
    device = _device(args.device)
    host = _host(device)
    if load_calibration(host.name) is None:
        raise SystemExit(f"{args.calibration} cannot be read")
    step, batch = build_step(args.workload, device, args.tiny, args.batch)
    workload = None if args.knob == "default" else args.workload
    presets = [REFERENCE] + [p for p in PUBLISHED if p != REFERENCE]
    rows: dict[str, dict[str, Any]] = {}
    began = time.perf_counter()
    for preset in presets:
        if time.perf_counter() - began > args.time_cap:
            print(f"time cap {args.time_cap:.0f} s reached: {preset} and later presets not measured", flush=True)
            break
        emulator = _emulator(EmulationSpec(preset=preset, workload=workload), host, device)
        seconds = time_steps(emulator, step, device, warmup=args.warmup, timed=args.steps)
        rows[preset] = {"samples_per_s": batch / seconds, "sms": emulator.device.num_sms or host.multiprocessors,
                        "dilation": emulator.device.dilation, "calibration": emulator.device.calibration,
                        "compute_s": emulator.compute_seconds, "dilated_s": emulator.slept_seconds}
        row = rows[preset]
        row["emulated_ratio"] = row["samples_per_s"] / rows[REFERENCE]["samples_per_s"]
        row["published_ratio"] = training_speed(preset, args.workload)
        row["error"] = row["emulated_ratio"] / row["published_ratio"] - 1.0
        print(f"{preset} {row['samples_per_s']:.1f} samples/s ({emulator.summary()})", flush=True)
        out = {"workload": args.workload, "knob": args.knob, "host": host.name, "calibration": args.calibration,
               "dry_run": device.type != "cuda", "rows": rows, "seconds": time.perf_counter() - began}
        path = Path(args.out) / f"validate_{args.workload}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))  # after every preset: a run stopped from outside keeps them
    print_validation([out])


def print_validation(results: list[dict[str, Any]]) -> None:
    print(f"{'workload':<8} {'preset':<10} {'SMs':>4} {'d':>5} {'samples/s':>10} {'emulated':>9} {'published':>9} "
          f"{'error':>7}  knob")
    for result in results:
        for preset, row in result["rows"].items():
            print(f"{result['workload']:<8} {preset:<10} {row['sms']:4d} {row['dilation']:5.2f} "
                  f"{row['samples_per_s']:10.1f} {row['emulated_ratio']:9.3f} {row['published_ratio']:9.3f} "
                  f"{row['error'] * 100:6.1f}%  {row['calibration']}")


def cmd_report(args: argparse.Namespace) -> None:
    results = [json.loads(p.read_text()) for p in sorted(Path(args.validations).glob("validate_*.json"))]
    if not results:
        raise SystemExit(f"no validate_*.json in {args.validations}: run `validate` first.")
    Path(args.out).write_text(json.dumps({r["workload"]: r for r in results}, indent=1))
    errors = [abs(row["error"]) for r in results for row in r["rows"].values()]
    print_validation(results)
    print(f"worst |error| {max(errors) * 100:.1f}%, median {sorted(errors)[len(errors) // 2] * 100:.1f}% "
          f"over {len(errors)} preset x workload pairs -> {args.out}")


def main(argv: "list[str] | None" = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("sweep", "validate"):
        p = sub.add_parser(name)
        p.add_argument("--workload", choices=WORKLOADS, required=True)
        p.add_argument("--out", required=True, help="folder for sweep_<workload>.json / validate_<workload>.json")
        p.add_argument("--device", default="cuda", help="'cuda' (the visible GPU) or 'cpu' (a dry run)")
        p.add_argument("--tiny", action="store_true", help="tiny shapes (dry runs)")
        p.add_argument("--time-cap", type=float, default=130.0, help="stop starting new points after this many s")
    for name in ("sweep", "validate"):
        sub.choices[name].add_argument("--batch", type=int, default=0,
                                       help="samples per step (0: the workload's GPU-bound batch)")
    sub.choices["sweep"].add_argument("--fresh", action="store_true", help="each SM count in a fresh process")
    sub.choices["sweep"].add_argument("--only", type=int, default=0, help=argparse.SUPPRESS)
    sub.choices["sweep"].add_argument("--sms-step", type=int, default=8,
                                      help="SM counts measured: multiples of this (8: the granularity on 9.x)")
    sub.choices["validate"].add_argument("--calibration", required=True, help="the file `fit` wrote")
    sub.choices["validate"].add_argument("--knob", choices=("workload", "default"), default="workload",
                                         help="the workload's own dilation (the profile names it) or the default")
    sub.choices["validate"].add_argument("--warmup", type=int, default=4)
    sub.choices["validate"].add_argument("--steps", type=int, default=6)
    fit = sub.add_parser("fit")
    fit.add_argument("--sweeps", required=True, help="folder with sweep_<workload>.json files")
    fit.add_argument("--out", required=True, help="the calibration JSON to write")
    report = sub.add_parser("report")
    report.add_argument("--validations", required=True, help="folder with validate_<workload>.json files")
    report.add_argument("--out", required=True, help="the combined JSON to write")
    args = parser.parse_args(argv)
    {"sweep": cmd_sweep, "fit": cmd_fit, "validate": cmd_validate, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
