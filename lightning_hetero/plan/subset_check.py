"""Whether a running job would be faster without its slowest cards: the check made once the ranks' rates are
measured, and the warning it gives. It warns; it never changes the job.

The decision (:func:`slow_ranks`) is a pure function of the ranks' costs, the job and its measured (or predicted)
samples/s, through the doctor's own cost model (:func:`~lightning_hetero.plan.layout_choice.compare_layouts`): every
subset that drops the slowest class, again and again, in each layout that fits; the ranks are named when the best of
those is predicted more than ``margin`` faster than the job runs.

Example::

    >>> from lightning_hetero.plan.step_cost import RankCost, Workload
    >>> costs = [RankCost("A100", 1 / 1900), RankCost("A100", 1 / 1900), RankCost("3090", 1 / 60, 0.05),
    ...          RankCost("3090", 1 / 60, 0.05)]
    >>> found = slow_ranks(costs, Workload(param_bytes=440_000_000, global_batch=160), "ddp", rate=1536.0)
    >>> found.dropped, round(found.cost, 2)
    ((2, 3), 0.59)
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.lab.devices import is_consumer_card
from lightning_hetero.plan.layout_choice import LAYOUT_NAMES, LayoutVerdict, compare_layouts, trainer_code
from lightning_hetero.plan.profiling import ProfileResult
from lightning_hetero.plan.step_cost import LayoutPlan, RankCost, Workload, predict_step

# How much faster a subset must be predicted before the job is told: the cost model's own error on measured runs.
MARGIN = 0.05


@dataclass(frozen=True)
class SlowRanks:
    """Ranks that cost the job more than they add: the job's ``rate`` (samples/s, ``measured`` or predicted with
    every rank), the best layout ``without`` them, and a faster layout on every card where there is one."""

    dropped: tuple[int, ...]
    labels: str
    rate: float
    measured: bool
    without: LayoutVerdict
    alternative: Optional[LayoutVerdict]
    world: int

    @property
    def cost(self) -> float:
        """The fraction of the job's speed the ranks cost: 1 - rate / rate without them."""
        assert self.without.samples_per_s is not None
        return 1.0 - self.rate / self.without.samples_per_s

    def message(self, accelerator: str = "gpu") -> str:
        ranks = ", ".join(map(str, self.dropped))
        them = "them" if len(self.dropped) > 1 else "it"
        how = "measured" if self.measured else f"predicted with {them}"
        text = (f"rank{'s' if len(self.dropped) > 1 else ''} {ranks} ({self.labels}) cost this job {self.cost:.0%}: "
                f"{self.rate:.4g} samples/s {how}, {self.without.samples_per_s:.4g} predicted without {them}; drop "
                f"{them} with "
                + trainer_code(self.without.plan, self.world, accelerator).replace("\n", " and ").lstrip("# "))
        if self.alternative is not None:
            plan = self.alternative.plan
            text += (f", or use the {LAYOUT_NAMES[plan.layout]} layout on every card ("
                     f"{self.alternative.samples_per_s:.4g} samples/s predicted"
                     + (f", pipelines={plan.local_pipelines()}" if plan.pipelines else "") + ")")
        return text + ". `python -m lightning_hetero doctor --compare-layouts` compares every layout."


def slow_ranks(costs: Sequence[RankCost], job: Workload, layout: str, rate: Optional[float] = None,
               pipelines: Sequence[Sequence[int]] = (), margin: float = MARGIN) -> Optional[SlowRanks]:
    """The slowest ranks worth dropping from a job running ``layout`` (``pipelines`` for the hybrid) on every card of
    ``costs``, at ``rate`` samples/s measured (``None``: predicted by the same model); ``None`` when no subset is
    predicted more than ``margin`` faster."""
    world = len(costs)
    everyone = tuple(range(world))
    current = LayoutPlan(layout, everyone, tuple(tuple(p) for p in pipelines))
    now = rate if rate is not None else predict_step(current, costs, job).samples_per_s
    fitting = [v for v in compare_layouts(job, costs).verdicts if v.samples_per_s is not None]
    subset = next((v for v in fitting if len(v.plan.ranks) < world), None)
    if subset is None or subset.samples_per_s is None or subset.samples_per_s <= now * (1 + margin):
        return None
    # The job's own layout on those ranks where it is about as fast: a change of ranks, not of strategy as well.
    own = next((v for v in fitting if v.plan.ranks == subset.plan.ranks and v.plan.layout == layout), None)
    if own is not None and (own.samples_per_s or 0.0) * (1 + margin) >= subset.samples_per_s:
        subset = own
    dropped = tuple(r for r in everyone if r not in subset.plan.ranks)
    alternative = next((v for v in fitting if v.plan.ranks == everyone and v.plan != current
                        and (v.samples_per_s or 0.0) > now * (1 + margin)), None)
    labels = ", ".join(dict.fromkeys(costs[r].label for r in dropped))
    return SlowRanks(dropped, labels, now, rate is not None, subset, alternative, world)


def job_link(device_type: str, names: Sequence[str], emulated: Optional[str]) -> str:
    """The link class a job's traffic crosses: the emulated one; else PCIe where a consumer card is in the lab (no
    peer-to-peer), NVLink between other GPUs; CPU ranks (gloo over the host's sockets) count as Ethernet."""
    if emulated is not None and device_type == "cuda":
        return emulated
    if device_type != "cuda":
        return "ethernet"
    return "pcie" if any(is_consumer_card(n) for n in names) else "nvlink"


def check_profile(profile: ProfileResult, labels: Sequence[str], param_bytes: int, link: str,
                  accelerator: str) -> Optional[str]:
    """The warning for a data-parallel job whose ranks were profiled (each rank's forward and backward measured at
    two batch sizes; its optimizer step is not, and counts as nothing), or ``None``.

    Example::

        >>> from lightning_hetero.plan.profiling import RankProfile
        >>> fast, slow = RankProfile((8, 16), (0.010, 0.018)), RankProfile((8, 16), (0.30, 0.54))
        >>> profile = ProfileResult((fast, slow), global_batch_size=32)
        >>> check_profile(profile, ["cpu", "cpu at 1/30 speed"], 4_000_000, "ethernet", "cpu")[:40]
        'rank 1 (cpu at 1/30 speed) cost this job'
    """
    costs = [RankCost(label, per_sample, fixed, link=link, measured=True)
             for label, (fixed, per_sample) in zip(labels, (r.cost_model() for r in profile.ranks))]
    found = slow_ranks(costs, Workload(param_bytes=param_bytes, global_batch=profile.global_batch_size), "ddp")
    return None if found is None else found.message(accelerator)
