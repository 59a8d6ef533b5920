"""The emulator of one rank: it applies an :class:`~lightning_hetero.lab.emulated_device.EmulatedDevice` and runs the
rank's steps under it (green-context stream, memory cap, time dilation, CPU slowdown, throttle).

On CPU there are no SMs: a profile's ``slowdown`` makes the rank pause ``(slowdown - 1) ×`` the CPU time its
training thread spent in each step (Lightning's launchers give each CPU rank cores / ranks intra-op threads; with
more than one, work on the other threads is not counted). CPU time, not wall time: a rank blocked waiting for a
slower rank's all-reduce would otherwise sleep for that wait too, and slowed ranks would inflate each other. The CPU
that collectives inside the step burn (the strategy's weighted ``reduce``; DDP's wait for the gradient all-reduce
after the last bucket) is left out too: a slower card computes slower, its communication is not slowed. The
pause sleeps except for its last millisecond, which is busy-waited: a core that slept comes back cold and slow, and
that would be multiplied by the slowdown again (a 3x rank measured 5-6x on a millisecond step).

A rank can slow down mid-run (a card that throttles): ``Emulator.throttle(factor)`` between two steps divides its SM
count by ``factor`` (rounded to the granularity; a new green context) or multiplies its CPU slowdown.

Example::
    >>> emulator = Emulator(resolve(EmulationSpec(slowdown=3.0), cpu_host), torch.device("cpu"), "nvlink")
    >>> with emulator.work():
    ...     training_step()
"""

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional

import torch

from lightning_hetero.lab.devices import CAPABILITY_OVERRIDE_ENV, HOST_OVERRIDE_ENV, NAME_OVERRIDE_ENV, DeviceInfo
from lightning_hetero.lab.dilation import GpuDilation, measure_spin_rate
from lightning_hetero.lab.emulated_device import EmulatedDevice, throttled
from lightning_hetero.lab.emulation_env import link_env, nccl_host_id
from lightning_hetero.lab.presets import LinkClass


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
        self._green: Any = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._retired: list[Any] = []  # green contexts replaced by `throttle`, kept alive (see there)
        self._depth = 0
        self.compute_seconds = 0.0  # measured step time (CPU: thread CPU time) before the slowdown
        self.slept_seconds = 0.0
        # CPU: collectives are communication, not the card's compute (see `collective_began`).
        self._cpu_slowed = device.slowdown > 1.0 and root_device.type != "cuda"
        self._collective_cpu = 0.0  # this step's CPU seconds inside collectives
        self._bucket_cpu: Optional[float] = None  # the clock when the last gradient bucket went to the comm hook
        self._dilation: Optional[GpuDilation] = None  # GPU time dilation (set up by `activate`)

    def apply_env(self) -> None:
        env = {NAME_OVERRIDE_ENV: self.device.name}
        if self.device.capability is not None:
            env[CAPABILITY_OVERRIDE_ENV] = f"{self.device.capability[0]}.{self.device.capability[1]}"
        if self.root_device.type == "cuda":
            env.update(link_env(self.link))
        if self.hosts:
            env[HOST_OVERRIDE_ENV] = self.device.host or socket.gethostname()
            env["NCCL_HOSTID"] = nccl_host_id(env[HOST_OVERRIDE_ENV])
            env["NCCL_IB_DISABLE"] = "1"  # between emulated hosts: TCP sockets, as on an Ethernet lab
            if "NCCL_SOCKET_IFNAME" not in os.environ:
                env["NCCL_SOCKET_IFNAME"] = "lo"  # the emulated hosts share this machine: loopback always exists
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
            self._cap_sms(self.device.num_sms)
        if self.device.dilation > 1.0:
            self._dilation = GpuDilation(self.device.dilation, measure_spin_rate(torch.device("cuda", index)))

    def _index(self) -> int:
        return self.root_device.index if self.root_device.index is not None else torch.cuda.current_device()

    def _cap_sms(self, num_sms: int) -> None:
        from torch.cuda.green_contexts import GreenContext

        self._green = GreenContext.create(num_sms=num_sms, device_id=self._index())
        self._stream = self._green.Stream()

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
            if self._green is not None:
                # Work queued on the old green context's stream must finish before that context may go; kept
                # referenced, it is destroyed with the emulator.
                torch.cuda.synchronize(self.root_device)
                self._retired.append(self._green)
            if device.num_sms is None:
                self._green = self._stream = None
            else:
                self._cap_sms(device.num_sms)
            if self._dilation is not None:
                self._dilation.restart()  # the old SM count's step times no longer say what a step takes
        self.device = device
        self._cpu_slowed = device.slowdown > 1.0 and self.root_device.type != "cuda"
        return device

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The green context's stream (``None`` without an SM cap)."""
        return self._stream

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
            slowed = self.device.slowdown > 1.0
            start = self._clock() if slowed else 0.0  # the clock synchronizes on CUDA: only when it is needed
            self._collective_cpu, self._bucket_cpu = 0.0, None
            with self.capped_stream():
                dilation = self._dilation
                stream = torch.cuda.current_stream(self.root_device) if dilation is not None else None
                if dilation is not None:
                    dilation.begin(stream)
                yield
                if dilation is not None:
                    # Counted as a CPU rank's pause is: completed steps' GPU time, and the idle queued after this one.
                    measured, paused = dilation.end(stream)
                    self.compute_seconds += measured
                    self.slept_seconds += paused
            if slowed:
                elapsed = max(self._clock() - start - self._collective_cpu, 0.0)
                self.compute_seconds += elapsed
                # Every step pauses what it owes. A late wake-up (a busy host) is host noise, as on any rank; credited
                # against later steps it would leave those unslowed, and the fastest of a few profiled steps would
                # then time the emulated card at full speed.
                begin = time.perf_counter()
                _pause((self.device.slowdown - 1.0) * elapsed)
                self.slept_seconds += time.perf_counter() - begin
        finally:
            self._depth -= 1

    @contextmanager
    def capped_stream(self) -> Iterator[None]:
        """Run the enclosed work on the capped stream, as a step runs, but unslowed and uncounted: a trial step then
        allocates what a step does (a stream's first matrix product allocates the kernels' workspace for it)."""
        stream = self._stream
        if stream is None:
            yield
            return
        outer = torch.cuda.current_stream(self.root_device)
        stream.wait_stream(outer)  # the batch was copied on the outer stream
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            outer.wait_stream(stream)  # what follows on the outer stream reads the step's results

    @property
    def slows_cpu(self) -> bool:
        """This rank pauses after each step in proportion to its CPU time (a CPU rank with ``slowdown`` > 1)."""
        return self._cpu_slowed

    def collective_began(self) -> Optional[float]:
        """Before a collective issued inside a step: the CPU clock when a CPU slowdown must leave it out, else
        ``None``. Pass it to :meth:`collective_ended`. A slower card does not slow its collectives (on GPUs NCCL runs
        outside the green context too), yet gloo burns CPU in each one (70-170 us per small all-reduce on a 2-core VM,
        the more the further apart the ranks arrive): slowed, that would turn every shift in arrival times into
        pause."""
        return time.thread_time() if self._cpu_slowed and self._depth else None

    def collective_ended(self, began: Optional[float]) -> None:
        if began is not None:
            self._collective_cpu += time.thread_time() - began

    def bucket_ready(self) -> None:
        """A gradient bucket went to the comm hook (a bucket observer of the strategy's weighting hook): the
        backward's compute is done when the last one does; what follows until :meth:`backward_returned` is DDP
        waiting for the gradient all-reduce."""
        if self._cpu_slowed and self._depth:
            self._bucket_cpu = time.thread_time()

    def backward_returned(self) -> None:
        if self._bucket_cpu is not None:
            self._collective_cpu += time.thread_time() - self._bucket_cpu
            self._bucket_cpu = None

    @contextmanager
    def slowed_in_place(self) -> Iterator[None]:
        """Inside a step: pause for the enclosed piece of work as it ends rather than at the step's end, where a
        pipeline stage's neighbour waits for each micro-batch of a slower card. Its CPU time, pause included, then
        leaves the step's own count."""
        if not (self._cpu_slowed and self._depth):
            yield
            return
        begin = time.thread_time()
        yield
        elapsed = time.thread_time() - begin
        self.compute_seconds += elapsed
        paused = time.perf_counter()
        _pause((self.device.slowdown - 1.0) * elapsed)
        self.slept_seconds += time.perf_counter() - paused
        # Paid here: the step's end pauses for the rest of its CPU time only (as for a collective's).
        self._collective_cpu += time.thread_time() - begin

    def reset_stats(self) -> None:
        """Start counting ``compute_seconds`` / ``slept_seconds`` afresh."""
        self.compute_seconds = self.slept_seconds = 0.0

    def _clock(self) -> float:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)
            return time.perf_counter()
        # CPU time of the training thread: a blocking wait for a slower rank's all-reduce is not compute, so slowed
        # ranks do not inflate each other.
        return time.thread_time()

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


# The last stretch of every emulated pause is a busy wait: a core that sleeps between steps comes back with cold
# caches and a low clock (measured on a 2-core VM: a 0.25 ms MLP step took 0.5-0.9 ms right after a sleep), which the
# slowdown would multiply again; a pause of a millisecond or less is busy-waited entirely.
_BUSY_WAIT_S = 0.001


def _pause(seconds: float) -> None:
    """Let ``seconds`` pass, sleeping all but the last millisecond."""
    deadline = time.perf_counter() + seconds
    if seconds > _BUSY_WAIT_S:
        time.sleep(seconds - _BUSY_WAIT_S)
    while time.perf_counter() < deadline:
        pass


