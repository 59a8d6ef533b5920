"""``Emulator.throttle`` on a real GPU: ``python -m pytest -q -s tests/gpu/test_gpu_throttle.py -m gpu`` (skipped
without one). A whole card halved, then halved again: each time the steps move to a new green context and a
matmul-bound forward and backward slows by about the SM ratio."""

import time

import pytest
import torch

from lightning_hetero.lab.devices import describe_device
from lightning_hetero.lab.emulated_device import resolve
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.emulator import Emulator

pytestmark = pytest.mark.gpu(1)


def _step_seconds(emulator: Emulator, model: torch.nn.Module, x: torch.Tensor) -> float:
    """Best of 3 timings of 5 forward/backward passes under the emulator (after one untimed)."""
    best = float("inf")
    for i in range(4):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(5):
            with emulator.work():
                model(x).square().mean().backward()
        torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - began)
    return best


def test_throttle_halves_the_sms_and_the_speed() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    host = describe_device(device, 0)
    emulator = Emulator(resolve(EmulationSpec(link="nvlink"), host), device, "nvlink")
    emulator.activate()
    assert emulator.stream is None  # a whole card: no green context yet
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(6)]).to(device)
    x = torch.randn(4096, 4096, device=device)
    whole = _step_seconds(emulator, model, x)
    half_device = emulator.throttle(2.0)
    first = emulator.stream
    half = _step_seconds(emulator, model, x)
    quarter_device = emulator.throttle(2.0)
    quarter = _step_seconds(emulator, model, x)
    print(f"\nthrottle on {host.name}: all {host.multiprocessors} SMs {1000 * whole:.1f} ms, "
          f"{half_device.num_sms} SMs {1000 * half:.1f} ms ({half / whole:.2f}x), "
          f"{quarter_device.num_sms} SMs {1000 * quarter:.1f} ms ({quarter / half:.2f}x)")
    assert first is not None and emulator.stream is not first  # each throttle: a new green context's stream
    assert half_device.num_sms == quarter_device.num_sms * 2
    ideal_half = host.multiprocessors / half_device.num_sms
    assert 0.8 * ideal_half < half / whole < 1.2 * ideal_half, (whole, half)
    assert 1.6 < quarter / half < 2.4, (half, quarter)
