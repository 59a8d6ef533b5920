"""The emulator of one rank: it applies an :class:`~lightning_hetero.lab.emulated_device.EmulatedDevice` and runs the
rank's steps under it: on the green context's stream (:mod:`lightning_hetero.lab.green_context`) under a memory cap,
followed by the GPU's time dilation (:mod:`lightning_hetero.lab.dilation`) or the slowdown's pause
(:mod:`lightning_hetero.lab.step_slowdown`).

A rank can slow down mid-run (a card that throttles): ``Emulator.throttle(factor)`` between two steps divides its SM
count by ``factor`` (rounded to the granularity; a new green context) or multiplies its CPU slowdown.

Example::
    >>> emulator = Emulator(resolve(EmulationSpec(slowdown=3.0), cpu_host), torch.device("cpu"), "nvlink")
    >>> with emulator.work():
    ...     training_step()
"""

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Optional

import torch

from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.dilation import GpuDilation, measure_spin_rate
from lightning_hetero.lab.emulated_device import EmulatedDevice, throttled
from lightning_hetero.lab.emulation_env import rank_env
from lightning_hetero.lab.green_context import GreenContextCap
from lightning_hetero.lab.presets import LinkClass
from lightning_hetero.lab.step_slowdown import EmulatedTime, StepSlowdown


class Emulator:
    """Applies one rank's :class:`EmulatedDevice` and runs its steps under it.

    Order of use: :meth:`apply_env` (before the process group exists), :meth:`activate` (after the CUDA device is
    set), :meth:`work` around every step (:meth:`throttle` between two of them slows the rank mid-run),
    :meth:`restore` at teardown.
    """

    def __init__(self, device: EmulatedDevice, root_device: torch.device, job_link_class: LinkClass,
                 hosts: bool = False, inter_host_gbit: Optional[float] = None) -> None:
        self.device = device
        self.root_device = root_device
        self.link: LinkClass = job_link_class
        self.hosts = hosts  # the job emulates hosts (NCCL's network transport between them)
        self.inter_host_gbit = inter_host_gbit  # the job's paced inter-host bandwidth
        self._saved_env: dict[str, Optional[str]] = {}
        self.green_context = GreenContextCap(root_device)
        self._depth = 0
        self.times = EmulatedTime()
        # CPU: collectives are communication, not the card's compute (see `StepSlowdown.collective_began`).
        self.step_slowdown = StepSlowdown(device.slowdown, root_device, self.times)
        self._dilation: Optional[GpuDilation] = None  # GPU time dilation (set up by `activate`)

    def apply_env(self) -> None:
        env = rank_env(self.device, self.root_device.type, self.link, self.hosts)
        for key, value in env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def activate(self) -> None:
        """Cap memory and create the green context (the CUDA device must be the current one)."""
        if self.root_device.type != "cuda":
            return
        index = self._index()
        if self.device.memory_bytes is not None:
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.device.memory_bytes / total), index)
        if self.device.num_sms is not None:
            self.green_context.set_sms(self.device.num_sms, index)
        if self.device.dilation > 1.0:
            self._dilation = GpuDilation(self.device.dilation, measure_spin_rate(torch.device("cuda", index)))

    def _index(self) -> int:
        return self.root_device.index if self.root_device.index is not None else torch.cuda.current_device()

    def throttle(self, factor: float) -> EmulatedDevice:
        """Make this rank ``factor`` times slower from its next step on (a card that throttles mid-run); returns the
        new :class:`EmulatedDevice`. Call between steps, after :meth:`activate`.

        On CUDA the steps move to a new green context with the SM count divided by ``factor`` (see
        :func:`throttled`): :meth:`work` reads the stream at every step. On CPU the slowdown is multiplied. A CPU rank
        that started unslowed had no gradient-bucket observer registered by the strategy at setup, so after a
        throttle its wait for DDP's all-reduce counts as compute: give it a slowdown above 1 from the start when
        that matters.

        cuDNN keeps the kernels it chose for the old SM count: ResNet-50 autotuned (``cudnn.benchmark``) on a whole H100
        failed on its next backward after a throttle to 64 SMs (``CUDNN_STATUS_EXECUTION_FAILED``, 2026-11-27);
        matmul-bound models (cuBLAS, GPT) slowed by the SM ratio.
        """
        if self._depth:
            raise RuntimeError("Emulator.throttle() was called inside a step: call it between steps.")
        device = throttled(self.device, factor)
        if self.root_device.type == "cuda" and device.num_sms != self.device.num_sms:
            self.green_context.set_sms(device.num_sms, self._index())
            if self._dilation is not None:
                self._dilation.restart()  # the old SM count's step times no longer say what a step takes
        self.device = device
        self.step_slowdown.factor = device.slowdown
        return device

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The green context's stream (``None`` without an SM cap)."""
        return self.green_context.stream

    @contextmanager
    def work(self) -> Iterator[None]:
        """Run the enclosed step on the capped stream, then queue its GPU dilation or sleep off the CPU slowdown.
        Re-entrant: a nested step (the training step inside the optimizer step's closure) is counted once, by the
        outermost."""
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            with self.step_slowdown.step(), self.green_context.capped_stream():
                dilation = self._dilation
                stream = torch.cuda.current_stream(self.root_device) if dilation is not None else None
                if dilation is not None:
                    dilation.begin(stream)
                yield
                if dilation is not None:
                    # Counted as a CPU rank's pause is: completed steps' GPU time, and the idle queued after this one.
                    measured, paused = dilation.end(stream)
                    self.times.compute_seconds += measured
                    self.times.slept_seconds += paused
        finally:
            self._depth -= 1

    def capped_stream(self) -> AbstractContextManager[None]:
        """Run the enclosed work on the capped stream, as a step runs, but unslowed and uncounted: a trial step then
        allocates what a step does (a stream's first matrix product allocates the kernels' workspace for it)."""
        return self.green_context.capped_stream()

    # The steps' accounting, and the hooks the strategy calls inside a step (documented on `StepSlowdown`).
    @property
    def compute_seconds(self) -> float:
        """Measured step time (CPU: thread CPU time) before the slowdown or dilation, since :meth:`reset_stats`."""
        return self.times.compute_seconds

    @property
    def slept_seconds(self) -> float:
        """Time the slowdown paused or the dilation idled after the steps, since :meth:`reset_stats`."""
        return self.times.slept_seconds

    def reset_stats(self) -> None:
        """Start counting ``compute_seconds`` / ``slept_seconds`` afresh."""
        self.times.compute_seconds = self.times.slept_seconds = 0.0

    @property
    def slows_cpu(self) -> bool:
        return self.step_slowdown.slows_cpu

    def collective_began(self) -> Optional[float]:
        return self.step_slowdown.collective_began()

    def collective_ended(self, began: Optional[float]) -> None:
        self.step_slowdown.collective_ended(began)

    def bucket_ready(self) -> None:
        self.step_slowdown.bucket_ready()

    def backward_returned(self) -> None:
        self.step_slowdown.backward_returned()

    def slowed_in_place(self) -> AbstractContextManager[None]:
        return self.step_slowdown.slowed_in_place()

    def describe(self, info: DeviceInfo) -> DeviceInfo:
        """The rank's device as the lab table should show it: emulated memory and SM count."""
        memory = self.device.memory_bytes if self.device.memory_bytes is not None else info.memory_bytes
        sms = self.device.num_sms if self.device.num_sms is not None else info.multiprocessors
        return replace(info, memory_bytes=int(memory), multiprocessors=int(sms))

    def summary(self) -> str:
        link = self.link if self.root_device.type == "cuda" else "gloo (link not emulated)"
        if self.hosts:
            link += ", NET between hosts" if self.root_device.type == "cuda" else ", hosts emulated"
        return replace(self.device, link=link, inter_host_gbit=self.inter_host_gbit).summary()  # type: ignore[arg-type]

    def restore(self) -> None:
        """Undo :meth:`apply_env` (the memory cap and green context end with the process)."""
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
