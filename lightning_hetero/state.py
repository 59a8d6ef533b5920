"""Per-rank state in Lightning checkpoints.

Lightning writes checkpoints from rank 0 only, but some of the strategy's state differs per rank (the sampler's
share schedule is shared, compression residuals and error-feedback buffers are not). :class:`RankStateCallback`
gathers every rank's state into the checkpoint and hands each rank back its own on restore.

Lightning restores callbacks *before* ``strategy.setup`` (before the DDP hook exists), so restored state is kept
as pending until its owner asks for it with :meth:`RankStateCallback.take`.
"""

from typing import Any, Optional, Protocol

import torch.distributed as dist
from lightning.pytorch import Callback


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RankStateCallback(Callback):
    """Saves ``{name: part.state_dict()}`` of every rank; restores each rank's own on resume."""

    def __init__(self) -> None:
        self.parts: dict[str, Stateful] = {}
        self._pending: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        return "lightning_hetero.RankState"

    def register(self, name: str, part: Stateful) -> None:
        """Save ``part`` in checkpoints under ``name``; load pending restored state into it now, if any."""
        self.parts[name] = part
        if name in self._pending:
            part.load_state_dict(self._pending.pop(name))

    def take(self, name: str) -> Optional[Any]:
        """Restored state for ``name`` that no registered part consumed yet (``None`` if there is none)."""
        return self._pending.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        local = {name: part.state_dict() for name, part in self.parts.items()}
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [local]}
        # Every rank runs `Trainer.save_checkpoint` (Lightning requires it), so this collective is safe.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return {"ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks", [])
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank >= len(ranks):
            raise ValueError(
                f"the checkpoint holds per-rank state for {len(ranks)} ranks but this is rank {rank}; "
                "resume with the same number of ranks."
            )
        self._pending = dict(ranks[rank])
        for name in list(self._pending):
            if name in self.parts:
                self.parts[name].load_state_dict(self._pending.pop(name))
