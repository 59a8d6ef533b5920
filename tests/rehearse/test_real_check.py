"""The real-GPU check's own logic on hand-made results: its runs, the emulation shown per rank (an unemulated rank
named), the bars it holds the rehearsal and the memory plan to."""

import pytest

from benchmarks.rehearse_real import Run, compare_run, emulation_rows, format_real_check
from lightning_hetero.rehearse.job import RankResult

GIB = 2**30


def _rank(rank: int, peak: float, step: float, speed, probe: float, estimate=None) -> RankResult:
    return RankResult("real", rank, f"card{rank}", ok=True, batch=4, plan="keep", peak_allocated_bytes=int(peak * GIB),
                      step_seconds=[1.0, 1.0, step, step], estimated_bytes=int(estimate * GIB) if estimate else None,
                      estimate_source="allocator" if estimate else None, emulated_speed=speed,
                      emulation_probe_seconds=probe)


def test_runs_parse_ours_and_lightnings():
    assert Run.parse("hetero_fsdp:offload") == Run("hetero_fsdp:offload", "hetero_fsdp", "offload")
    assert Run.parse("hetero_ddp").modes() == ("hetero", "real")
    assert Run.parse("fsdp").modes() == ("fsdp", "real_fsdp")
    with pytest.raises(ValueError, match="no memory rule"):
        Run.parse("ddp:keep")


def test_every_rank_shows_its_emulation_and_an_unemulated_rank_is_named():
    real = [_rank(0, 10, 0.2, 40.0, 0.01), _rank(1, 5, 0.2, 8.0, 0.05), _rank(2, 5, 0.2, None, 0.01)]
    rows = emulation_rows(real)
    assert rows[1]["ratio"] == pytest.approx(5.0) and rows[1]["expected_ratio"] == pytest.approx(5.0)
    summary, misses = compare_run(Run.parse("ddp"), real, real, {"strategies": {}})
    assert [m for m in misses if "NOT EMULATED" in m] == ["ddp rank 2 (card2): NOT EMULATED (no emulator in the "
                                                          "rank's process)"]
    assert "NOT EMULATED" in format_real_check({"runs": [summary], "disagreements": misses, "link": "pcie"})


def test_the_bars_peak_estimate_and_step():
    rehearsed = [_rank(0, 10.0, 0.18, 40.0, 0.01), _rank(1, 5.0, 0.2, 8.0, 0.05)]
    # Rank 0's real peak 6 % above the rehearsed; rank 1's estimate 20 % under its real peak; the step 15 % short.
    real = [_rank(0, 10.6, 0.25, 40.0, 0.01, estimate=10.5), _rank(1, 5.0, 0.26, 8.0, 0.05, estimate=4.0)]
    prediction = {"strategies": {"hetero_fsdp": {"step_seconds": 0.221, "no_overlap_step_seconds": 0.3,
                                                 "compute_seconds": [0.18, 0.2]}}}
    summary, misses = compare_run(Run.parse("hetero_fsdp:keep"), rehearsed, real, prediction)
    assert summary["real_step_seconds"] == pytest.approx(0.26)
    assert summary["step_error"] == pytest.approx(0.221 / 0.26 - 1)
    assert len(misses) == 3
    assert "rank 0 (card0): rehearsed peak" in misses[0]
    assert "plan estimate" in misses[1] and "predicted step" in misses[2]


def test_each_ranks_phases_and_the_real_starts_are_shown():
    from benchmarks.rehearse_real import OFFLOAD_STEPS, start_skew

    rehearsed = [_rank(0, 10.0, 0.18, 40.0, 0.01), _rank(1, 5.0, 0.2, 8.0, 0.05)]
    real = [_rank(0, 10.0, 0.25, 40.0, 0.01), _rank(1, 5.0, 0.26, 8.0, 0.05)]
    for rank, phases in zip(rehearsed + real, ([0.05, 0.1, 0.03], [0.03, 0.06, 0.11], [0.06, 0.15, 0.04],
                                               [0.05, 0.09, 0.12])):
        rank.phase_seconds = [phases] * 4
    # Rank 1 starts 2 ms after rank 0 in every step; the steps come every 0.3 s.
    real[0].step_started_at = [100.0, 100.3, 100.6, 100.9]
    real[1].step_started_at = [100.002, 100.302, 100.602, 100.902]
    assert start_skew(real) == pytest.approx({"start_skew_seconds": 0.002, "period_seconds": 0.3})
    prediction = {"strategies": {"hetero_ddp": {"step_seconds": 0.26, "no_overlap_step_seconds": 0.3,
                                                "compute_seconds": [0.18, 0.2],
                                                "phase_seconds": [[0.05, 0.1, 0.03], [0.03, 0.06, 0.11]]}}}
    summary, _ = compare_run(Run.parse("hetero_ddp"), rehearsed, real, prediction)
    rehearsed_phases, real_phases = summary["ranks"][1]["phase_seconds"]
    assert rehearsed_phases == pytest.approx([0.03, 0.06, 0.11]) and real_phases == pytest.approx([0.05, 0.09, 0.12])
    assert summary["start_skew_seconds"] == pytest.approx(0.002) and summary["period_seconds"] == pytest.approx(0.3)
    table = format_real_check({"runs": [summary], "disagreements": [], "link": "pcie"})
    assert "30.0 / 60.0 / 110.0" in table and "50.0 / 90.0 / 120.0" in table and "300.0" in table
    # A run whose ranks offload takes the warm-up and one timed step at most.
    assert Run.parse("hetero_fsdp:offload").steps(5) == OFFLOAD_STEPS == 3
    assert Run.parse("hetero_fsdp:keep").steps(5) == 5 and Run.parse("hetero_fsdp:offload").steps(2) == 2


def test_a_peak_miss_says_where_each_peak_was_reached_and_the_host_phases_are_shown():
    rehearsed, real = _rank(0, 9.99, 0.2, 40.0, 0.01), _rank(0, 11.31, 0.2, 40.0, 0.01)
    for rank in (rehearsed, real):
        rank.setup_peak_bytes = int(2.77 * GIB)
        rank.phase_peak_bytes = [[int(7.0 * GIB), int(7.98 * GIB), int(7.98 * GIB)]] + [
            [int(7.98 * GIB), int(9.99 * GIB), int(9.99 * GIB)]] * 3
        rank.phase_seconds = rank.host_phase_seconds = [[0.05, 0.1, 0.03]] * 4
        rank.device, rank.device_wait_seconds = "NVIDIA H200", [0.0001] * 4  # host-bound
        rank.step_cpus = [3, 3, 35, 3]
    # The real rank's peak grew by one fp32 copy of the parameters in step 3's optimizer step.
    real.phase_peak_bytes[2] = [int(9.99 * GIB), int(9.99 * GIB), int(11.31 * GIB)]
    real.phase_peak_bytes[3] = [int(11.31 * GIB)] * 3
    summary, misses = compare_run(Run.parse("ddp"), [rehearsed], [real], {"strategies": {}})
    assert "reached: rehearsed step 2 backward, real step 3 rest; set-up peaks 2.77 / 2.77 GiB" in misses[0]
    assert summary["ranks"][0]["host_bound"] == [True, True]
    text = format_real_check({"runs": [summary], "disagreements": misses, "link": "pcie"})
    assert "on the host: rehearsed" in text and "yes/yes" in text and "3,35 | 3,35" in text
