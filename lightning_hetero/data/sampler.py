"""Capacity-aware batch sampling: every rank takes its share of the same global batch.

All ranks draw one global order per epoch (seeded with seed + epoch, like ``DistributedSampler``, or the user's own
sampler drawn alike on every rank, see :class:`GlobalOrder`), cut it into global batches of G samples (or take a user
batch sampler's batches as the global batches), and rank r takes its slice of b_r samples of each. Every rank
therefore runs the same number of steps whatever the dataset length, and each global batch is exactly what one big
device would have seen.

The last global batch of an epoch may be partial (``drop_last=False``); it is split by the same rule. When it has
fewer samples than there are ranks, the ranks left without a sample re-read the batch's last sample as a
*padding* batch whose gradient weight is 0, so step counts still agree and no sample counts twice.

Evaluation (:class:`EvaluationBatchSampler`) splits the whole set instead of each global batch, so every sample is
evaluated exactly once in equal batch counts, with a padding step only where the set is too small for it.

With per-sample costs attached (:meth:`HeteroBatchSampler.use_costs`, e.g. sequence lengths), the schedule can cut
each global batch so every rank's summed cost rather than its sample count follows its capacity
(:meth:`~lightning_hetero.plan.shares.ShareSchedule.cut`), and the gradient weight can count costs (tokens) instead of
samples.

Shares may change between steps (live rebalancing): a change is keyed to a global-batch index, so every rank
applies it to the same batch, and the gradient weight of a step is always read off the split that produced it.
"""

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, Sampler

from lightning_hetero.plan.shares import ShareChange, ShareSchedule
from lightning_hetero.plan.split import validate_costs


class GlobalOrder(Sampler[int]):
    """The epoch's order of all dataset indices (or global batches), identical on every rank.

    Without ``source`` it is a permutation seeded with seed + epoch (or ``range`` without shuffling). With a user's
    ``source`` (any ``Sampler`` of indices, or with ``batches=True`` a batch sampler whose every batch is one global
    batch) every rank draws the source itself, once per epoch, made reproducible the way ``DistributedSampler`` is:

    - a source with ``set_epoch`` is told the epoch;
    - a source whose ``generator`` is ``None`` draws from a generator seeded with seed + epoch (restored afterwards);
    - a draw from torch's global generator is made from one seeded with seed + epoch, leaving training's RNG alone;
    - a ``generator`` the user gave is used as given (its state before each draw goes into checkpoints).

    The first iteration of each epoch compares a hash of the draw across ranks (one small collective, so iterate on
    every rank alike) and raises on every rank if they differ: such a source cannot be split.

    Example::

        order = GlobalOrder(len(dataset), shuffle=False, source=WeightedRandomSampler(weights, 1000))
        sampler = HeteroBatchSampler(order, global_batch_size=64, capacities=[3, 1], rank=0, drop_last=False)
    """

    def __init__(
        self, num_samples: int, shuffle: bool, seed: int = 0, source: Optional[Any] = None, batches: bool = False
    ) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.source = source
        self.batches = batches  # `source` yields global batches (lists of indices), not indices
        self._drawn: Optional[tuple[int, list[Any]]] = None  # (epoch, draw)
        self._verified_epoch: Optional[int] = None
        self.verify = True  # compare draws across ranks (off for an order nested in a verified batch source)
        if batches and isinstance(getattr(source, "sampler", None), GlobalOrder):
            source.sampler.verify = False
        # User generators' states (epoch, before its draw, after it), for checkpoints; and restored ones to apply.
        self._generator_states: Optional[tuple[int, list[Tensor], list[Tensor]]] = None
        self._restored: Optional[tuple[int, list[Tensor], list[Tensor]]] = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # -- drawing a user's source ----------------------------------------------------------------------------------
    def _user_generators(self) -> list[torch.Generator]:
        owners = [self.source, getattr(self.source, "sampler", None)]
        return [o.generator for o in owners if isinstance(getattr(o, "generator", None), torch.Generator)]

    def _draw(self) -> list[Any]:
        """The source's draw for the current epoch (cached: the source is drawn once per epoch)."""
        if self._drawn is not None and self._drawn[0] == self.epoch:
            return self._drawn[1]
        if self._restored is not None:  # resumed: the generators as they stood before this epoch's draw
            saved_epoch, before, after = self._restored
            self._restored = None
            for generator, saved in zip(self._user_generators(), before if self.epoch == saved_epoch else after):
                generator.set_state(saved.cpu())  # a checkpoint may have been mapped to a GPU
        before = [g.get_state() for g in self._user_generators()]
        source = self.source
        for owner in (source, getattr(source, "sampler", None)):
            if owner is not None and callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(self.epoch)
        seeded = [o for o in (source, getattr(source, "sampler", None))
                  if o is not None and hasattr(o, "generator") and o.generator is None]
        try:
            for owner in seeded:
                owner.generator = torch.Generator().manual_seed(self.seed + self.epoch)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + self.epoch)
                draw = [[int(i) for i in b] for b in source] if self.batches else [int(i) for i in source]
        finally:
            for owner in seeded:
                owner.generator = None
        self._drawn = (self.epoch, draw)
        self._generator_states = (self.epoch, before, [g.get_state() for g in self._user_generators()])
        return draw

    def _verify(self, draw: list[Any]) -> None:
        """Every rank drew the same order, or every rank raises (one all_gather of a 16-byte digest)."""
        if self._verified_epoch == self.epoch or not (dist.is_available() and dist.is_initialized()):
            return
        flat = [i for b in draw for i in b] if self.batches else draw
        digest = hashlib.sha256(torch.tensor(flat, dtype=torch.int64).numpy().tobytes())
        if self.batches:
            digest.update(torch.tensor([len(b) for b in draw], dtype=torch.int64).numpy().tobytes())
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest.hexdigest()[:32])
        self._verified_epoch = self.epoch
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            name = type(self.source).__name__
            raise RuntimeError(
                f"{name} drew a different order on rank(s) {bad} than on rank 0 in epoch {self.epoch}: it is not "
                "reproducible across ranks, so its global batches cannot be split by capacity. Give it a generator "
                f"seeded alike on every rank (`{name}(..., generator=torch.Generator().manual_seed(0))`), or leave its "
                "`generator` at None / implement `set_epoch(epoch)` so that its order depends only on seed and epoch "
                "(not on Python's or NumPy's global random state)."
            )

    def global_batches(self, global_batch_size: int, drop_last: bool) -> list[list[int]]:
        """The epoch's global batches: the source's batches, or the order cut into ``global_batch_size``."""
        if self.batches:
            draw = self._draw()
            if self.verify:
                self._verify(draw)
            return draw
        indices = list(self)
        g = global_batch_size
        batches = [indices[i : i + g] for i in range(0, len(indices), g)]
        if batches and drop_last and len(batches[-1]) < g:
            batches.pop()
        return batches

    def batch_len(self, batch_index: int, global_batch_size: int) -> int:
        """Number of real samples in global batch ``batch_index`` of the epoch."""
        if self.batches:
            draw = self._draw()
            return len(draw[batch_index]) if batch_index < len(draw) else 0
        n = len(self)
        return max(0, min(global_batch_size, n - batch_index * global_batch_size))

    def num_batches(self, global_batch_size: int, drop_last: bool) -> int:
        if self.batches:  # the draw, not `len(source)`: a bucketing sampler's length is often only an estimate
            return len(self._draw())
        n, g = len(self), global_batch_size
        return n // g if drop_last else -(-n // g)

    def __iter__(self) -> Iterator[int]:
        if self.source is not None:
            draw = self._draw()
            if self.verify:
                self._verify(draw)
            return iter([i for b in draw for i in b] if self.batches else draw)
        if not self.shuffle:
            return iter(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        if self.source is None:
            return self.num_samples
        if self.batches:
            return sum(len(b) for b in self._draw())
        return len(self.source) if hasattr(self.source, "__len__") else len(self._draw())

    # -- checkpointing (user generators advance from epoch to epoch) ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"generators": self._generator_states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next draw rewinds user generators to before the saved epoch's draw (or after it, for a later epoch)."""
        self._restored = state.get("generators")
        self._drawn = None
        self._verified_epoch = None


@dataclass(frozen=True)
class BatchShares:
    """Who trains on what in one global batch, when samples have costs: positions and summed costs per rank."""

    positions: tuple[tuple[int, ...], ...]
    costs: tuple[tuple[float, ...], ...]  # per rank, the costs of its samples in the order it trains on them


class HeteroBatchSampler(BatchSampler):
    """Yields this rank's share of every global batch.

    Example::

        order = GlobalOrder(len(dataset), shuffle=True, seed=0)
        sampler = HeteroBatchSampler(order, global_batch_size=64, capacities=[3, 1], rank=0, drop_last=False)
        loader = DataLoader(dataset, batch_sampler=sampler)  # rank 0 gets 48 of every 64 samples
    """

    def __init__(
        self,
        order: GlobalOrder,
        global_batch_size: int,
        capacities: Sequence[float],
        rank: int,
        drop_last: bool,
        caps: Optional[Sequence[int]] = None,
        schedule: Optional[ShareSchedule] = None,
    ) -> None:
        # BatchSampler.__init__ is skipped on purpose: its `batch_size` means a per-rank constant, which ours is not.
        self.sampler = order
        # The plan's schedule (a strategy's loaders), or one of its own; it refuses a global batch below the number
        # of replicas (world size, without pipelines).
        self.schedule = schedule or ShareSchedule(global_batch_size, capacities, caps, epoch=order.epoch)
        self.rank = rank
        self.drop_last = drop_last
        self.world_size = self.schedule.world_size
        self.batches_yielded = 0  # in the current epoch; the rebalancer keys changes past this
        self.start_batch = 0  # set to resume mid-epoch
        self.costs: Optional[list[float]] = None  # per dataset index (see `use_costs`)
        self.weight_by_cost = False
        self._batch_shares: dict[int, BatchShares] = {}  # of this epoch's batches drawn so far, by batch index

    def use_costs(self, costs: Sequence[float], balance: bool, weight: bool, padded: bool = False) -> None:
        """Per-index costs (e.g. tokens). ``balance``: the schedule cuts each global batch by cost
        (:meth:`~lightning_hetero.plan.shares.ShareSchedule.cut`; with ``padded``, by count times the longest cost).
        ``weight``: a step's gradient weight is this rank's summed cost over the batch's (for a loss averaged over
        tokens, not samples)."""
        values = validate_costs(costs)
        if len(values) != len(self.sampler):
            raise ValueError(f"{len(values)} sample costs for a dataset of {len(self.sampler)} samples.")
        self.costs, self.weight_by_cost = values, weight
        self.schedule.balance = ("padded_tokens" if padded else "tokens") if balance else "samples"
        self._batch_shares.clear()

    @property
    def balance_by_cost(self) -> bool:
        """Whether global batches are cut by cost (the schedule's rule) rather than by count."""
        return self.costs is not None and self.schedule.balance != "samples"

    # -- schedule (the plan's: this sampler reads it) -----------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.schedule.global_batch_size

    @global_batch_size.setter
    def global_batch_size(self, value: int) -> None:
        self.schedule.set_global_batch_size(value)

    @property
    def cap_shares(self) -> bool:
        """False when ranks run oversized shares as micro-batches instead of capping them."""
        return self.schedule.cap_shares

    @cap_shares.setter
    def cap_shares(self, value: bool) -> None:
        self.schedule.cap_shares = value

    @property
    def batch_size(self) -> int:
        """This rank's share of a full global batch under the current shares (for display and Lightning)."""
        return self.split_at(self.schedule.latest.first_batch)[self.rank]

    @property
    def capacities(self) -> tuple[float, ...]:
        return self.schedule.capacities

    def roll_schedule_to_epoch(self) -> None:
        self.schedule.roll_to_epoch(self.sampler.epoch)

    def change_at(self, batch_index: int) -> ShareChange:
        return self.schedule.change_at(batch_index)

    def split_at(self, batch_index: int, batch_len: Optional[int] = None) -> list[int]:
        """Per-rank sample counts of global batch ``batch_index`` (of ``batch_len`` samples; default: full)."""
        return self.schedule.split_at(batch_index, batch_len)

    def global_batch_len(self, batch_index: int) -> int:
        """Number of real samples in global batch ``batch_index`` of an epoch."""
        return self.sampler.batch_len(batch_index, self.global_batch_size)

    def sizes_at(self, batch_index: int, by_cost: Optional[bool] = None) -> tuple[float, float]:
        """(this rank's real samples, all ranks' samples) of global batch ``batch_index``: the gradient weight.

        Summed costs instead of counts when ``by_cost`` (default: ``weight_by_cost``); those need the batch drawn.
        """
        sizes = self.rank_sizes_at(batch_index, by_cost)
        return sizes[self.rank], sum(sizes)

    def rank_sizes_at(self, batch_index: int, by_cost: Optional[bool] = None) -> list[float]:
        """Every rank's real samples (or summed costs, as in :meth:`sizes_at`) of global batch ``batch_index``."""
        if self.costs is not None and (self.weight_by_cost if by_cost is None else by_cost):
            return [sum(c) for c in self.batch_shares(batch_index).costs]
        if self.balance_by_cost:
            return [len(p) for p in self.batch_shares(batch_index).positions]
        return list(self.split_at(batch_index, self.global_batch_len(batch_index)))

    def batch_shares(self, batch_index: int) -> BatchShares:
        """Positions and costs per rank of a global batch this epoch's iteration has drawn (costs attached)."""
        if batch_index not in self._batch_shares:
            raise RuntimeError(f"global batch {batch_index} has not been drawn from this sampler in this epoch.")
        return self._batch_shares[batch_index]

    def is_padding(self, batch_index: int) -> bool:
        """Whether this rank's batch ``batch_index`` is a padding step (no sample of its own: weight 0)."""
        return self.rank_sizes_at(batch_index, by_cost=False)[self.rank] == 0

    # -- iteration ----------------------------------------------------------------------------------------------
    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches (as one big device would see them), after ``set_epoch``."""
        return self.sampler.global_batches(self.global_batch_size, self.drop_last)

    def rank_slice(self, batch_index: int, global_batch: Sequence[int], rank: Optional[int] = None) -> list[int]:
        """The indices of ``global_batch`` that ``rank`` trains on; empty for a padding step."""
        r = self.rank if rank is None else rank
        if self.costs is None:
            split = self.split_at(batch_index, len(global_batch))
            offset = sum(split[:r])
            return list(global_batch[offset : offset + split[r]])
        shares = self._batch_shares.get(batch_index)
        if shares is None:
            shares = self._batch_shares[batch_index] = self._cut(batch_index, global_batch)
        return [global_batch[i] for i in shares.positions[r]]

    def _cut(self, batch_index: int, global_batch: Sequence[int]) -> BatchShares:
        assert self.costs is not None
        costs = [self.costs[i] for i in global_batch]
        positions = self.schedule.cut(batch_index, costs)
        return BatchShares(tuple(tuple(p) for p in positions), tuple(tuple(costs[i] for i in p) for p in positions))

    def __iter__(self) -> Iterator[list[int]]:
        self.batches_yielded = self.start_batch
        start, self.start_batch = self.start_batch, 0
        self._batch_shares.clear()
        self.roll_schedule_to_epoch()
        for k, batch in enumerate(self.global_batches()):
            if k < start:
                continue
            mine = self.rank_slice(k, batch)
            self.batches_yielded = k + 1
            # A padding step re-reads real samples (as many as a rank's least share); its gradient weight is 0.
            yield mine if mine else list(batch[-self.schedule.min_share:])

    def __len__(self) -> int:
        return self.sampler.num_batches(self.global_batch_size, self.drop_last)

    # -- checkpointing ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.sampler.epoch,
            "seed": self.sampler.seed,
            "order": self.sampler.state_dict(),
            "global_batch_size": self.global_batch_size,
            "changes": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], start_batch: int = 0) -> None:
        """Resume at global batch ``start_batch`` of the saved epoch. The saved ``changes`` are the share plan's to
        restore (:meth:`~lightning_hetero.plan.shares.SharePlan.adopt`): the sampler only reads its schedule."""
        self.sampler.set_epoch(int(state["epoch"]))
        if state.get("order") is not None:
            self.sampler.load_state_dict(state["order"])
        self.global_batch_size = int(state.get("global_batch_size", self.global_batch_size))
        self.roll_schedule_to_epoch()
        self.start_batch = start_batch


def check_training_batch(sampler: HeteroBatchSampler, loader_name: str, explicit: bool) -> None:
    """A training global batch larger than the dataset is never trained on: every epoch is one partial batch of the
    whole dataset (none with ``drop_last``). A ``ValueError`` when ``global_batch_size`` asked for it, a warning when
    it comes from the loader's ``batch_size`` × world size."""
    n, world = len(sampler.sampler), sampler.world_size
    if sampler.global_batch_size <= n:
        return
    epoch = "no batch at all" if n == 0 else (
        "no batch at all (drop_last=True)" if sampler.drop_last else f"one batch of {n}")
    if explicit:
        # Advice the next check accepts: a global batch has at least the schedule's least share per replica (a
        # rank, or a pipeline's stage ranks together; 2 for BatchNorm layers trained without sync).
        least, replicas = sampler.schedule.min_share, sampler.schedule.replica_count
        each = "rank" if replicas == world else "replica"
        lowest, per_rank = least * replicas, "one sample" if least == 1 else f"{least} samples"
        if n == 0:
            advice = f"Give {loader_name} samples."
        elif n < lowest:
            advice = (f"A global batch has at least {per_rank} per {each} ({replicas}): use more samples or fewer "
                      "ranks.")
        else:
            advice = f"Set `global_batch_size` to {n}." if n == lowest else (
                f"Set `global_batch_size` between {lowest} ({per_rank} per {each}) and {n}.")
        raise ValueError(
            f"`global_batch_size`={sampler.global_batch_size} is larger than {loader_name}'s dataset ({n} samples): "
            f"every epoch would be {epoch}. {advice}"
        )
    rank_zero_warn(
        f"lightning_hetero: the global batch ({sampler.global_batch_size} = the loader's batch_size x "
        f"{sampler.world_size} ranks) is larger than {loader_name}'s dataset ({n} samples): every epoch is {epoch}."
    )


class EvaluationBatchSampler(HeteroBatchSampler):
    """Validation, test and predict: the epoch's samples, not each global batch, are split by capacity.

    One process would evaluate K = ceil(N / G) global batches. Here rank r takes one contiguous run of n_r samples
    of the epoch's order (rank 0 the first, rank 1 the next, ...) and cuts it into K batches of near-equal size, so

    - every sample is evaluated exactly once (no sample re-read to fill a short last batch);
    - every rank runs the same K batches (FSDP gathers parameters in each forward; step-level ``sync_dist`` is a
      collective), none larger than the rank's share b_r of a full global batch (what fits its memory);
    - no batch is empty while N >= K x world size: n_r starts at (K - 1) b_r plus the rank's share of the last
      global batch, and a rank below K samples takes them from the rank that would finish last.

    With fewer samples (e.g. fewer than ranks), a rank whose batch k is empty re-reads the first sample of another
    rank's batch k as a *padding* step (:meth:`is_padding`) that the strategy counts with weight 0.

    Example::

        order = GlobalOrder(41, shuffle=False)
        sampler = EvaluationBatchSampler(order, global_batch_size=10, capacities=[3, 1], rank=1, drop_last=False)
        list(sampler)  # rank 1: [[33, 34], [35, 36], [37, 38], [39], [40]]; rank 0: 0..32 in batches of 7, 7, 7, 6, 6
    """

    def rank_totals(self) -> list[int]:
        """Every rank's number of samples of the epoch (before any padding)."""
        k, g = len(self), self.global_batch_size
        if k == 0:
            return [0] * self.world_size
        n = min(len(self.sampler), k * g)
        change = self.change_at(0)
        last = self.split_at(0, n - (k - 1) * g)
        totals = [(k - 1) * b + b_last for b, b_last in zip(self.split_at(0), last)]
        short = [r for r in range(self.world_size) if totals[r] < k]
        for r in short:
            while totals[r] < k:
                spare = [s for s in range(self.world_size) if totals[s] > k]
                if not spare:
                    return totals
                # From the rank that would finish last (ties: the higher rank), as the split rounds.
                giver = max(spare, key=lambda s: (totals[s] / change.capacities[s], s))
                totals[giver] -= 1
                totals[r] += 1
        return totals

    def rank_batches(self, rank: Optional[int] = None) -> list[tuple[int, int]]:
        """(start, length) in the epoch's order of each of ``rank``'s K batches (length 0: a padding step)."""
        r = self.rank if rank is None else rank
        totals = self.rank_totals()
        k = len(self)
        start = sum(totals[:r])
        size, extra = divmod(totals[r], k) if k else (0, 0)
        batches = []
        for j in range(k):
            length = size + (1 if j < extra else 0)
            batches.append((start, length))
            start += length
        return batches

    def is_padding(self, batch_index: int) -> bool:
        """Whether this rank's batch ``batch_index`` re-reads another rank's sample (weight 0)."""
        # Asked at every evaluation step: the batch's length alone, as rank_batches cuts it, not the rank's K batches.
        k = len(self)
        if batch_index >= k:
            return False
        size, extra = divmod(self.rank_totals()[self.rank], k)
        return size + (1 if batch_index < extra else 0) == 0

    def __iter__(self) -> Iterator[list[int]]:
        self.roll_schedule_to_epoch()
        order = [i for batch in self.global_batches() for i in batch]
        mine = self.rank_batches()
        for k, (start, length) in enumerate(mine):
            self.batches_yielded = k + 1
            if length:
                yield order[start : start + length]
                continue
            # A padding step: the first sample of the first rank that has a batch k (weight 0).
            first = next(self.rank_batches(r)[k][0] for r in range(self.world_size) if self.rank_batches(r)[k][1])
            yield [order[first]]


def for_evaluation(sampler: HeteroBatchSampler) -> HeteroBatchSampler:
    """The evaluation sampler that evaluates every sample once (:class:`EvaluationBatchSampler`) in place of
    ``sampler``; a user's batch sampler (whose batches are the global batches) keeps its per-batch split."""
    if isinstance(sampler, EvaluationBatchSampler) or sampler.sampler.batches:
        return sampler
    return EvaluationBatchSampler(sampler.sampler, global_batch_size=sampler.global_batch_size,
                                  capacities=sampler.capacities, rank=sampler.rank, drop_last=sampler.drop_last,
                                  schedule=sampler.schedule)
