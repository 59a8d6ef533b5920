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


@pytest.mark.slow
def test_demo_splits_a_3x_slower_rank_about_3_to_1(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "fit",
           "--config", os.path.join(ROOT, "configs", "cpu_lab.yaml"),
           "--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=0",
           "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "slowdown 3.00x" in output
    rows = lab_rows(output)
    assert [r["rank"] for r in rows] == ["0", "1"]
    fast, slow = int(rows[0]["batch"]), int(rows[1]["batch"])
    print(f"\ndemo split: {fast}/{slow}; samples/s {rows[0]['samples/s']} / {rows[1]['samples/s']}")
    assert fast + slow == 64
    # 3:1 is 48/16 (the old profiler gave 63/1). Measured on a 2-core VM: 48/16 in 7 of 9 runs of the demo, 46/18 and
    # 49/15 in the others; profiled ratios 3.07-3.36 in 10 runs beside busy loops, 2.1-2.5 in 3 of 5 beside a
    # co-tenant multiplying matrices on both cores (it slows the fast rank, which the profile rightly sees). The band
    # is a profiled ratio between 2.2 and 3.9.
    assert 13 <= slow <= 20, (fast, slow)
    # The demo leaves a monitor file, and the report command right after it draws it (it failed with a traceback).
    assert glob.glob(os.path.join(tmp_path, "**", "hetero_monitor.jsonl"), recursive=True), output[-3000:]
    report = subprocess.run([sys.executable, "-m", "lightning_hetero", "report", str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert glob.glob(os.path.join(tmp_path, "**", "hetero_monitor.png"), recursive=True)
