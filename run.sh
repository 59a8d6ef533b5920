#!/usr/bin/env bash
# The two commands of the README:
#   bash run.sh demo   # trains the digits example on whatever is here (GPUs, or CPU processes emulating a lab)
#   bash run.sh test   # runs the test suite (GPU tests are skipped without GPUs)
# Both install what they need into the current Python (use a virtualenv if you like) when it is missing.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

ensure_installed() {
    if ! "$PY" -c "import torch" 2>/dev/null; then
        # A pinned torch: on machines without GPUs this is the CPU wheel; pip picks the CUDA build elsewhere.
        "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
    fi
    if ! "$PY" -c "import lightning_hetero, lightning, jsonargparse, sklearn, pytest, matplotlib" 2>/dev/null; then
        "$PY" -m pip install -q -e ".[test,examples,plots]"
    fi
}

case "${1:-}" in
    demo)
        ensure_installed
        shift
        exec "$PY" examples/train_digits.py "$@"
        ;;
    test)
        ensure_installed
        shift
        exec "$PY" -m pytest -q "$@"
        ;;
    *)
        echo "usage: bash run.sh demo|test [extra args]" >&2
        exit 2
        ;;
esac
