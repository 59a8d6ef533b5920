"""Host cost of timing a pipeline stage (HeteroMonitor's StageTimer), per timed piece of a schedule step.

    python benchmarks/stage_timer_cost.py [--n 200000]

Times, on the CPU clock the monitor uses there (``perf_counter``), each kind of piece a stage step records: a
micro-batch's work through the stage wrapper, a post of send/recv operations, a wait on one of their works; and
the replay of a 40-piece step into its fields on a logging step. A stage step of ``m`` micro-batches on a 2-stage
pipeline records about 6 m pieces (stage 0: m forwards, m backwards, 2 m posts, 2 m waits; the last stage also m
losses).
"""

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from lightning_hetero._compat import _around_work, _TimedWork  # noqa: E402
from lightning_hetero.observe.stage_times import StageTimer, stage_fields  # noqa: E402


class _Done:
    def wait(self) -> bool:
        return True


def per_call_us(call, n: int) -> float:
    begin = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - begin) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200000)
    n = parser.parse_args().n
    timer = StageTimer(time.perf_counter, lambda event: None)
    timer.begin()

    def work() -> None:
        return None

    costs = {
        "plain call": per_call_us(work, n),
        "micro-batch work (stage wrapper + timer)": per_call_us(functools.partial(_around_work, timer.compute, work),
                                                                 n),
        "post": per_call_us(lambda: timer.posted(work), n),
        "wait on a work": per_call_us(_TimedWork(_Done(), True, timer.waited).wait, n),
    }
    timer._pieces.clear()
    pieces = [(0, 1.0, 2.0)] * 40
    costs["replay of a 40-piece step (logging step)"] = per_call_us(
        lambda: stage_fields(0.0, 1.0, pieces, lambda a, b: b - a), n // 10)
    for name, us in costs.items():
        print(f"{name:<45} {us:7.2f} us")
    step = 4 * 6 * max(costs[k] for k in ("micro-batch work (stage wrapper + timer)", "post", "wait on a work"))
    print(f"a stage step of 4 micro-batches (~24 pieces): ~{step:.0f} us")


if __name__ == "__main__":
    main()
