"""The bisection of the shared-GPU exact phase (``fsdp_shared_bisect.py``) on the host: its reading of crash reports,
and a crash on purpose in the second fit caught with its Python stack (Lightning's teardown of the first fit had
removed faulthandler's handler, so such a crash printed nothing), beside a variant that must still train exactly."""

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_shared_bisect import (  # noqa: E402
    bisect,
    crash_frame,
    crash_report,
    native_frames,
    native_report,
    outcome,
    verdict,
)
from fsdp_shared_worker import check_knobs  # noqa: E402

NATIVE_THREAD_CRASH = """Lightning's last line
Fatal Python error: Segmentation fault

Thread 0x00007f01 (most recent call first):
  File "/py/threading.py", line 331 in wait
  File "/py/threading.py", line 1002 in _bootstrap

Current thread 0x00007f02 (most recent call first):
  <no Python frame>

Thread 0x00007f03 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 2900 in all_reduce
  File "/repo/lightning_hetero/resilience/preemption.py", line 163 in agree
  File "/repo/tests/gpu/fsdp_shared_worker.py", line 469 in <module>

Extension modules: numpy, torch._C (total: 2)
"""


def test_a_crash_in_a_native_thread_names_where_the_main_thread_was() -> None:
    report = crash_report(NATIVE_THREAD_CRASH)
    assert report is not None and report.startswith("Fatal Python error") and "Extension modules" not in report
    assert crash_frame(report) == ("a thread with no Python frame; main thread at distributed/distributed_c10d.py:2900 "
                                   "in all_reduce (lightning_hetero: resilience/preemption.py:163 in agree)")


def test_a_crash_in_the_main_thread_and_a_traceback() -> None:
    main = NATIVE_THREAD_CRASH.replace("Thread 0x00007f03", "Current thread 0x00007f03").replace(
        "Current thread 0x00007f02", "Thread 0x00007f02")
    assert crash_frame(crash_report(main)).startswith("distributed/distributed_c10d.py:2900 in all_reduce")
    traceback = 'x\nTraceback (most recent call last):\n  File "/a/b/c.py", line 3, in f\n    g()\nValueError: y\n'
    assert crash_frame(crash_report(traceback)) == "b/c.py:3 in f"
    assert crash_report("no crash here\n") is None and crash_frame(None) is None


NATIVE_CRASH = """LOCAL_RANK: 1 - CUDA_VISIBLE_DEVICES: [0,1]
SIGSEGV(11), PID: 7, Thread 9:
 frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f in /t/lib/libc10.so)
frame #1: c10::FatalSignalHandler::fatalSignalHandler(int, siginfo_t*) + 0x2da (0x7f in /t/lib/libc10.so)
frame #2: <unknown function> + 0x3c050 (0x7f in /lib/libc.so.6)
frame #3: gloo::transport::tcp::UnboundBuffer::send(int, unsigned long) + 0x1 (0x7f in /t/lib/libtorch_cpu.so)
frame #4: c10d::ProcessGroupGloo::send(std::vector<at::Tensor>&, int, int) + 0x2 (0x7f in /t/lib/libtorch_cpu.so)
<omitting python frames>
frame #9: <unknown function> + 0x891f5 (0x7f in /lib/libc.so.6)

SIGSEGV(11), PID: 7, Thread 8:
 frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f in /t/lib/libc10.so)
frame #1: pthread_cond_wait + 0x1e8 (0x7f in /lib/libc.so.6)

""" + NATIVE_THREAD_CRASH


def test_the_native_report_names_the_crashed_threads_frames_below_the_handler() -> None:
    report = native_report(NATIVE_CRASH)
    assert report is not None and report.startswith("SIGSEGV(11)") and "Fatal Python error" not in report
    assert native_frames(report, count=3) == (
        "gloo::transport::tcp::UnboundBuffer::send(int, unsigned long) (libtorch_cpu.so)"
        " < c10d::ProcessGroupGloo::send(std::vector<at::Tensor>&, int, int) (libtorch_cpu.so) < ? (libc.so.6)")
    assert crash_frame(crash_report(NATIVE_CRASH)).startswith("a thread with no Python frame")
    assert native_report(NATIVE_THREAD_CRASH) is None and native_frames(None) is None


def test_outcomes_and_the_verdict() -> None:
    assert outcome([-11, 0, 1, None, "SIGSEGV"]) == "SIGSEGV/ok/1/-/SIGSEGV"
    assert outcome([-9, -9], ["SIGSEGV", None]) == "SIGSEGV(killed)/SIGKILL"
    results: list[dict[str, Any]] = [
        {"variant": "base", "ok": False, "launches": [{"returncodes": [-11, -11]}]},
        {"variant": "no-measure", "ok": True, "launches": [{"returncodes": [0, 0]}]},
        {"variant": "no-preempt", "ok": False, "launches": [{"returncodes": [-11, -11]}]},
        {"variant": "base under gdb", "ok": True, "debugger": True, "launches": [{"returncodes": ["SIGSEGV"] * 2}]},
    ]
    assert verdict(results) == ("base failed (SIGSEGV/SIGSEGV); passed with: no-measure; still failing with: "
                                "no-preempt")


def test_unknown_or_contradictory_knobs_are_refused() -> None:
    assert check_knobs(iter(["no-measure", "trace"])) == {"no-measure", "trace"}
    with pytest.raises(ValueError, match="no-such"):
        check_knobs(["no-such"])
    with pytest.raises(ValueError, match="leave no fit"):
        check_knobs(["fit1-only", "fit2-only"])


@pytest.mark.slow
def test_a_crash_in_the_second_fit_is_caught_with_its_stack(tmp_path: Any) -> None:
    results = bisect(str(tmp_path / "out"), "cpu", ("self-check", "no-measure"), budget=400, timeout=150,
                     work=str(tmp_path / "work"))
    crashed, counted = (r["launches"][0] for r in results)
    assert crashed["returncodes"] == [-11, -11], crashed["log_tail"]
    assert crashed["last_mark"] == ["fit 2: start"] * 2
    assert all("in string_at" in (frame or "") for frame in crashed["crash_frame"]), crashed["crash_report"]
    # torch's handler ran first: each rank's C++ frames, below the handler, in ctypes' call.
    assert all("_ctypes" in (frames or "") for frames in crashed["native_frames"]), crashed["native_report"]
    assert crashed["signal_in_log"] == ["SIGSEGV"] * 2
    # The knob reaches the strategy (the plan says it counted), and the phase stays exact.
    assert counted["returncodes"] == [0, 0] and counted["last_mark"] == ["end"] * 2, counted["log_tail"]
    assert "counted, not measured: `memory.measure` is off" in open(counted["log_paths"][0]).read()
    assert counted["max_rel_diff"] <= 1e-6 and counted["samples_per_step"] == [[6, 2]] * 4
    assert sorted(os.listdir(tmp_path / "out")) == ["fsdp_shared_bisect.json", "fsdp_shared_bisect.txt",
                                                    "self-check_rank0.log", "self-check_rank1.log"]
