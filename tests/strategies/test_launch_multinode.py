"""The multi-host launch recipes of docs/several-machines.md, run as written on CPU (gloo) on one machine.

- torchrun on each host, hosts with unequal process counts (2 + 1), configs/two_hosts_cpu.yaml (emulated hosts);
- SLURM: the environment ``srun --nodes 2 --ntasks-per-node 1`` gives each task, read by Lightning's
  SLURMEnvironment; each task's host name set as two machines would report it.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "train_digits.py")
CONFIG = os.path.join(ROOT, "configs", "two_hosts_cpu.yaml")
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


def _env(**extra: str) -> dict:
    drop = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


def _run_all(commands: list[tuple[list[str], dict]], cwd: str, timeout: float = 240) -> list[tuple[int, str]]:
    procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in commands]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_torchrun_two_hosts_with_two_and_one_processes(tmp_path):
    port = str(free_port())
    commands = [
        ([TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-addr",
          "127.0.0.1", "--master-port", port, TRAIN, "fit", "--config", CONFIG], _env())
        for node, nproc in ((0, 2), (1, 1))
    ]
    (code0, out0), (code1, out1) = _run_all(commands, str(tmp_path))
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    assert "Starting with 3 processes" in out0
    table = out0[out0.index("HeteroDDPStrategy lab:"):]
    assert "2 host(s)" in table
    rows = [line.split() for line in table.splitlines()[3:6]]
    assert [row[1] for row in rows] == ["server", "server", "ws"]
    assert "compression='auto'" in out0 and "hierarchical" in out0  # chosen, two-level across the hosts
    accuracy = float(re.search(r"'val_acc': ([0-9.]+)", out0).group(1))
    assert accuracy > 0.5


@pytest.mark.slow
def test_slurm_two_nodes_one_task_each(tmp_path):
    port = str(free_port())
    common = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="2", SLURM_JOB_NODELIST="127.0.0.1",
                  SLURM_NODELIST="127.0.0.1", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train_digits", SLURM_LOCALID="0",
                  MASTER_PORT=port)
    commands = [
        ([sys.executable, TRAIN, "fit", "--config", CONFIG, "--trainer.strategy.init_args.emulate=null",
          "--trainer.limit_train_batches=8"],
         _env(**common, SLURM_PROCID=str(node), SLURM_NODEID=str(node), LIGHTNING_HETERO_HOST=f"node{node}"))
        for node in range(2)
    ]
    (code0, out0), (code1, out1) = _run_all(commands, str(tmp_path))
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    assert "Starting with 2 processes" in out0
    assert "2 host(s)" in out0 and "compression='auto'" in out0
    assert "final metrics:" in out0
