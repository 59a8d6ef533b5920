"""The demo as a new user runs it: ``examples/train_digits.py`` on ``configs/cpu_lab.yaml`` (two CPU ranks, rank 1
emulated 3x slower, capacities measured on the model). The lab table it prints must split the batch about 3:1."""

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
           f"--trainer.default_root_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "slowdown 3.00x" in output
    rows = lab_rows(output)
    assert [r["rank"] for r in rows] == ["0", "1"]
    fast, slow = int(rows[0]["batch"]), int(rows[1]["batch"])
    print(f"\ndemo split: {fast}/{slow}; samples/s {rows[0]['samples/s']} / {rows[1]['samples/s']}")
    assert fast + slow == 64
    # 3:1 is 48/16. The old profiler gave 63/1. Sub-millisecond steps on a 2-core VM still scatter the profiled ratio:
    # 42/22 to 54/10 were seen in repeated runs of this configuration, so the band is that wide.
    assert 9 <= slow <= 24, (fast, slow)
