"""Ranks started together (``lightning_hetero.rehearse.launch``): one that ended leaves the others a grace period, not
the process group's half hour."""

import subprocess
import sys
import time

from lightning_hetero.rehearse import launch
from lightning_hetero.rehearse.job import RankJob


def test_ranks_still_running_after_one_ended_are_stopped_after_the_grace(monkeypatch):
    monkeypatch.setattr(launch, "TOGETHER_GRACE_S", 0.5)
    jobs = [RankJob("job.yaml", "shared", r, ["A100-80GB", "RTX3090"], 4, f"rank{r}.json") for r in range(2)]
    # Rank 0 ended at once (its rendezvous failed); rank 1 waits for it.
    processes = [subprocess.Popen([sys.executable, "-c", "pass"]),
                 subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    started = time.monotonic()
    try:
        stopped = launch._wait_together(processes, jobs, timeout=60)
    finally:
        processes[1].kill()
        processes[1].wait()
    assert stopped == "still running 0.5 s after rank 0 ended: stopped" and time.monotonic() - started < 30
    # Every one ended: nothing stopped; none ends in time: the timeout.
    assert launch._wait_together([subprocess.Popen([sys.executable, "-c", "pass"])], jobs[:1], timeout=60) is None
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert launch._wait_together([sleeper], jobs[:1], timeout=0.3) == "timed out after 0.3 s"
    finally:
        sleeper.kill()
        sleeper.wait()

