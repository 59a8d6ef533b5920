"""Which part of the exact phase of ``fsdp_shared_worker.py`` crashes: the phase run once per variant, each variant a
fresh pair of processes with some of its parts switched off (the worker's ``KNOBS``), and what became of each rank.

Per variant: the return codes, the seconds, the last mark each rank's log reached (``fit 2: start``, a Lightning hook
with ``trace``), each rank's crash report (torch's fatal-signal handler: every thread's C++ stack; then
``faulthandler``: every thread's Python stack) with the crashed thread's innermost frames, the tail of each log and,
where both fits ran to the end, the parameters against one process. A crash that goes away
under a variant points at what that variant switched off. The variants run most informative first and stop before
``--budget`` seconds; each has ``--timeout`` seconds.

    python tests/gpu/fsdp_shared_bisect.py --out DIR                     # one GPU, both ranks on it
    python tests/gpu/fsdp_shared_bisect.py --out DIR --accelerator cpu   # a dry run with gloo on the host

``DIR`` gets ``fsdp_shared_bisect.json`` (everything), ``fsdp_shared_bisect.txt`` (the table, then every crash
report) and the first variant's two logs whole; the runs themselves go to ``--work`` (a temporary directory unless
given). The table is printed last.
"""

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_shared_worker import KNOBS, check_knobs, exact_reference, launch  # noqa: E402

# A variant is one or more launches, each a set of knobs ("split": the two fits in two pairs of processes, the
# second resuming from the first one's checkpoint). Every launch also traces the hooks.
VARIANTS: dict[str, list[tuple[str, ...]]] = {
    "base": [()],
    "no-measure": [("no-measure",)],
    "measure-fit1": [("measure-fit1",)],
    "no-preempt": [("no-preempt",)],
    "fit1-only": [("fit1-only",)],
    "split": [("fit1-only",), ("fit2-only",)],
    "no-offload": [("no-offload",)],
    "no-checkpoint": [("no-checkpoint",)],
    "keep-sigterm-broadcast": [("keep-sigterm-broadcast",)],
    "no-state": [("no-state",)],
    "no-watchdog": [("no-watchdog",)],
    "no-measure+no-preempt": [("no-measure", "no-preempt")],
    # Not in the default list: a crash on purpose, to check on a host without the real one that crashes are caught.
    "self-check": [("segv-at-fit2",)],
}
DEFAULT = ("base", "no-measure", "measure-fit1", "no-preempt", "fit1-only", "split", "no-offload", "no-checkpoint",
           "keep-sigterm-broadcast", "no-state", "no-watchdog", "no-measure+no-preempt")
# Knobs after which no parameters of a whole 4-step resumed run are saved, or not those of one.
NO_REFERENCE = {"no-checkpoint", "fit1-only", "fit2-only", "no-state", "segv-at-fit2"}
SIGNALS = {-11: "SIGSEGV", -6: "SIGABRT", -9: "SIGKILL", -7: "SIGBUS", -4: "SIGILL", -15: "SIGTERM"}
MARK = re.compile(r"^\[worker rank \d+\] (.*)$")


def crash_report(log: str, lines: int = 80) -> Optional[str]:
    """The Python part of the crash report in a rank's log: from faulthandler's ``Fatal Python error`` (or Python's
    last ``Traceback``) to at most ``lines`` lines on, without faulthandler's list of extension modules; ``None`` when
    there is neither."""
    text = [line for line in log.splitlines() if not line.startswith("Extension modules:")]
    for marker in ("Fatal Python error", "Traceback (most recent call last)"):
        found = [i for i, line in enumerate(text) if line.startswith(marker)]
        if found:
            start = found[0] if marker.startswith("Fatal") else found[-1]
            return "\n".join(text[start:start + lines])
    return None


NATIVE_HEADER = re.compile(r"^(SIG[A-Z]+)\((\d+)\), PID: \d+, Thread \d+:")
NATIVE_FRAME = re.compile(r"^\s*frame #\d+: (.*?)(?: \+ 0x[0-9a-f]+)? \((?:0x[0-9a-f]+ in )?(.*)\)$")


def native_report(log: str, lines: int = 120) -> Optional[str]:
    """torch's fatal-signal report in a rank's log (every thread's C++ stack, the crashed thread first), at most
    ``lines`` lines; ``None`` when there is none."""
    text = log.splitlines()
    found = [i for i, line in enumerate(text) if NATIVE_HEADER.match(line)]
    if not found:
        return None
    end = next((i for i in range(found[0], len(text)) if text[i].startswith("Fatal Python error")), len(text))
    return "\n".join(text[found[0]:min(end, found[0] + lines)])


def _signal_in(report: Optional[str]) -> Optional[str]:
    match = NATIVE_HEADER.match(report or "")
    return match.group(1) if match else None


def native_frames(report: Optional[str], count: int = 4) -> Optional[str]:
    """The crashed thread's innermost ``count`` native frames below the signal handler, as ``function (library)``,
    innermost first."""
    if not report:
        return None
    frames = []
    for line in report.splitlines()[1:]:
        if NATIVE_HEADER.match(line):
            break  # the next thread
        match = NATIVE_FRAME.match(line)
        if match:
            frames.append((match.group(1), os.path.basename(match.group(2))))
    # Below torch's handler: its own two frames, then the kernel's signal trampoline (in libc).
    handler = max((i for i, (function, _) in enumerate(frames) if "FatalSignalHandler" in function), default=-1)
    below = frames[handler + 2:] if handler >= 0 else frames
    return " < ".join(f"{'?' if function.startswith('<unknown') else function} ({library})"
                      for function, library in below[:count]) or None


def _frame(line: str) -> str:
    """``File "/a/b/c.py", line 3 in f`` (faulthandler) or ``..., line 3, in f`` (a traceback) as ``b/c.py:3 in f``."""
    match = re.match(r'File "(.*)", line (\d+),? in (.*)', line.strip())
    if not match:
        return line.strip()
    path, number, function = match.groups()
    return f"{'/'.join(path.split('/')[-2:])}:{number} in {function}"


def crash_frame(report: Optional[str]) -> Optional[str]:
    """Where the crash happened, in one line: the innermost Python frame of the thread that crashed (faulthandler
    prints that thread as ``Current thread``, innermost frame first); a thread with no Python frame (a native one:
    gloo's, CUDA's) is said so, with where the main thread was. For a traceback, its innermost (last) frame."""
    if not report:
        return None
    lines = report.splitlines()
    if not report.startswith("Fatal"):
        frames = [line for line in lines if line.strip().startswith("File ")]
        return _frame(frames[-1]) if frames else None
    blocks: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith(("Current thread", "Thread 0x")):
            blocks.append((line, []))
        elif blocks and line.strip().startswith("File "):
            blocks[-1][1].append(line)
    current = next((frames for header, frames in blocks if header.startswith("Current thread")), None)
    if current:
        return _innermost(current)
    # The main thread's stack ends in the script's <module>.
    main = next((frames for _, frames in blocks if frames and frames[-1].strip().endswith("<module>")), None)
    return "a thread with no Python frame" + (f"; main thread at {_innermost(main)}" if main else "")


def _innermost(frames: list[str]) -> str:
    """The innermost frame (faulthandler's first), and the innermost of the package's own when that is another."""
    ours = next((f for f in frames if "lightning_hetero/" in f), None)
    return _frame(frames[0]) + (f" (lightning_hetero: {_frame(ours)})" if ours and ours != frames[0] else "")


def last_mark(log: str) -> Optional[str]:
    marks = [m.group(1) for m in map(MARK.match, log.splitlines()) if m]
    return marks[-1] if marks else None


def run_variant(name: str, work: str, accelerator: str, timeout: float, wrap: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every launch of variant ``name`` in ``work``/``name``, one after the other while they succeed."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    launches: list[dict[str, Any]] = []
    start = time.perf_counter()
    for index, knobs in enumerate(VARIANTS[name]):
        # The second launch of a split run reads the first one's checkpoint, and writes its logs beside it.
        directory = os.path.join(out, str(index))
        ckpt_dir = os.path.join(out, "0", "exact_ckpt")
        began = time.perf_counter()
        result = launch("exact", directory, accelerator, timeout=timeout, knobs=("trace", *knobs), ckpt_dir=ckpt_dir,
                        wrap=wrap)
        logs = []
        for rank in range(2):
            with open(os.path.join(directory, f"exact_rank{rank}.log"), errors="replace") as f:
                logs.append(f.read())
        reports, natives = [crash_report(log) for log in logs], [native_report(log) for log in logs]
        entry = {
            "knobs": list(knobs), "returncodes": result["returncodes"], "seconds": time.perf_counter() - began,
            "last_mark": [last_mark(log) for log in logs], "crash_frame": [crash_frame(r) for r in reports],
            "native_frames": [native_frames(r) for r in natives], "crash_report": reports, "native_report": natives,
            # The signal a rank's handler reported, also where the handler then hung and the launch killed the rank.
            "signal_in_log": [_signal_in(r) for r in natives],
            "log_tail": ["\n".join(log.splitlines()[-40:]) for log in logs],
            "log_paths": [os.path.join(directory, f"exact_rank{rank}.log") for rank in range(2)],
        }
        if result["returncodes"] == [0, 0] and not NO_REFERENCE & set(knobs) and all(result["ranks"]):
            try:
                reference = exact_reference(directory, result["ranks"], accelerator)
                entry["max_rel_diff"] = reference["max_rel_diff"]
                entry["samples_per_step"] = reference["samples_per_step"]
            except Exception as err:  # noqa: BLE001 - a diagnosis: say it and go on with the next variant
                entry["reference_error"] = repr(err)[:300]
        launches.append(entry)
        if result["returncodes"] != [0, 0]:
            break
    planned = len(VARIANTS[name])
    return {"variant": name, "launches": launches, "seconds": time.perf_counter() - start, "planned": planned,
            "ok": all(e["returncodes"] == [0, 0] for e in launches) and len(launches) == planned}


def outcome(returncodes: list[Any], signals: Optional[list[Optional[str]]] = None) -> str:
    """``ok``, a signal's name or an exit code per rank (a name given already, as under gdb, stays); a rank killed
    after its log reported a signal (its handler hung) shows that signal, ``(killed)``."""
    signals = signals or [None] * len(returncodes)

    def one(code: Any, signal_name: Optional[str]) -> str:
        if code == 0:
            return "ok"
        if signal_name is not None and code in (None, -9):
            return f"{signal_name}(killed)"
        return "-" if code is None else code if isinstance(code, str) else SIGNALS.get(code, str(code))

    return "/".join(one(c, s) for c, s in zip(returncodes, signals))


def table(results: list[dict[str, Any]]) -> str:
    rows = [("variant", "ranks 0/1", "s", "last mark rank 0 | rank 1", "crash frame (rank 0)", "max rel diff")]
    for r in results:
        for index, e in enumerate(r["launches"]):
            label = r["variant"] + (f" [{index + 1}/{r['planned']}]" if r["planned"] > 1 else "")
            diff = e.get("max_rel_diff")
            rows.append((label, outcome(e["returncodes"], e.get("signal_in_log")), f"{e['seconds']:.0f}",
                         " | ".join(str(m) for m in e["last_mark"]), str(e["crash_frame"][0] or e["crash_frame"][1]),
                         "-" if diff is None else f"{diff:.2e}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> str:
    """Which variants crashed like the first one (by signal) and which did not."""
    if not results:
        return "no variant ran"
    last = results[0]["launches"][-1]
    first = last["returncodes"]
    if all(c == 0 for c in first):
        return f"{results[0]['variant']} did not fail here: nothing to bisect"
    compared = [r for r in results[1:] if not r.get("debugger")]
    cleared = [r["variant"] for r in compared if r["ok"]]
    failing = [r["variant"] for r in compared if not r["ok"]]
    return (f"{results[0]['variant']} failed ({outcome(first, last.get('signal_in_log'))}); passed with: "
            f"{', '.join(cleared) or 'none'}; still failing with: {', '.join(failing) or 'none'}")


def bisect(out: str, accelerator: str, variants: tuple[str, ...], budget: float, timeout: float,
           work: Optional[str] = None, gdb: bool = False) -> list[dict[str, Any]]:
    """Run ``variants`` in order within ``budget`` seconds; write the JSON, the text report and the first variant's
    logs into ``out``; return the results."""
    os.makedirs(out, exist_ok=True)
    work = work or tempfile.mkdtemp(prefix="fsdp_shared_bisect_")
    begin, results, skipped = time.perf_counter(), [], []
    for name in variants:
        # A variant runs only when one more of the longest so far (or the timeout, before any) still fits.
        longest = max((r["seconds"] / r["planned"] for r in results), default=timeout)
        if time.perf_counter() - begin + longest * len(VARIANTS[name]) > budget:
            skipped.append(name)
            continue
        results.append(run_variant(name, work, accelerator, timeout))
        _save(out, accelerator, results, skipped, work)
    debugger = shutil.which("gdb")
    if gdb and debugger and time.perf_counter() - begin + 2 * timeout <= budget:
        # The native stack of each crashed rank: gdb stops the process at the signal and prints every thread.
        wrap = (debugger, "-q", "-batch", "-ex", "set pagination off", "-ex", "set print thread-events off",
                "-ex", "set print inferior-events off", "-ex", "handle SIGPIPE nostop noprint", "-ex", "run",
                "-ex", "bt 40", "-ex", "thread apply all bt 12", "--args")
        entry = run_variant(variants[0], os.path.join(work, "gdb"), accelerator, 2 * timeout, wrap=wrap)
        entry["variant"], entry["debugger"] = f"{variants[0]} under gdb", True
        stacks = [_gdb_stacks(p) for p in entry["launches"][0]["log_paths"]]
        entry["gdb_stacks"] = [stack for stack, _ in stacks]
        # gdb itself exits 0: the signal each rank stopped at is the outcome.
        entry["launches"][0]["returncodes"] = [signal or code for (_, signal), code in
                                               zip(stacks, entry["launches"][0]["returncodes"])]
        results.append(entry)
    elif gdb:
        skipped.append(f"{variants[0]} under gdb" + ("" if debugger else " (no gdb on this machine)"))
    _save(out, accelerator, results, skipped, work)
    if results:
        for rank, path in enumerate(results[0]["launches"][0]["log_paths"]):
            shutil.copy(path, os.path.join(out, f"{results[0]['variant']}_rank{rank}.log"))
    return results


def _gdb_stacks(path: str, lines: int = 200) -> tuple[str, Optional[str]]:
    """gdb's report in a rank's log (from the signal it stopped at: the crashing thread's stack, then every
    thread's), and that signal's name (``None``: the rank ran to its end)."""
    with open(path, errors="replace") as f:
        text = f.read().splitlines()
    found = [i for i, line in enumerate(text) if "received signal" in line]
    if not found:
        return "\n".join(text[-20:]), None
    stopped = re.search(r"received signal (SIG[A-Z]+)", text[found[0]])
    return "\n".join(text[found[0]:found[0] + lines]), stopped.group(1) if stopped else "signal"


def _save(out: str, accelerator: str, results: list[dict[str, Any]], skipped: list[str], work: str) -> None:
    import torch

    info = {"accelerator": accelerator, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "work": work,
            "variants": {name: [list(k) for k in VARIANTS[name]] for name in VARIANTS}, "knobs": KNOBS,
            "skipped": skipped, "verdict": verdict(results), "results": results}
    with open(os.path.join(out, "fsdp_shared_bisect.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    reports = []
    for r in results:
        for index, e in enumerate(r["launches"]):
            for rank in range(2):
                if e["crash_report"][rank] or e["native_report"][rank]:
                    ended = outcome(e["returncodes"], e.get("signal_in_log"))
                    reports.append(f"== {r['variant']} launch {index + 1} rank {rank} ({ended})"
                                   f"\n{e['native_report'][rank] or ''}\n{e['crash_report'][rank] or ''}")
        for rank, stack in enumerate(r.get("gdb_stacks", [])):
            reports.append(f"== {r['variant']} rank {rank}: gdb\n{stack}")
    with open(os.path.join(out, "fsdp_shared_bisect.txt"), "w") as f:
        f.write(table(results) + "\n" + verdict(results) + "\n\n" + "\n\n".join(reports) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--variants", default=",".join(DEFAULT),
                        help=f"comma-separated, run in this order; known: {', '.join(VARIANTS)}")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all variants together")
    parser.add_argument("--timeout", type=float, default=75.0, help="seconds for one launch of a variant")
    parser.add_argument("--work", default=None, help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--gdb", action="store_true",
                        help="last, the first variant again with each rank under gdb (if installed): native stacks")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)})" if unknown else
                     "--variants: give at least one")
    for name in variants:
        for knobs in VARIANTS[name]:
            check_knobs(knobs)
    results = bisect(args.out, args.accelerator, variants, args.budget, args.timeout, args.work, args.gdb)
    for r in results[:1]:
        for index, e in enumerate(r["launches"]):
            for rank in range(2):
                if e["crash_report"][rank] or e["native_report"][rank]:
                    print(f"== {r['variant']} rank {rank}: native {e['native_frames'][rank]}; Python "
                          f"{e['crash_frame'][rank]}")
    skipped = json.load(open(os.path.join(args.out, "fsdp_shared_bisect.json")))["skipped"]
    if skipped:
        print(f"skipped (budget): {', '.join(skipped)}")
    print(table(results))
    print(verdict(results))
    return 0


if __name__ == "__main__":
    # Stopped by `timeout`: the running launch's clean-up kills its ranks (none is left on the GPU).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
