"""benchmarks/bench_hybrid.py: its options are checked before any configuration runs, each error naming its flag."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import bench_hybrid  # noqa: E402


@pytest.mark.parametrize(("argv", "flag"), [
    # A misspelt configuration used to run Lightning's FSDP under that name.
    (["--configs", "hybird"], "--configs"),
    (["--configs", "hybrid", "--timeouts", "hybridauto"], "--timeouts"),
    (["--configs", "hybrid", "--timeouts", "hybird=240"], "--timeouts"),
    # Used to fail only when the loop reached dp4, after the configurations before it had run.
    (["--configs", "fast2,dp4", "--global-batch", "6"], "--global-batch"),
], ids=["config", "timeout without seconds", "timeout of an unknown config", "global batch"])
def test_bad_options_stop_before_anything_runs(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit):
        bench_hybrid.main(argv + ["--accelerator", "cpu", "--tiny", "--timeout", "1", "--out", str(tmp_path)])
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "bench_hybrid.json").exists()


@pytest.mark.parametrize(("config", "overlap", "capacities"),
                         [("hybrid", True, "list"), ("hybridlate", False, "list"),
                          ("hybridprofile", True, "profile")])
def test_hybrid_levers_change_one_thing_each(config, overlap, capacities):
    args = bench_hybrid.argparse.Namespace(monitor=False, accelerator="cpu", fast_card=None, micro_batches=None,
                                           profile_steps=4)
    strategy = bench_hybrid._strategy(config, args, 4, None)
    assert strategy.pipelines == [[2, 3]]
    assert strategy.overlap_stage_exchange is overlap
    assert strategy.plan.spec.source == capacities


def test_the_emulation_check_times_the_pause_of_a_slowed_cpu_rank():
    """The check once timed the work inside the emulator's context and returned before the pause on leaving it: a rank
    set to 3x measured 0.5-1.0x."""
    import torch

    from lightning_hetero.lab.devices import DeviceInfo
    from lightning_hetero.lab.emulated_device import resolve
    from lightning_hetero.lab.emulation_spec import EmulationSpec
    from lightning_hetero.lab.emulator import Emulator
    from tests.helpers import retry_timing

    cpu = DeviceInfo(rank=0, host="h", type="cpu", name="cpu", capability=(0, 0), memory_bytes=8 * 2**30,
                     multiprocessors=2)
    emulator = Emulator(resolve(EmulationSpec(slowdown=3.0), cpu), torch.device("cpu"), "nvlink")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the emulator counts the calling thread's CPU time

    def attempt(_: int) -> None:
        check = bench_hybrid.verify_emulation(emulator, torch.device("cpu"))
        assert check["expected_slowdown"] == 3.0
        assert 1.8 <= check["measured_slowdown"] <= 4.5, check  # wall time: the host's load moves it

    try:
        retry_timing(3, attempt)
    finally:
        torch.set_num_threads(threads)
