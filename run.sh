#!/usr/bin/env bash
# The two commands of the README:
#   bash run.sh demo   # trains the digits example on whatever is here (GPUs, or CPU processes emulating a lab)
#   bash run.sh test   # runs the test suite (GPU tests are skipped without GPUs)
# and the one CI adds:
#   bash run.sh docs   # builds the documentation site in strict mode (installs the `docs` extra; not the others)
# Inside a virtual environment (or a conda environment) both install what is missing into it. Otherwise they create
# and reuse .venv here, since a system Python refuses pip installs (PEP 668, "externally-managed-environment").
# PYTHON=/path/to/python picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

in_environment() {
    "$PY" - <<'EOF'
import os, sys
conda = os.environ.get("CONDA_PREFIX")
in_conda = bool(conda) and os.path.realpath(sys.prefix) == os.path.realpath(conda)
sys.exit(0 if sys.prefix != sys.base_prefix or in_conda else 1)
EOF
}

select_python() {
    if in_environment; then
        return
    fi
    if [ ! -x .venv/bin/python ]; then
        echo "run.sh: creating a virtual environment in $(pwd)/.venv (reused next time; delete it to start over)" >&2
        if ! "$PY" -m venv .venv; then
            rm -rf .venv
            echo "run.sh: '$PY -m venv' failed. On Debian/Ubuntu install it with 'sudo apt install python3-venv'," \
                 "or activate a virtual environment of your own and run this again." >&2
            exit 1
        fi
    fi
    PY=.venv/bin/python
}

# ensure_installed [EXTRA IMPORT]: torch, this package with its usual extras, and optionally one more extra (whose
# module IMPORT tells whether it is there already).
ensure_installed() {
    select_python
    if ! "$PY" -c "import torch" 2>/dev/null; then
        # A pinned torch: on machines without GPUs this is the CPU wheel; pip picks the CUDA build elsewhere.
        "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
    fi
    local extras="test,examples,plots,rich"
    local imports="lightning_hetero, lightning, jsonargparse, sklearn, pytest, matplotlib, rich"
    if command -v nvidia-smi >/dev/null 2>&1; then
        extras="$extras,monitor"  # NVML readings (utilisation, power, temperature, clocks) for the monitor
    fi
    if [ -n "${1:-}" ]; then
        extras="$extras,$1"
        imports="$imports, $2"
    fi
    if ! "$PY" -c "import $imports" 2>/dev/null || ! "$PY" -m pip show -q lightning-hetero >/dev/null 2>&1; then
        "$PY" -m pip install -q -e ".[$extras]"
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
    docs)
        ensure_installed docs "mkdocs, material, mkdocstrings_handlers.python"
        shift
        exec "$PY" -m mkdocs build --strict "$@"
        ;;
    *)
        echo "usage: bash run.sh demo|test|docs [extra args]" >&2
        exit 2
        ;;
esac
