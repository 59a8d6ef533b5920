"""Per-rank state in Lightning checkpoints, and how it carries over to a lab with a different number of ranks.

Lightning writes checkpoints from rank 0 only, but some of the strategy's state differs per rank (the sampler's
share schedule is shared, compression residuals and error-feedback buffers are not). :class:`RankStates`
gathers every rank's state into the checkpoint and hands each rank back its own on restore.

When the checkpoint was written by a different number of ranks, a part that implements ``reshard(states, rank,
world_size)`` derives this rank's state from all the saved ranks' states (shares are re-planned, error-feedback
residuals are folded into the ranks that remain); a part that does not is started fresh, with a warning.

Lightning loads a checkpoint *before* ``strategy.setup`` (before the DDP hook exists), so restored state is kept
as pending until its owner registers. The strategy saves it under ``checkpoint["lightning_hetero"]``.
"""

from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hetero._compat import collect_rng_states, set_rng_states
from lightning_hetero.view import running_strategy


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RankStates:
    """Saves ``{name: part.state_dict()}`` of every rank; restores each rank's own on resume.

    Example::

        strategy.rank_state.register("shares", controller)  # controller.load_state_dict runs now if restored
    """

    def __init__(self) -> None:
        self.parts: dict[str, Stateful] = {}
        self._pending: dict[str, Any] = {}
        self._saved: Optional[list[dict[str, Any]]] = None  # every saved rank's state, when the world size changed

    @property
    def saved_world_size(self) -> Optional[int]:
        """Ranks that wrote the restored checkpoint, when that differs from this job's (else ``None``)."""
        return None if self._saved is None else len(self._saved)

    def register(self, name: str, part: Stateful) -> None:
        """Save ``part`` in checkpoints under ``name``; load pending restored state into it now, if any."""
        self.parts[name] = part
        state = self.take(name)
        if state is not None:
            part.load_state_dict(state)

    def take(self, name: str) -> Optional[Any]:
        """Restored state for ``name`` that no registered part consumed yet (``None`` if there is none)."""
        if name in self._pending:
            return self._pending.pop(name)
        if self._saved is None or name not in self.parts:
            return None
        states = [ranks.get(name) for ranks in self._saved]
        if all(s is None for s in states):
            return None
        for ranks in self._saved:
            ranks.pop(name, None)
        rank, world = _rank_and_world()
        reshard = getattr(self.parts[name], "reshard", None)
        if reshard is None:
            rank_zero_warn(
                f"{running_strategy()}: the checkpoint's per-rank '{name}' state was written by {len(states)} ranks "
                f"and cannot be carried over to {world}; '{name}' starts fresh."
            )
            return None
        return reshard(states, rank, world)

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
        rank, world = _rank_and_world()
        if len(ranks) == world:
            self._pending, self._saved = dict(ranks[rank]), None
        else:
            self._pending, self._saved = {}, [dict(r) for r in ranks]
        for name in list(self.parts):
            state = self.take(name)
            if state is not None:
                self.parts[name].load_state_dict(state)


class RandomState:
    """This rank's random generators (torch, CUDA, Python, NumPy), restored where the interrupted run stood.

    Lightning does not checkpoint them; dropout and random augmentation in the main process depend on them. The
    restored state is applied by the strategy at the point that matches the save (:meth:`apply`): before the
    resumed epoch's data iterator is made (a resume at an epoch boundary) or at the first resumed batch.
    """

    def __init__(self) -> None:
        self._pending: Optional[dict[str, Any]] = None

    def state_dict(self) -> dict[str, Any]:
        states = collect_rng_states(include_cuda=torch.cuda.is_available() and torch.cuda.is_initialized())
        if "numpy" in states:  # plain types and tensors only: checkpoints may load with `weights_only=True`
            name, keys, pos, has_gauss, gauss = states["numpy"]
            states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)

    def reshard(self, states: list[Optional[dict[str, Any]]], rank: int, world_size: int) -> Optional[dict[str, Any]]:
        """A rank that was there before continues its own streams; a new rank keeps its seed."""
        return states[rank] if rank < len(states) else None

    def apply(self) -> None:
        """Set the restored generators now (once)."""
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        if "numpy" in state:
            name, keys, pos, has_gauss, gauss = state["numpy"]
            state["numpy"] = (name, keys.numpy().astype("uint32"), pos, has_gauss, gauss)
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            state.pop("torch.cuda", None)
        set_rng_states(state)
