"""Which layout a lab should train in: data parallel, sharded or hybrid, from the model's size and the cards.

A decision from four facts, before anything runs: the model's parameter bytes, its optimizer's state (parameter-sized
slots: Adam 2, SGD with momentum 1), each card's memory and its speed (any unit proportional to its samples/s, e.g.
its published TFLOP/s). What each layout keeps on a card (``state`` = parameters + gradients + optimizer state):

- data parallel: ``state`` on every card; rate Σ speeds;
- sharded: ``state / N`` on every card (plus the gathered block and the activations, not counted here); rate at most
  Σ speeds: its all-gathers and reduce-scatters cross the links at every block, which this estimate leaves out;
- hybrid: ``state`` on the cards that hold it, the others paired into pipelines
  (:func:`~lightning_hetero.plan.layout.choose_pipelines`), a stage's part in proportion to its card's speed, plus
  the whole model's weights (``parameter_bytes``) that a stage rank holds while it evaluates; a
  pipeline of S cards runs at S × its slowest card's speed × m / (m + S - 1), the GPipe bubble of m = 2S
  micro-batches.

The pick: data parallel when it fits (the least traffic and the highest rate), else the higher rate of the sharded and
the hybrid layouts that fit (the sharded one wherever both fit: its rate is every card's speed, a pipeline's is its
slowest card's less the bubble); each card's memory less a headroom for activations. The traffic is left out of both
rates: the hybrid layout's exchange (one all-reduce per stage) moves about as many bytes as data parallelism's, the
sharded layout's gathers and scatters about half as many again, and on one host with a PCIe-class link the sharded
layout measured the faster (a 1.63B GPT on two A100-class and two 3090-class cards: 53.6 against 28.2 samples/s,
``benchmarks/RESULTS.md``). Where the cards span hosts on a slow link, every block's gathers cross it: measure both.

Example::

    >>> cards = [Card("A100", 80 * 2**30, 312), Card("A100", 80 * 2**30, 312), Card("3090", 24 * 2**30, 71),
    ...          Card("3090", 24 * 2**30, 71)]
    >>> compare_layouts(2_000_000_000 * 4, 2, cards).pick   # a 2B-parameter model, AdamW, fp32
    'sharded'
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.plan.layout import choose_pipelines, gib, stage_bytes


@dataclass(frozen=True)
class Card:
    """One card of the lab: its name, memory (bytes) and speed (relative samples/s)."""

    name: str
    memory_bytes: int
    speed: float


@dataclass(frozen=True)
class LayoutVerdict:
    """One layout on the lab: bytes it keeps on each card, whether each fits, its predicted rate (the cards' speed
    unit; ``None`` where it does not fit) and a note."""

    layout: str
    needed_bytes: tuple[int, ...]
    fits: tuple[bool, ...]
    rate: Optional[float]
    note: str


@dataclass(frozen=True)
class LayoutComparison:
    verdicts: tuple[LayoutVerdict, ...]
    pick: Optional[str]
    why: str


def _verdict(layout: str, needed: Sequence[int], budgets: Sequence[int], rate: float, note: str) -> LayoutVerdict:
    fits = tuple(n <= b for n, b in zip(needed, budgets))
    if not all(fits):
        note = f"ranks {[r for r, f in enumerate(fits) if not f]} cannot hold {gib(max(needed))}"
    return LayoutVerdict(layout, tuple(int(n) for n in needed), fits, rate if all(fits) else None, note)


def compare_layouts(parameter_bytes: int, optimizer_slots: int, cards: Sequence[Card],
                    headroom: float = 0.1) -> LayoutComparison:
    """Data parallel, sharded and hybrid on ``cards``: what each keeps per card, whether it fits, its rate, and the
    pick with its reason (see the module's docstring)."""
    if parameter_bytes <= 0 or optimizer_slots < 0 or len(cards) < 2 or not 0 <= headroom < 1:
        raise ValueError("compare_layouts needs positive `parameter_bytes`, `optimizer_slots` >= 0, two or more "
                         "cards and 0 <= `headroom` < 1.")
    state = parameter_bytes * (2 + optimizer_slots)
    budgets = [int(c.memory_bytes * (1 - headroom)) for c in cards]
    speeds = [c.speed for c in cards]
    total = sum(speeds)
    verdicts = [
        _verdict("data parallel", [state] * len(cards), budgets, total, "the whole model on every card"),
        _verdict("sharded", [-(-state // len(cards))] * len(cards), budgets, total,
                 "1/N of the state per card; the rate leaves out the per-block traffic"),
    ]
    try:
        choice = choose_pipelines(budgets, speeds, state, weight_bytes=parameter_bytes)
    except ValueError as err:
        # No pipeline to form (every card holds a replica: data parallel), or none that fits.
        fits = tuple(state <= b for b in budgets)
        verdicts.append(LayoutVerdict("hybrid", (state,) * len(cards), fits, None, str(err)))
    else:
        needed, rate = [state] * len(cards), 0.0
        staged = {r for p in choice.pipelines for r in p}
        rate = sum(speeds[r] for r in range(len(cards)) if r not in staged)
        for pipeline in choice.pipelines:
            stages, weight = len(pipeline), sum(speeds[r] for r in pipeline)
            for r in pipeline:
                needed[r] = stage_bytes(state, parameter_bytes, speeds[r] / weight)
            rate += stages * min(speeds[r] for r in pipeline) * (2 * stages) / (3 * stages - 1)
        verdicts.append(_verdict("hybrid", needed, budgets, rate,
                                 f"pipelines {[list(p) for p in choice.pipelines]}; the rest data-parallel"))
    fitting = {v.layout: v for v in verdicts if v.rate is not None}
    if "data parallel" in fitting:
        return LayoutComparison(tuple(verdicts), "data parallel", "every card holds the whole model, its gradients "
                                "and optimizer state: the least traffic and the highest rate.")
    if "hybrid" in fitting and "sharded" in fitting:
        # Every card at its speed against a pipeline at its slowest card's less the bubble: the sharded rate is the
        # higher whenever both fit.
        return LayoutComparison(tuple(verdicts), "sharded", "both fit; the sharded layout has the higher rate "
                                f"({fitting['sharded'].rate:.4g} against {fitting['hybrid'].rate:.4g}; a pipeline "
                                "runs at its slowest card's speed less the bubble). Traffic is left out of both: on "
                                "one host the sharded layout measured the faster; across hosts on a slow link its "
                                "gathers cross it at every block, the hybrid's stage exchange once a step: measure "
                                "both.")
    if "hybrid" in fitting:
        return LayoutComparison(tuple(verdicts), "hybrid", "some cards cannot hold a replica or a shard, but "
                                "pipelines of them can hold a stage.")
    if "sharded" in fitting:
        return LayoutComparison(tuple(verdicts), "sharded", "only sharding fits the model on every card.")
    return LayoutComparison(tuple(verdicts), None, f"no layout fits: a replica's state is {gib(state)}; the "
                            f"cards may fill {[gib(b) for b in budgets]}. Offload (the sharded strategy's "
                            "`memory`), bf16 optimizer state or larger cards.")


def comparison_table(comparison: LayoutComparison, cards: Sequence[Card]) -> str:
    """The comparison as text: one row per layout (bytes per card, fits, rate), then the pick and why."""
    rows = [f"{'layout':<14} {'per card':<40} {'rate':>8}  note (rate: in the cards' speed unit)"]
    for v in comparison.verdicts:
        per_card = ", ".join(gib(n) + ("" if f else " (no)") for n, f in zip(v.needed_bytes, v.fits))
        rate = "-" if v.rate is None else f"{v.rate:.4g}"
        rows.append(f"{v.layout:<14} {per_card:<40} {rate:>8}  {v.note}")
    rows.append(f"cards: {', '.join(f'{c.name} ({gib(c.memory_bytes)}, speed {c.speed:.4g})' for c in cards)}")
    rows.append(f"pick: {comparison.pick or 'none'}: {comparison.why}")
    return "\n".join(rows)
