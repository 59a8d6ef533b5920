"""A share of the host GPU's SMs for one rank's steps: a CUDA green context and the stream its kernels run on.

Only kernels launched on the green context's stream are capped, so the strategy runs every step with that stream as
the current stream (see :mod:`lightning_hetero.lab.emulation`). A throttle moves the steps to a new green context;
the old one is kept alive until the cap itself goes, since work queued on its stream must finish first.

Example::
    >>> cap = GreenContextCap(torch.device("cuda", 0))
    >>> cap.set_sms(32, device_id=0)
    >>> with cap.capped_stream():
    ...     training_step()   # on 32 SMs
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch


class GreenContextCap:
    """The green context (and its stream) that caps one rank's steps; none until :meth:`set_sms`."""

    def __init__(self, root_device: torch.device) -> None:
        self.root_device = root_device
        self.context: Any = None
        self.stream: Optional[torch.cuda.Stream] = None
        self.retired: list[Any] = []  # green contexts replaced by `set_sms`, kept alive (see there)

    def set_sms(self, num_sms: Optional[int], device_id: int) -> None:
        """Run the next steps on ``num_sms`` SMs of CUDA device ``device_id`` (``None``: all, on the current stream)."""
        if self.context is not None:
            # Work queued on the old green context's stream must finish before that context may go; kept
            # referenced, it is destroyed with the cap.
            torch.cuda.synchronize(self.root_device)
            self.retired.append(self.context)
        if num_sms is None:
            self.context = self.stream = None
            return
        from torch.cuda.green_contexts import GreenContext

        self.context = GreenContext.create(num_sms=num_sms, device_id=device_id)
        self.stream = self.context.Stream()

    @contextmanager
    def capped_stream(self) -> Iterator[None]:
        """Run the enclosed work on the green context's stream (the current stream without a cap), ordered after
        what the current stream queued before and before what it queues after."""
        stream = self.stream
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
