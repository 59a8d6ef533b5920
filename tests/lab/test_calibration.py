"""Calibrated presets: the published training-speed table, the fit of SM count and dilation, the calibration file
and its errors, what ``resolve`` and ``capacities="peak"`` make of them, and the dilation's arithmetic (CPU only)."""

import json
import math

import pytest
import torch

from lightning_hetero.lab.calibration import (
    CALIBRATION_ENV,
    fit_calibration,
    fit_knob,
    load_calibration,
    parse_calibration,
    target_speed,
)
from lightning_hetero.lab.cards import PUBLISHED, WORKLOADS, card_of, device_speed, training_speed
from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.dilation import StepWindow, spin_cycles, spin_seconds
from lightning_hetero.lab.emulated_device import resolve
from lightning_hetero.lab.emulation_spec import EmulationSpec, parse_emulate
from lightning_hetero.lab.presets import PRESETS
from lightning_hetero.plan.capacity import parse_capacities, resolve_static_capacities


def _gpu(name: str, sms: int = 132, capability: tuple[int, int] = (9, 0)) -> DeviceInfo:
    return DeviceInfo(rank=0, host="h", type="cuda", name=name, capability=capability, memory_bytes=141 * 2**30,
                      multiprocessors=sms)


H200 = _gpu("NVIDIA H200")
H100 = _gpu("NVIDIA H100 80GB HBM3")
# A synthetic measured curve: speed relative to the whole GPU = (SMs / 132) ** exponent.
COUNTS = list(range(8, 132, 8)) + [132]
CURVES = {w: {s: (s / 132) ** e for s in COUNTS} for w, e in (("bert", 0.6), ("resnet", 0.5), ("gpt", 0.7))}


@pytest.fixture
def calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(fit_calibration("NVIDIA H200", 132, CURVES).as_dict()))
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    return path


# -- the published table ----------------------------------------------------------------------------------------------
def test_every_preset_has_a_published_speed_with_its_source():
    assert set(PUBLISHED) == set(PRESETS)
    for card, speed in PUBLISHED.items():
        assert speed.source, card
        assert card_of(PRESETS[card].name) == card  # the emulated card's name finds its own row
    # Lambda's figures: RTX 3090 / A100-80GB SXM4 on BERT-base fp16 172 / 443, ResNet-50 AMP 905 / 1582
    assert training_speed("RTX3090", "bert") == pytest.approx(172 / 443)
    assert training_speed("RTX3090", "resnet") == pytest.approx(905 / 1582)
    assert training_speed("A100-80GB") == 1.0
    default = math.exp(sum(math.log(training_speed("RTX3090", w)) for w in WORKLOADS) / 3)
    assert training_speed("RTX3090") == pytest.approx(default)
    # the order a lab expects, and nothing like the peak-TFLOP ratio (35.6 / 312 = 0.11)
    assert training_speed("T4") < training_speed("A10") < training_speed("RTX3090") < training_speed("RTX4090")
    assert 0.4 < training_speed("RTX3090") < 0.5 and training_speed("H100") > 1.5
    with pytest.raises(ValueError, match="`workload`='vit'"):
        training_speed("RTX3090", "vit")
    with pytest.raises(ValueError, match="`card`='GTX1080'"):
        training_speed("GTX1080")


def test_card_names_match_the_longest_key():
    assert card_of("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert card_of("NVIDIA A100 80GB PCIe") == "A100-80GB"
    assert card_of("NVIDIA A100-PCIE-40GB") == "A100-40GB"
    assert card_of("NVIDIA A10") == "A10"
    assert card_of("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert card_of("NVIDIA H200") is None


def test_capacities_peak_reads_training_speed_and_peak_tflops_keeps_the_rates():
    lab = [_gpu("NVIDIA A100-SXM4-80GB", 108, (8, 0)), _gpu("NVIDIA GeForce RTX 3090 (emulated)", 82, (8, 6))]
    weights, source = resolve_static_capacities(parse_capacities("peak"), lab, torch.bfloat16)
    assert source == "peak" and weights == pytest.approx([1.0, training_speed("RTX3090")])
    weights, source = resolve_static_capacities(parse_capacities("peak_tflops"), lab, torch.bfloat16)
    assert source == "peak_tflops" and weights == [312.0, 35.6]
    # a card without a published training speed: its dense rate over the A100's
    assert device_speed(H200) == pytest.approx(989.0 / 312.0)
    with pytest.raises(ValueError, match="`capacities`='peek'"):
        parse_capacities("peek")


# -- the fit ----------------------------------------------------------------------------------------------------------
def test_fit_hits_a_reachable_target_exactly_and_never_speeds_up():
    knob = fit_knob({"bert": {8: 0.1, 16: 0.3, 132: 1.0}}, {"bert": 0.25})
    assert knob.sms == 16 and knob.default == pytest.approx(1.2) and knob.worst_error == pytest.approx(0.0)
    slow = fit_knob({"bert": {8: 0.1, 132: 1.0}}, {"bert": 0.05})
    assert slow.sms == 8 and slow.default == pytest.approx(2.0)
    fast = fit_knob({"bert": {8: 0.1, 132: 1.0}}, {"bert": 2.0})  # faster than the host: whole GPU, no dilation
    assert fast.sms == 132 and fast.default == 1.0
    with pytest.raises(ValueError, match="share no SM count"):
        fit_knob({"bert": {8: 0.1}, "gpt": {16: 0.2}}, {"bert": 0.1, "gpt": 0.1})


def test_fit_minimises_the_worst_log_error_over_the_workloads():
    table = fit_calibration("NVIDIA H200", 132, CURVES)
    knobs = dict(table.presets)
    assert knobs["H100"].sms == 132 and knobs["H100"].default == 1.0
    for preset, knob in knobs.items():
        errors = [math.log(CURVES[w][knob.sms] / knob.default / target_speed(preset, w)) for w in WORKLOADS]
        assert max(abs(e) for e in errors) == pytest.approx(knob.worst_error)
        assert knob.default >= 1.0
        # no SM count does better than the chosen one by more than the tolerance, at its own best dilation
        for sms in COUNTS:
            r = [math.log(CURVES[w][sms] / target_speed(preset, w)) for w in WORKLOADS]
            log_d = max(0.0, (max(r) + min(r)) / 2)
            assert max(abs(x - log_d) for x in r) >= knob.worst_error - 0.02 - 1e-9
        # each workload's own dilation makes it exact where the slice is fast enough
        for w in WORKLOADS:
            if CURVES[w][knob.sms] >= target_speed(preset, w):
                assert CURVES[w][knob.sms] / knob.dilation(w) == pytest.approx(target_speed(preset, w))
    # the curve of a small slice is too fast for an RTX 3090: a dilation above 1 slows it
    assert knobs["RTX3090"].default > 1.0 and knobs["RTX3090"].sms < 66


# -- the file ---------------------------------------------------------------------------------------------------------
def test_file_round_trips_and_is_found_by_host_kind_or_env(calibration_file, monkeypatch):
    table = load_calibration("NVIDIA H200")
    assert table is not None and table.path == str(calibration_file)
    again = parse_calibration(table.as_dict())
    assert again.presets == table.presets and again.curves == table.curves
    sms, dilation = table.knob("RTX3090", "bert")
    assert dilation == dict(table.presets)["RTX3090"].dilation("bert")
    assert table.knob("RTX3090") == (sms, dict(table.presets)["RTX3090"].default)
    monkeypatch.delenv(CALIBRATION_ENV)
    assert load_calibration("NVIDIA H100 80GB HBM3") is None  # no file ships for an H100 host


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d.pop("curves"), "lacks `curves`"),
        (lambda d: d.update(host_sms=0), "`c.host_sms`=0"),
        (lambda d: d["curves"].update(vit={"8": 0.1}), "`c.curves.vit` is not a workload"),
        (lambda d: d["curves"]["bert"].update({"8": -1}), "`c.curves.bert.8`=-1"),
        (lambda d: d["curves"]["bert"].update({"eight": 0.1}), "`c.curves.bert`: 'eight'"),
        (lambda d: d["presets"].update(GTX1080={"sms": 8, "default": 1.0}), "`c.presets.GTX1080` is not a preset"),
        (lambda d: d["presets"]["T4"].update(sms=200), "`c.presets.T4.sms`=200"),
        (lambda d: d["presets"]["T4"].update(default=0.5), "`c.presets.T4.default`=0.5 must be a dilation >= 1"),
        (lambda d: d["presets"]["T4"].update(bert="fast"), "`c.presets.T4.bert`='fast'"),
    ],
)
def test_bad_files_name_the_field(edit, needle):
    raw = fit_calibration("NVIDIA H200", 132, CURVES).as_dict()
    edit(raw)
    with pytest.raises(ValueError) as err:
        parse_calibration(raw, where="c")
    assert needle in str(err.value)


def test_unreadable_file_names_the_env_var(tmp_path, monkeypatch):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    with pytest.raises(ValueError, match=CALIBRATION_ENV):
        load_calibration("NVIDIA H200")


# -- resolve ----------------------------------------------------------------------------------------------------------
def test_resolve_takes_the_measured_knob_per_workload(calibration_file):
    table = load_calibration("NVIDIA H200")
    for workload in (None, *WORKLOADS):
        device = resolve(EmulationSpec(preset="RTX3090", workload=workload), H200)
        sms, dilation = table.knob("RTX3090", workload)
        assert (device.num_sms, device.dilation) == (sms, dilation)
        assert device.calibration == f"measured h200.json ({workload or 'default'})"
        assert f"dilation {dilation:.2f}x" in device.summary() and "calibration: measured" in device.summary()
    assert resolve(EmulationSpec(preset="H100"), H200).num_sms is None  # the whole host


def test_resolve_without_a_file_uses_the_published_ratio(monkeypatch):
    monkeypatch.delenv(CALIBRATION_ENV, raising=False)
    device = resolve(EmulationSpec(preset="RTX3090", workload="bert"), H100)
    ratio = training_speed("RTX3090", "bert") / training_speed("H100", "bert")
    assert device.wanted_sms == pytest.approx(ratio * 132) and device.dilation == 1.0
    assert device.calibration.startswith("published ratio")
    old = resolve(EmulationSpec(preset="RTX3090", calibration="peak_tflops"), H100)  # the old share, by name
    assert old.wanted_sms == pytest.approx(35.6 / 989.0 * 132) and old.calibration == "peak_tflops"


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"preset": "RTX3090", "workload": "vit"}, "`emulate[0].workload`='vit'"),
        ({"preset": "RTX3090", "calibration": "guess"}, "`emulate[0].calibration`='guess'"),
        ({"sm_share": 0.5, "workload": "bert"}, "without a `preset`"),
    ],
)
def test_bad_calibration_keys_name_the_field(entry, needle):
    with pytest.raises(ValueError) as err:
        parse_emulate([entry])
    assert needle in str(err.value)


# -- the dilation's arithmetic ----------------------------------------------------------------------------------------
def test_dilation_uses_the_fastest_recent_step_and_converts_to_cycles():
    window = StepWindow(size=3)
    assert window.estimate() is None and spin_seconds(2.0, window.estimate()) == 0.0
    for seconds in (0.010, 0.030, 0.012):  # the 30 ms step waited for a slower peer
        window.add(seconds)
    assert window.estimate() == 0.010
    assert spin_seconds(1.5, window.estimate()) == pytest.approx(0.005)
    assert spin_seconds(1.0, 0.010) == 0.0
    for seconds in (0.020, 0.020, 0.020):  # the window forgets the oldest: the rank got slower
        window.add(seconds)
    assert window.estimate() == 0.020
    assert spin_cycles(0.005, 1.98e9) == 9_900_000
    assert spin_cycles(-1.0, 1.98e9) == 0
    with pytest.raises(ValueError, match="`size`"):
        StepWindow(size=0)
