import json

import torch

from lightning_hetero.lab.devices import DeviceInfo, has_bf16_hardware, peak_tflops
from lightning_hetero.observe.doctor import diagnose, format_report


def _gpu(name, cc, sms=100):
    return DeviceInfo(rank=0, host="h", type="cuda", name=name, capability=cc, memory_bytes=2**34, multiprocessors=sms)


def test_peak_table_and_fallback():
    assert peak_tflops(_gpu("NVIDIA A100-SXM4-40GB", (8, 0))) == 312.0
    assert peak_tflops(_gpu("NVIDIA H100 PCIe", (9, 0))) == 756.0  # longest key wins over "H100"
    assert peak_tflops(_gpu("Tesla V100-SXM2-16GB", (7, 0))) == 125.0  # no bf16: its fp16 rate
    assert peak_tflops(_gpu("NVIDIA GeForce RTX 3090", (8, 6)), torch.float32) == 35.6
    unknown = peak_tflops(_gpu("Future GPU", (9, 0), sms=100))
    assert abs(unknown - 749.0) < 1.0  # Hopper per-SM rate x 100 SMs
    assert peak_tflops(DeviceInfo(0, "h", "cpu", "cpu", (0, 0), 0, 2)) is None


def test_bf16_from_capability_not_emulation():
    assert has_bf16_hardware(_gpu("A100", (8, 0)))
    assert not has_bf16_hardware(_gpu("V100", (7, 0)))


def test_doctor_report_on_cpu():
    report = diagnose()
    json.dumps(report)
    text = format_report(report)
    assert "torch" in text and report["devices"][0]["type"] in ("cpu", "cuda")
