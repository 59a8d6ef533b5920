"""The emulated link between hosts: a pacer that holds each step until a link of ``gbit`` Gbit/s would have carried
its inter-host bytes, and the DDP comm hook that feeds it.

The exchange itself still runs at the machine's speed; pacing adds only the time a slower link would have exposed
(see ``inter_host_gbit`` in :mod:`~lightning_hetero.lab.emulation`). Works on CPU (gloo) and CUDA (NCCL).
"""

import time
from typing import Any

import torch
import torch.distributed as dist


class LinkPacer:
    """Paces one rank's traffic over the emulated link between hosts to ``gbit`` Gbit/s.

    Each transfer is recorded when it is issued (on CUDA as an event on the current stream, so its time is when the
    data was ready on the device, not when the CPU got there); :meth:`settle` (at the step's last bucket) replays
    the transfers on a link that carries one at a time, each starting when its data is ready and the link is free,
    and sleeps until the last one would have arrived. Transfers thus overlap the backward pass as on a real link, and
    what is left over is the exposed communication time. A ring collective among ``participants`` puts
    2 (P - 1) / P times the bytes a rank hands it on each link (exact for all-gather too when P = 2).

    Example::
        >>> pacer = LinkPacer(gbit=10, participants=2, device=torch.device("cuda", 0))
        >>> pacer.transfer(nbytes)  # after issuing each inter-host exchange
        >>> pacer.settle()          # after the step's last one
    """

    def __init__(self, gbit: float, participants: int, device: torch.device) -> None:
        if not gbit > 0:
            raise ValueError(f"`gbit`={gbit!r} must be positive.")
        self.bytes_per_s = gbit * 1e9 / 8
        self.factor = 2 * (participants - 1) / participants if participants > 1 else 0.0
        self.device = device
        self._pending: list[tuple[Any, int]] = []
        self._link_free = 0.0
        # Total time the pacing held steps (the exposed link time beyond the real exchange)
        self.slept_s = 0.0
        self.wire_bytes = 0.0

    def transfer(self, nbytes: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append((event, nbytes))
        else:
            self._pending.append((time.perf_counter(), nbytes))

    def settle(self) -> float:
        """Hold this rank until the recorded transfers would have crossed the link; returns the seconds slept."""
        if not self._pending:
            return 0.0
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            now = time.perf_counter()
            ready = [now - event.elapsed_time(end) / 1e3 for event, _ in self._pending]
        else:
            now = time.perf_counter()
            ready = [t for t, _ in self._pending]
        free = self._link_free
        for t, (_, nbytes) in zip(ready, self._pending):
            wire = nbytes * self.factor
            self.wire_bytes += wire
            free = max(t, free) + wire / self.bytes_per_s
        self._pending.clear()
        self._link_free = free
        delay = free - now
        if delay <= 0:
            return 0.0
        time.sleep(delay)
        self.slept_s += delay
        return delay


class PacedState:
    """An averaging comm hook whose traffic crosses the paced link (a flat exchange over all ranks).

    ``counter``: a :class:`~lightning_hetero.grad.bucket_state.CommCounter` the inner hook adds its bytes to
    (``None``: the bucket's full size is what crosses).
    """

    def __init__(self, inner_hook: Any, inner_state: Any, pacer: LinkPacer, counter: Any = None) -> None:
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.pacer = pacer
        self.counter = counter


def paced_hook(state: PacedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run the inner averaging hook, then account its bytes on the paced link (and settle at the last bucket).

    Example::
        >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> ddp_model.register_comm_hook(PacedState(allreduce_hook, None, LinkPacer(10, 2, device)), paced_hook)
    """
    before = sum(state.counter.pending.values()) if state.counter is not None else 0
    fut = state.inner_hook(state.inner_state, bucket)
    if state.counter is not None:
        nbytes = sum(state.counter.pending.values()) - before
    else:
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
    state.pacer.transfer(nbytes)
    if bucket.is_last():
        state.pacer.settle()
    return fut
