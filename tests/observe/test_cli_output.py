"""What a person reads in a log: a bad argument is one line, not a traceback per rank. (The demo's monitor file and
the report drawn from it: tests/test_demo.py.)"""

import os
import subprocess
import sys

import pytest

from lightning_hetero.observe.errors import user_message
from tests.helpers import free_port

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
DEMO = [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "fit", "--config",
        os.path.join(ROOT, "configs", "cpu_lab.yaml")]


def _run(args: list, cwd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_user_message_of_a_jsonargparse_union_error():
    error = ValueError("Does not validate against any of the Union subtypes\nSubtypes: [<class 'str'>, ...]\n"
                       "Errors:\n  - Expected a <class 'str'>\n  - `rebalance_every`=0 must be a positive number of "
                       "batches.\nGiven value type: <class 'jsonargparse._namespace.Namespace'>")
    assert user_message(error) == "`rebalance_every`=0 must be a positive number of batches."
    assert user_message(ValueError("first\n  second")) == "first second"


@pytest.mark.slow
@pytest.mark.parametrize(("argument", "message", "most"), [
    # refused when the strategy is built, before any rank starts
    ("--trainer.strategy.init_args.rebalance_every=0", "`rebalance_every`=0 must be a positive number of batches.", 1),
    # refused at setup, on both ranks: the watchdog's line (once for both) and the error
    ("--trainer.strategy.init_args.capacities=[1,2,3]", "`capacities` has 3 weights but the job has 2 ranks", 2),
])
def test_a_bad_argument_is_said_once_without_traceback(tmp_path, argument, message, most):
    proc = _run(DEMO + [argument, "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}"], str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text[-3000:]
    assert f"train_digits.py: error: {message}" in proc.stderr
    assert 1 <= text.count(message) <= most, text  # it was 6 to 8 times in 58 to 98 lines
