"""A rank that slows down mid-run: ``throttled`` (the SM count or CPU slowdown after the change) and
``Emulator.throttle`` (the swap between two steps), on CPU and on a CUDA host faked without a GPU."""

from dataclasses import replace

import pytest
import torch

from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.emulated_device import resolve, throttled
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.emulator import Emulator

H100 = DeviceInfo(rank=0, host="h", type="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0),
                  memory_bytes=80 * 2**30, multiprocessors=132)
A100 = DeviceInfo(rank=0, host="h", type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0),
                  memory_bytes=80 * 2**30, multiprocessors=108)
CPU = DeviceInfo(rank=0, host="h", type="cpu", name="cpu", capability=(0, 0), memory_bytes=8 * 2**30,
                 multiprocessors=2)


def test_an_uncapped_gpu_halves_to_the_nearest_granule():
    whole = resolve(EmulationSpec(link="pcie"), H100)
    assert whole.num_sms is None and whole.host_capability == (9, 0)
    half = throttled(whole, 2.0)
    assert (half.num_sms, half.wanted_sms, half.clamped) == (64, 66.0, False)  # 66 wanted, multiples of 8 on 9.x
    assert half.link == "pcie" and half.name == whole.name  # only the speed changes


def test_a_capped_gpu_divides_its_own_count():
    quarter = resolve(EmulationSpec(sm_share=0.25), H100)
    assert quarter.num_sms == 32
    assert throttled(quarter, 2.0).num_sms == 16
    assert throttled(resolve(EmulationSpec(link="nvlink"), A100), 2.0).num_sms == 54  # steps of 2 SMs on 8.x


def test_a_throttle_the_granularity_cannot_express_is_refused():
    smallest = resolve(EmulationSpec(sm_share=0.05), H100)
    assert smallest.num_sms == 8
    with pytest.raises(ValueError, match="`factor`=2.0: 8 SMs / 2 rounds to 8"):
        throttled(smallest, 2.0)
    for bad in (0.5, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="`factor`="):
            throttled(smallest, bad)  # type: ignore[arg-type]
    assert throttled(smallest, 1.0).num_sms == 8  # no change asked: none made


def test_cpu_throttle_multiplies_the_slowdown():
    assert throttled(resolve(EmulationSpec(slowdown=3.0), CPU), 2.0).slowdown == 6.0
    assert throttled(resolve(EmulationSpec(name="whole"), CPU), 2.0).slowdown == 2.0


def _step() -> None:
    x = torch.randn(128, 128)
    for _ in range(30):
        x @ x


def test_an_unslowed_cpu_rank_pauses_after_its_throttle():
    emulator = Emulator(resolve(EmulationSpec(name="whole"), CPU), torch.device("cpu"), "nvlink")
    with emulator.work():
        _step()
    assert emulator.slept_seconds == 0.0 and not emulator.slows_cpu
    assert emulator.throttle(2.0).slowdown == 2.0
    assert emulator.slows_cpu  # collectives inside its steps are left out of the pause from now on
    emulator.reset_stats()
    with emulator.work():
        _step()
    assert emulator.compute_seconds > 0
    # It pauses what it owes (1x its compute at 2x); a late wake-up is host noise.
    assert emulator.compute_seconds <= emulator.slept_seconds <= emulator.compute_seconds + 0.1


def test_throttle_inside_a_step_is_refused():
    emulator = Emulator(resolve(EmulationSpec(slowdown=2.0), CPU), torch.device("cpu"), "nvlink")
    with emulator.work():
        with pytest.raises(RuntimeError, match="between steps"):
            emulator.throttle(2.0)
    assert emulator.device.slowdown == 2.0


class _FakeGreen:
    """Stands for a CUDA green context: its stream is an object that names its SM count."""

    created: list[int] = []

    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms

    @classmethod
    def create(cls, *, num_sms: int, device_id: int) -> "_FakeGreen":
        cls.created.append(num_sms)
        return cls(num_sms)

    def Stream(self) -> str:  # noqa: N802 (the green context's method name)
        return f"stream-{self.num_sms}"


def test_cuda_throttle_moves_the_steps_to_a_new_green_context(monkeypatch):
    import torch.cuda.green_contexts

    monkeypatch.setattr(torch.cuda.green_contexts, "GreenContext", _FakeGreen)
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    _FakeGreen.created = []
    device = torch.device("cuda", 0)
    capped = Emulator(resolve(EmulationSpec(sm_share=0.25, link="pcie"), H100), device, "pcie")
    capped.activate()
    assert capped.stream == "stream-32"
    old = capped.green_context.context
    capped.throttle(2.0)
    # work() reads the stream at every step: the next one runs on 16 SMs; the old context is kept until the end.
    assert (capped.stream, capped.device.num_sms, _FakeGreen.created) == ("stream-16", 16, [32, 16])
    assert synced == [device] and capped.green_context.retired == [old]
    assert not capped.slows_cpu

    whole = Emulator(resolve(EmulationSpec(link="pcie"), H100), device, "pcie")
    whole.activate()
    assert whole.stream is None  # a whole card runs on the current stream
    whole.throttle(2.0)
    assert whole.stream == "stream-64" and whole.describe(H100).multiprocessors == 64
    assert replace(whole.device, num_sms=None) == replace(resolve(EmulationSpec(link="pcie"), H100),
                                                          wanted_sms=66.0)
