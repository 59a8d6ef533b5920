"""Per-bucket state of the compression hooks, checkpointed per parameter, and the byte counter of every hook.

DDP hands a comm hook flat buckets whose layout changes (after the first step, and again in a resumed run); the state
the hooks keep per bucket (top-k residuals and velocities, PowerSGD's error / P / Q) is saved per parameter here, so a
checkpoint lands on the right parameters in any layout.
"""

import math
from collections.abc import Sequence
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CommCounter:
    """Bytes this rank handed to collectives since the last optimizer step, by hop ("all", "intra", "inter")."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def add(self, hop: str, nbytes: int) -> None:
        self.pending[hop] = self.pending.get(hop, 0) + nbytes

    def take(self) -> dict[str, int]:
        out, self.pending = self.pending, {}
        return out


# -- per-parameter view of per-bucket state -------------------------------------------------------------------------
# Bucket parameter shapes -> (position, length) of each parameter's part of a flat state tensor.
Segments = Callable[[Sequence[torch.Size]], list[tuple[int, int]]]
# A kind of per-bucket state: the getter of its {bucket index: flat tensor} dict, its segments, and whether a
# parameter missing from restored state may start at zero (error feedback: yes; PowerSGD's P / Q: no).
StateKind = tuple[Callable[[], dict], Segments, bool]


def elementwise_segments(shapes: Sequence[torch.Size]) -> list[tuple[int, int]]:
    return [(i, math.prod(s)) for i, s in enumerate(shapes)]


class BucketStates:
    """Flat per-bucket tensors (residuals, PowerSGD error / P / Q) that checkpoint per parameter.

    DDP rebuilds its buckets after the first step, in gradient-ready order, and a resumed run starts again from the
    initial layout; a flat buffer saved in one layout would land on the wrong parameters in the other. So state is
    saved per parameter and rebuilt for whatever layout a bucket has when the hook next sees it.
    """

    def __init__(self, params: Sequence[Tensor], device: torch.device, kinds: dict[str, StateKind]) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._shapes = [p.shape for p in params]
        self._device = device
        self._kinds = kinds
        self._layouts: dict[int, tuple[int, ...]] = {}
        self._pending: dict[str, dict[int, Tensor]] = {name: {} for name in kinds}

    def observe(self, bucket: dist.GradBucket) -> None:
        """Record the bucket's layout; re-lay its state out if the layout changed or restored state waits."""
        idx = bucket.index()
        layout = tuple(self._index[id(p)] for p in bucket.parameters())
        old = self._layouts.get(idx)
        if old is not None and old != layout:
            self._split(idx, old)
        self._layouts[idx] = layout
        shapes = [self._shapes[i] for i in layout]
        for name, (get, segments, zero_fill) in self._kinds.items():
            pending = self._pending[name]
            if idx in get() or not pending:
                continue
            parts = [(layout[pos], n) for pos, n in segments(shapes)]
            present = [pending[p] for p, _ in parts if p in pending]
            if not present:
                continue
            if zero_fill or len(present) == len(parts):
                # Bucket boundaries can differ too (the first bucket is smaller until DDP rebuilds them).
                flat = [pending.pop(p).reshape(-1) if p in pending else present[0].new_zeros(n) for p, n in parts]
                get()[idx] = torch.cat(flat).to(self._device)
            else:
                # A partial P / Q is of no use: torch draws a fresh one for this bucket
                for p, _ in parts:
                    pending.pop(p, None)

    def _split(self, idx: int, layout: tuple[int, ...]) -> None:
        shapes = [self._shapes[i] for i in layout]
        for name, (get, segments, _) in self._kinds.items():
            flat = get().pop(idx, None)
            if flat is None:
                continue
            offset = 0
            for pos, n in segments(shapes):
                self._pending[name][layout[pos]] = flat[offset:offset + n].detach().clone()
                offset += n

    def state_dict(self) -> dict[str, dict[int, Tensor]]:
        out = {name: {p: t.cpu() for p, t in pending.items()} for name, pending in self._pending.items()}
        for idx, layout in self._layouts.items():
            shapes = [self._shapes[i] for i in layout]
            for name, (get, segments, _) in self._kinds.items():
                flat = get().get(idx)
                if flat is None:
                    continue
                offset = 0
                for pos, n in segments(shapes):
                    out[name][layout[pos]] = flat[offset:offset + n].detach().cpu().clone()
                    offset += n
        return out

    def load_state_dict(self, state: dict[str, dict[int, Tensor]]) -> None:
        for name, (get, _, _) in self._kinds.items():
            get().clear()
            self._pending[name] = {int(p): t for p, t in state.get(name, {}).items()}
        self._layouts.clear()

