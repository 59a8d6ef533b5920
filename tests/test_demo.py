"""The demo as a new user runs it: ``examples/train_digits.py`` on ``configs/cpu_lab.yaml`` (two CPU ranks, rank 1
emulated 3x slower, capacities measured on the model). The lab table it prints must split the batch about 3:1."""

import glob
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import free_port

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))


def lab_rows(output: str) -> list[dict[str, str]]:
    """The rows of the last lab table printed (columns are separated by two or more spaces)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("rank  host")]
    assert starts, output[-3000:]
    header = re.split(r"\s{2,}", lines[starts[-1]].strip())
    rows = []
    for line in lines[starts[-1] + 2:]:
        if not re.match(r"^\d+\s", line):
            break
        rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()))))
    return rows


def run_demo(tmp_path, core: int) -> tuple[str, int, int]:
    """The demo's output and split (fast, slow), its two ranks on one core of this machine."""
    # A launcher's variables left in this process (LOCAL_RANK: "started from outside") would keep the demo from
    # starting its second rank.
    launched = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK", "RANK")
    env = {**{k: v for k, v in os.environ.items() if k not in launched}, "PYTHONPATH": ROOT,
           "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "fit",
           "--config", os.path.join(ROOT, "configs", "cpu_lab.yaml"),
           "--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=0",
           "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}",
           # A rank that never joins or a stuck collective ends with the strategy's own error naming the rank,
           # inside the run's time limit.
           "--trainer.strategy.init_args.resilience.timeout=90"]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                              preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    except subprocess.TimeoutExpired as err:  # what it printed until then (bytes: Python does not decode it)
        said = b"".join(out if isinstance(out, bytes) else out.encode() for out in (err.stdout, err.stderr) if out)
        pytest.fail(f"the demo outlasted {err.timeout} s:\n{said.decode(errors='replace')[-3000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "slowdown 3.00x" in output
    rows = lab_rows(output)
    assert [r["rank"] for r in rows] == ["0", "1"]
    fast, slow = int(rows[0]["batch"]), int(rows[1]["batch"])
    print(f"\ndemo split: {fast}/{slow}; samples/s {rows[0]['samples/s']} / {rows[1]['samples/s']}")
    assert fast + slow == 64
    return output, fast, slow


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the demo to one core (Linux)")
def test_demo_splits_a_3x_slower_rank_about_3_to_1(tmp_path) -> None:
    # 3:1 is 48/16 (the old profiler gave 63/1). The band is a profiled ratio between 2.2 and 3.9.
    # The two ranks share one core: the profile is the emulated 3x and the host's noise, and on the 2-core VMs the
    # two cores' speeds differ by up to 1.6x for seconds at a time (a single-threaded step timed alone on each core,
    # 2026-11-26), which moved unpinned splits from 38/26 to 57/7 (9 of 13 runs outside the band). Pinned, 9 of 12
    # runs were inside; a run outside is retried, three times at most, so only a split that stays wrong fails.
    core = min(os.sched_getaffinity(0))
    splits = []
    for attempt in range(4):
        root = tmp_path / f"run{attempt}"
        root.mkdir()
        output, fast, slow = run_demo(root, core)
        splits.append((fast, slow))
        if 13 <= slow <= 20:
            break
    assert 13 <= slow <= 20, splits
    # What a user reads: the emulation notice once and without a `setup.py:115:` prefix (a warning's file:line reads
    # as an error), none of Lightning's tips or advice that does not apply to an in-memory example, the monitor's notes
    said = output.splitlines()
    assert sum(line.startswith("HeteroDDPStrategy is EMULATING a mixed lab on CPU") for line in said) == 1, output
    prefixed = [line for line in said if re.match(r"^\S+\.py:\d+: ", line)]
    assert not prefixed, prefixed
    for noise in ("💡 Tip", "does not have many workers", "tensorboardX", "LeafSpec"):
        assert noise not in output, (noise, output[-3000:])
    assert "comm: the job's exposed communication" in output and "final metrics: {" in output
    # The demo leaves a monitor file, and the report command right after it draws it (it failed with a traceback).
    assert glob.glob(os.path.join(root, "**", "hetero_monitor.jsonl"), recursive=True), output[-3000:]
    report = subprocess.run([sys.executable, "-m", "lightning_hetero", "report", str(root)], cwd=root,
                            env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert glob.glob(os.path.join(root, "**", "hetero_monitor.png"), recursive=True)
