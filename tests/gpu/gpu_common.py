"""What the GPU tests share: each runs a worker script in a fresh process (its ranks spawn there) and reads its JSON."""

import json
import os
import subprocess
import sys
from typing import Any


def run_worker(script: str, tmp_path: Any, *args: str, timeout: float = 420) -> dict:
    """Run ``tests/gpu/<script>`` with ``--out tmp_path``; its ``result.json``, or a failure with its output."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    proc = subprocess.run([sys.executable, path, *args, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(str(tmp_path), "result.json")) as f:
        return json.load(f)
