"""SIGTERM (pre-emption): every rank stops after the same step, writes the checkpoint and exits within 10 s, and the
same command run again ends with the parameters of an uninterrupted run.

Each job is ``tests/resilience/_preempt_worker.py`` in its own process group (2 CPU ranks, 0.1 s per step, ``resume="auto"``),
signalled from here once step 3 is done: the fork launcher's parent, one rank alone, the popen launcher's rank 0, or
the ``torchrun`` agent.
"""

import glob
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest
import torch

from tests.helpers import free_port, max_rel_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "resilience", "_preempt_worker.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
EXIT_BUDGET_S = 10.0  # from the signal to the last process gone (the checkpoint here takes well under 1 s)


def _command(out_dir: str, launcher: str) -> list[str]:
    if launcher in ("fork", "popen"):
        return [sys.executable, WORKER, out_dir, launcher]
    return [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), WORKER, out_dir, "torchrun"]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    # The process may exit between opening its stat file and reading it.
    except (FileNotFoundError, ProcessLookupError):
        return False


def _run(out_dir: str, launcher: str, target: Optional[str] = None) -> dict:
    """Run the job; with ``target`` ("parent" or "rank1"), SIGTERM it after step 3 and time the exits."""
    os.makedirs(out_dir, exist_ok=True)
    for stale in [*glob.glob(os.path.join(out_dir, "*.pid")), *glob.glob(os.path.join(out_dir, "*.exit")),
                  *glob.glob(os.path.join(out_dir, "rank?")), *glob.glob(os.path.join(out_dir, "started"))]:
        os.remove(stale)
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_PORT": str(free_port())}
    log = open(os.path.join(out_dir, "log.txt"), "a")  # noqa: SIM115 - the job writes to it; closed below
    proc = subprocess.Popen(_command(out_dir, launcher), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    result: dict = {"signalled_at": None}
    try:
        if target is not None:
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(out_dir, "started")) and time.time() < deadline:
                assert proc.poll() is None, _read(os.path.join(out_dir, "log.txt"))
                time.sleep(0.05)
            pid = proc.pid if target == "parent" else int(_read(os.path.join(out_dir, "rank1")))
            result["signalled_at"] = time.time()
            os.kill(pid, signal.SIGTERM)
            ranks = [int(_read(os.path.join(out_dir, f"rank{r}"))) for r in range(2)]
            while any(_alive(p) for p in ranks) and time.time() - result["signalled_at"] < 60:
                time.sleep(0.02)
            result["ranks_gone_after"] = time.time() - result["signalled_at"]
            exits = [float(_read(p)) for p in glob.glob(os.path.join(out_dir, "*.exit"))]
            result["exit_reached_after"] = max(exits, default=float("inf")) - result["signalled_at"]
        result["code"] = proc.wait(timeout=120)
        result["launcher_gone_after"] = time.time() - (result["signalled_at"] or time.time())
        pids = [int(os.path.basename(p)[:-4]) for p in glob.glob(os.path.join(out_dir, "*.pid"))]
        result["leftovers"] = [p for p in pids if _alive(p)]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing left behind, whatever happened
        except ProcessLookupError:
            pass
        log.close()
    result["log"] = _read(os.path.join(out_dir, "log.txt"))
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    out_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    assert _run(out_dir, "fork")["code"] == 0
    return torch.load(os.path.join(out_dir, "final.pt"))


def _assert_stopped_and_saved(job: dict, out_dir: str, parent_code: int) -> None:
    print({k: round(v, 2) for k, v in job.items() if k.endswith("_after")})  # with -s: the timings
    assert job["code"] == parent_code, job["log"]
    assert job["leftovers"] == [], job["log"]
    # Every rank's process is gone in time (most of it is the interpreter's own shutdown: the ranks reach `atexit`
    # a step and a save after the signal); the launcher follows.
    assert job["ranks_gone_after"] < EXIT_BUDGET_S, (job["ranks_gone_after"], job["exit_reached_after"], job["log"])
    assert job["launcher_gone_after"] < 30, job["log"]  # torchrun's own deadline before it SIGKILLs
    assert job["log"].count("received SIGTERM") >= 1 and "stopped after step" in job["log"], job["log"]
    assert not os.path.exists(os.path.join(out_dir, "final.pt"))  # the script did not go on as if training ended
    saved = torch.load(os.path.join(out_dir, "ckpts", "preempted.ckpt"), weights_only=False)
    assert 4 <= saved["global_step"] < 24  # stopped after the signal, before the end (2 epochs of 12 steps)


@pytest.mark.slow
@pytest.mark.parametrize("launcher, target", [("fork", "parent"), ("fork", "rank1"), ("popen", "parent")])
def test_sigterm_to_a_launcher_or_rank_stops_every_rank_and_resumes_exactly(uninterrupted, tmp_path, launcher, target):
    """The fork parent passes the signal on; a signal to one rank alone (rank 1, or the popen launcher's rank 0)
    stops the other at the same step too."""
    out_dir = str(tmp_path)
    job = _run(out_dir, launcher, target)
    _assert_stopped_and_saved(job, out_dir, parent_code=128 + signal.SIGTERM)
    if launcher == "fork" and target == "parent":
        again = _run(out_dir, "fork")
        assert again["code"] == 0 and "going on from" in again["log"] and "preempted.ckpt" in again["log"]
        assert max_rel_diff(torch.load(os.path.join(out_dir, "final.pt")), uninterrupted) <= 1e-6


@pytest.mark.slow
def test_sigterm_to_torchrun_agent_stops_every_rank_and_resumes_exactly(uninterrupted, tmp_path):
    out_dir = str(tmp_path)
    job = _run(out_dir, "torchrun", "parent")
    _assert_stopped_and_saved(job, out_dir, parent_code=1)  # the agent itself ends with torchrun's SignalException
    assert job["log"].count("received SIGTERM") == 2  # torchrun passed it to both ranks; both stopped in time
    again = _run(out_dir, "torchrun")
    assert again["code"] == 0 and "going on from" in again["log"]
    assert max_rel_diff(torch.load(os.path.join(out_dir, "final.pt")), uninterrupted) <= 1e-6


class _Trainer:
    """What the handler reads of a one-process trainer, and the saves it asks for."""

    def __init__(self, environment: object, checkpoint_dir: str) -> None:
        from types import SimpleNamespace

        self.strategy = SimpleNamespace(cluster_environment=environment, root_device=torch.device("cpu"))
        self.checkpoint_callbacks = [SimpleNamespace(dirpath=checkpoint_dir)]
        self.global_step, self.global_rank, self.world_size, self.is_global_zero = 0, 0, 1, True
        self.saved: list[str] = []

    def save_checkpoint(self, path: str) -> None:
        self.saved.append(path)


def _steps(handler: object, trainer: _Trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.global_step += 1
        handler.on_train_batch_end(trainer, None, None, None, 0)
        handler.on_train_batch_end(trainer, None, None, None, 0)  # an accumulating batch: no new step, no check


def test_a_signal_stops_at_the_next_step_saves_and_exits_with_its_code(tmp_path):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_hetero.resilience.preemption import Preempted, PreemptionHandler

    stopped = []
    handler = PreemptionHandler(before_stop=lambda: stopped.append(True))
    trainer = _Trainer(LightningEnvironment(), str(tmp_path))
    previous = signal.getsignal(signal.SIGTERM)
    handler.on_train_start(trainer, None)
    try:
        _steps(handler, trainer, 3)  # no signal: nothing happens
        os.kill(os.getpid(), signal.SIGTERM)  # handled: this process goes on
        with pytest.raises(Preempted) as err:
            _steps(handler, trainer, 1)
    finally:
        handler.uninstall()
    assert err.value.code == 128 + signal.SIGTERM and trainer.global_step == 4
    assert stopped == [True] and trainer.saved == [os.path.join(str(tmp_path), "preempted.ckpt")]
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler before it is back
    resume_dir = PreemptionHandler(resume=str(tmp_path / "r"))  # `resume=<dir>`: the checkpoint goes there
    assert resume_dir.checkpoint_path(trainer) == str(tmp_path / "r" / "preempted.ckpt")
    trainer.checkpoint_callbacks = []
    assert PreemptionHandler(resume="auto").checkpoint_path(trainer) is None  # nowhere asked for: no checkpoint


def test_the_slurm_requeue_signal_requeues_through_lightning(tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_hetero.resilience import preemption

    requeued = []
    monkeypatch.setattr(preemption, "slurm_requeue", lambda trainer, signum: requeued.append(signum))
    environment = SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR2)
    assert preemption.stop_signals(environment) == (signal.SIGTERM, signal.SIGUSR2)
    assert preemption.stop_signals(SLURMEnvironment(auto_requeue=False)) == (signal.SIGTERM,)
    handler = preemption.PreemptionHandler()
    trainer = _Trainer(environment, str(tmp_path))
    handler.on_train_start(trainer, None)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # the requeue signal came first: it wins
        with pytest.raises(preemption.Preempted) as err:
            _steps(handler, trainer, 1)
    finally:
        handler.uninstall()
    assert err.value.code == 128 + signal.SIGUSR2
    assert requeued == [signal.SIGUSR2] and trainer.saved == []  # Lightning's requeue writes its HPC checkpoint


def test_the_launching_process_forwards_and_its_forked_ranks_do_not_inherit_it(monkeypatch):
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_hetero.resilience import preemption
    from lightning_hetero.resilience.preemption import Preempted, forwarding_signals

    killed = []
    launcher = SimpleNamespace(_strategy=SimpleNamespace(cluster_environment=LightningEnvironment()),
                               kill=killed.append)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as err, forwarding_signals(launcher):
        os.kill(os.getpid(), signal.SIGTERM)  # passed on to the ranks, not the end of this process
        pid = os.fork()
        if pid == 0:  # a rank as the fork launcher starts it: SIGTERM as before the launch
            os._exit(0 if signal.getsignal(signal.SIGTERM) == before else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        raise torch.multiprocessing.ProcessExitedException("rank 0 exited", 0, 1, 128 + signal.SIGTERM)
    assert killed == [signal.SIGTERM] and err.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    monkeypatch.setattr(preemption, "FORWARD_DEADLINE_S", 0.2)
    killed.clear()
    with forwarding_signals(launcher):  # ranks that do not stop in time are killed
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    assert killed == [signal.SIGTERM, signal.SIGKILL]


def test_with_several_ranks_the_stop_is_read_one_step_later(tmp_path):
    """The notes are all-reduced after every optimizer step and read after the next one, so the host never waits for
    the step it just queued (on CUDA a read of this step's notes would wait for the whole step)."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_hetero.resilience.preemption import Preempted, PreemptionHandler
    from tests.helpers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    handler = PreemptionHandler()
    trainer = _Trainer(LightningEnvironment(), str(tmp_path))
    trainer.world_size = 2  # the agreement's path: a collective (over this one process's group)
    handler.on_train_start(trainer, None)
    try:
        _steps(handler, trainer, 2)
        os.kill(os.getpid(), signal.SIGTERM)
        _steps(handler, trainer, 1)  # the signal's step: its notes are queued, not read
        with pytest.raises(Preempted):
            _steps(handler, trainer, 1)
    finally:
        handler.uninstall()
        dist.destroy_process_group()
    assert trainer.global_step == 4 and trainer.saved == [os.path.join(str(tmp_path), "preempted.ckpt")]


def test_lightnings_per_step_sigterm_broadcast_is_off_while_the_handler_owns_sigterm(tmp_path):
    """Lightning broadcasts its SIGTERM flag from the device before every batch and reads it back (a host wait for
    the GPU per step); with its SIGTERM handler replaced the flag cannot be set, so the broadcast is skipped, and put
    back when the handler is uninstalled."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_hetero.resilience.preemption import PreemptionHandler

    calls = []

    class EpochLoop:
        def _broadcast_sigterm_tensor(self) -> None:
            calls.append("broadcast")

    trainer = _Trainer(LightningEnvironment(), str(tmp_path))
    trainer.world_size = 2
    trainer.fit_loop = SimpleNamespace(epoch_loop=EpochLoop())
    handler = PreemptionHandler()
    handler.on_train_start(trainer, None)
    try:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        assert calls == []
    finally:
        handler.teardown(trainer, None, "fit")
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == ["broadcast"]
