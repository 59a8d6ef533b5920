"""Which layout a lab should train in, on which of its cards: data parallel, sharded or hybrid, on the whole lab or
on its fastest classes alone, from the model's size, the cards and their costs.

Memory first: what each layout keeps on a card (``state`` = parameters + gradients + optimizer state: Adam 2
parameter-sized slots, SGD with momentum 1) against its memory less a headroom for activations:

- data parallel: ``state`` on every card;
- sharded: ``state / N`` on every card (plus the gathered block and the activations, not counted here);
- hybrid: ``state`` on the data-parallel cards; a stage card its stage's part of it, in proportion to its speed,
  plus the whole model's weights (``parameter_bytes``), which it holds while it evaluates.

Then speed: each layout that fits gets its predicted samples/s from :mod:`~lightning_hetero.plan.step_cost`
(per-sample compute at each card's rate, the step's traffic at the link's bandwidth, each rank's optimizer step and
collectives' latency), on every subset that drops the slowest class, again and again. The pick is the fastest (of
layouts within 3 % of it, the simplest: data parallel, then sharded, then hybrid); its Trainer arguments and
LightningCLI YAML are :func:`trainer_code` and :func:`trainer_yaml`.

Where the costs come from published rates (:func:`assumed_costs`: ``6 × parameters × tokens`` FLOPs a sample at a
fraction of the card's published rate, the optimizer step at its published memory bandwidth) the rates are
estimates; the rehearsal (``doctor --model CONFIG --lab``) and a profiled run measure them.

Example::

    >>> cards = [Card("A100", 80 * 2**30, 312), Card("A100", 80 * 2**30, 312),
    ...          Card("3090", 24 * 2**30, 71, "pcie"), Card("3090", 24 * 2**30, 71, "pcie")]
    >>> job = Workload(param_bytes=2_000_000_000 * 4, global_batch=64)  # a 2B-parameter model, AdamW, fp32
    >>> compare_layouts(job, assumed_costs(cards, job, tokens=512)).pick.key
    'fsdp:0,1,2,3'
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.plan.layout import gib, stage_bytes
from lightning_hetero.plan.step_cost import (
    LINK_GBYTES,
    LayoutPlan,
    RankCost,
    StepPrediction,
    Workload,
    candidate_plans,
    pipeline_cost,
    predict_step,
)

# Published memory bandwidth (GB/s) by a name's part: an optimizer step streams the state through it.
MEMORY_GBYTES = {"H100": 3350.0, "A100-80GB": 2039.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0, "L40S": 864.0,
                 "A6000": 768.0, "4090": 1008.0, "3090": 936.0, "A10": 600.0, "V100": 900.0, "T4": 320.0}
# Bytes an AdamW-like step moves per parameter-sized slot: read parameter, gradient and each slot, write parameter
# and each slot (fp32).
STEP_BYTES_PER_SLOT = 8
# The fraction of a card's published rate a training step reaches where nothing was measured.
ASSUMED_MFU = 0.4
# Layouts predicted within this fraction of the fastest count as tied (the simplest is picked).
TIE = 0.03
# Each layout's strategy by its import path (a config's `class_path`; the Trainer line uses the class name).
STRATEGY_PATHS = {"ddp": "lightning_hetero.HeteroDDPStrategy", "fsdp": "lightning_hetero.HeteroFSDPStrategy",
                  "hybrid": "lightning_hetero.HeteroHybridStrategy"}
LAYOUT_NAMES = {"ddp": "data parallel", "fsdp": "sharded", "hybrid": "hybrid"}


@dataclass(frozen=True)
class Card:
    """One card of the lab: its name, memory (bytes), published speed (TFLOP/s) and link class."""

    name: str
    memory_bytes: int
    speed: float
    link: str = "nvlink"


@dataclass(frozen=True)
class LayoutVerdict:
    """One layout on some of the lab's cards: bytes it keeps on each, whether each fits, its predicted step (``None``
    where it does not fit) and a note."""

    plan: LayoutPlan
    needed_bytes: tuple[int, ...]
    fits: tuple[bool, ...]
    prediction: Optional[StepPrediction]
    note: str

    @property
    def key(self) -> str:
        return self.plan.key

    @property
    def samples_per_s(self) -> Optional[float]:
        return None if self.prediction is None else self.prediction.samples_per_s


@dataclass(frozen=True)
class LayoutComparison:
    verdicts: tuple[LayoutVerdict, ...]  # fastest first, then those that do not fit
    pick: Optional[LayoutVerdict]
    why: str
    measured: tuple[str, ...]  # what the rates were computed from
    assumed: tuple[str, ...]


def optimizer_seconds(card_name: str, param_bytes: int, optimizer_slots: int) -> float:
    """An optimizer step's seconds on ``card_name`` at its published memory bandwidth (1000 GB/s where unknown)."""
    bandwidth = next((v for k, v in sorted(MEMORY_GBYTES.items(), key=lambda kv: -len(kv[0])) if k in card_name),
                     1000.0)
    return param_bytes / 4 * STEP_BYTES_PER_SLOT * (2 + optimizer_slots) / (bandwidth * 1e9)


def assumed_costs(cards: Sequence[Card], job: Workload, tokens: int, mfu: float = ASSUMED_MFU) -> list[RankCost]:
    """Each card's costs from published figures: ``6 × parameters × tokens`` FLOPs a sample at ``mfu`` of its
    published rate, no fixed cost in the forward and backward, the optimizer step at its memory bandwidth."""
    if tokens < 1 or not 0 < mfu <= 1:
        raise ValueError(f"`tokens`={tokens!r} must be >= 1 and `mfu`={mfu!r} in (0, 1].")
    flops = 6 * job.param_bytes / 4 * tokens
    return [RankCost(c.name, flops / (c.speed * 1e12 * mfu), 0.0,
                     optimizer_seconds(c.name, job.param_bytes, job.optimizer_slots), c.memory_bytes, c.link)
            for c in cards]


def needed_bytes(plan: LayoutPlan, costs: Sequence[RankCost], job: Workload) -> list[int]:
    """Bytes ``plan`` keeps on each of its ranks (see the module's docstring)."""
    state = job.param_bytes * (2 + job.optimizer_slots)
    if plan.layout == "fsdp":
        return [-(-state // len(plan.ranks))] * len(plan.ranks)
    parts: dict[int, float] = {}
    for pipeline in plan.pipelines:
        parts.update(zip(pipeline, pipeline_cost([costs[r] for r in pipeline])[2]))
    return [stage_bytes(state, job.param_bytes, parts[r]) if r in parts else state for r in plan.ranks]


def compare_layouts(job: Workload, costs: Sequence[RankCost], headroom: float = 0.1) -> LayoutComparison:
    """Every layout on the lab and on its fastest classes alone (:func:`~lightning_hetero.plan.step_cost.
    candidate_plans`): what each keeps per card, whether it fits, its predicted step and samples/s; the pick is the
    fastest that fits."""
    if len(costs) < 1 or not 0 <= headroom < 1:
        raise ValueError("compare_layouts needs one or more cards and 0 <= `headroom` < 1.")
    verdicts = []
    for plan in candidate_plans(costs):
        needed = needed_bytes(plan, costs, job)
        budgets = [None if costs[r].memory_bytes is None else int(costs[r].memory_bytes * (1 - headroom))
                   for r in plan.ranks]
        fits = tuple(b is None or n <= b for n, b in zip(needed, budgets))
        note = f"{LAYOUT_NAMES[plan.layout]} on {describe(plan.ranks, costs)}" + (
            f", pipelines {plan.local_pipelines()}" if plan.pipelines else "")
        if not all(fits):
            note = (f"ranks {[r for r, f in zip(plan.ranks, fits) if not f]} cannot hold "
                    f"{gib(max(n for n, f in zip(needed, fits) if not f))}")
        verdicts.append(LayoutVerdict(plan, tuple(needed), fits, predict_step(plan, costs, job) if all(fits)
                                      else None, note))
    verdicts.sort(key=lambda v: -(v.samples_per_s or -1.0))
    measured = tuple(sorted({c.label for c in costs if c.measured}))
    assumed = tuple(sorted({c.label for c in costs if not c.measured}))
    pick = verdicts[0] if verdicts[0].prediction is not None else None
    if pick is not None:
        # Near-ties go to the simpler layout: the model leaves out a sharded step's per-block overheads.
        close = [v for v in verdicts if (v.samples_per_s or 0.0) >= (1 - TIE) * (pick.samples_per_s or 0.0)]
        pick = min(close, key=lambda v: (list(STRATEGY_PATHS).index(v.plan.layout), -(v.samples_per_s or 0.0)))
    if pick is None:
        state = job.param_bytes * (2 + job.optimizer_slots)
        return LayoutComparison(tuple(verdicts), None, f"no layout fits: a replica's state is {gib(state)}. Offload "
                                "(the sharded strategy's `memory`), bf16 optimizer state or larger cards.", measured,
                                assumed)
    runner_up = next((v for v in verdicts if v.prediction is not None and v is not pick), None)
    if pick is not verdicts[0]:
        why = (f"{pick.samples_per_s:.4g} samples/s predicted, within {TIE:.0%} of {verdicts[0].key} "
               f"({verdicts[0].samples_per_s:.4g}) and the simpler layout")
    else:
        why = f"the fastest predicted ({pick.samples_per_s:.4g} samples/s"
        why += f"; next {runner_up.key} at {runner_up.samples_per_s:.4g})" if runner_up else ")"
    if len(pick.plan.ranks) < len(costs):
        dropped = [r for r in range(len(costs)) if r not in pick.plan.ranks]
        why += f": ranks {dropped} ({describe(dropped, costs)}) cost more than they add"
    return LayoutComparison(tuple(verdicts), pick, why, measured, assumed)


def describe(ranks: Sequence[int], costs: Sequence[RankCost]) -> str:
    """``"2x A100, 1x 3090"``: the cards of ``ranks`` by label."""
    labels = [costs[r].label for r in ranks]
    return ", ".join(f"{labels.count(name)}x {name}" for name in dict.fromkeys(labels))


def strategy_init_args(plan: LayoutPlan) -> dict[str, object]:
    """The strategy's arguments for ``plan``: measured shares (the sharded layout's time is the slowest rank's, so
    it keeps its default), and the hybrid layout's pipelines in the subset's rank numbers."""
    if plan.layout == "hybrid":
        return {"pipelines": plan.local_pipelines(), "capacities": "profile"}
    return {"capacities": "profile"} if plan.layout == "ddp" else {}


def visible_devices(plan: LayoutPlan, world: int) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for a subset (``None``: every card)."""
    return None if len(plan.ranks) == world else ",".join(map(str, plan.ranks))


def trainer_code(plan: LayoutPlan, world: int, accelerator: str = "gpu") -> str:
    """The Python that runs ``plan`` on a lab of ``world`` cards.

    Example::

        >>> print(trainer_code(LayoutPlan("ddp", (0, 1)), world=4))
        # CUDA_VISIBLE_DEVICES=0,1 (ranks 0, 1 of the lab; the others left out)
        Trainer(accelerator="gpu", devices=2, strategy=HeteroDDPStrategy(capacities="profile"))
    """
    args = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in strategy_init_args(plan).items())
    visible = visible_devices(plan, world)
    head = f"# CUDA_VISIBLE_DEVICES={visible} (ranks {', '.join(map(str, plan.ranks))} of the lab; the others left " \
           "out)\n" if visible and accelerator == "gpu" else ""
    return (head + f'Trainer(accelerator="{accelerator}", devices={len(plan.ranks)}, '
            f"strategy={STRATEGY_PATHS[plan.layout].rsplit('.', 1)[1]}({args}))")


def trainer_yaml(plan: LayoutPlan, world: int, accelerator: str = "gpu") -> str:
    """The LightningCLI ``trainer:`` section that runs ``plan`` (see :func:`trainer_code`)."""
    visible = visible_devices(plan, world)
    lines = [f"# CUDA_VISIBLE_DEVICES={visible}"] if visible and accelerator == "gpu" else []
    lines += ["trainer:", f"  accelerator: {accelerator}", f"  devices: {len(plan.ranks)}", "  strategy:",
              f"    class_path: {STRATEGY_PATHS[plan.layout]}"]
    init_args = strategy_init_args(plan)
    if init_args:
        lines.append("    init_args:")
        lines += [f"      {k}: {v}" for k, v in init_args.items()]
    return "\n".join(lines)


def comparison_table(comparison: LayoutComparison, costs: Sequence[RankCost], job: Workload,
                     accelerator: str = "gpu") -> str:
    """The comparison as text: one row per layout (samples/s, step parts, traffic, memory per card), the inputs,
    then the pick, its Trainer arguments and its YAML."""
    rows = [("layout", "samples/s", "step ms", "compute", "comm exposed", "fixed", "traffic/rank", "link",
             "per card")]
    for v in comparison.verdicts:
        p = v.prediction
        per_card = ", ".join(gib(n) + ("" if f else " (no)") for n, f in zip(v.needed_bytes, v.fits))
        if p is None:
            rows.append((v.key, "-", "-", "-", "-", "-", "-", "-", f"{per_card}: {v.note}"))
            continue
        rows.append((v.key, f"{p.samples_per_s:.1f}", f"{p.step_s * 1e3:.1f}", f"{p.compute_s * 1e3:.1f}",
                     f"{p.exposed_s * 1e3:.1f} of {p.comm_s * 1e3:.1f}", f"{p.fixed_s * 1e3:.1f}",
                     gib(p.traffic_bytes), p.link, per_card))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"  card [{r}] {c.label}: {c.rate:.4g} samples/s (forward + backward), optimizer step "
              f"{c.optimizer_s * 1e3:.3g} ms, " + (f"{gib(c.memory_bytes)}, " if c.memory_bytes else "") + c.link
              for r, c in enumerate(costs)]
    links = sorted({c.link for c in costs}, key=list(LINK_GBYTES).index)
    lines.append(f"job: {gib(job.param_bytes)} of gradients, global batch {job.global_batch}, "
                 f"{job.optimizer_slots} optimizer slots, links " + ", ".join(
                     f"{k} {job.link_gbytes or LINK_GBYTES[k]:g} GB/s" for k in links))
    if comparison.measured:
        lines.append(f"measured: per-sample costs of {', '.join(comparison.measured)}")
    if comparison.assumed:
        lines.append(f"assumed: costs of {', '.join(comparison.assumed)} from published rates; link bandwidth and "
                     "latency per class" + ("" if job.link_gbytes else " (not measured)"))
    if comparison.pick is None:
        lines.append(f"pick: none: {comparison.why}")
        return "\n".join(lines)
    plan = comparison.pick.plan
    lines += [f"pick: {plan.key}: {comparison.why}", "", trainer_code(plan, len(costs), accelerator), "",
              trainer_yaml(plan, len(costs), accelerator)]
    return "\n".join(lines)
