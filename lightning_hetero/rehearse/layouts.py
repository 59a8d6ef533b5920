"""Every layout of the rehearsed lab, subsets of its cards included, from what each rank measured.

Each rehearsed rank of our strategy measured its forward and backward at its batch (seconds per sample) and its
optimizer step; with the model's gradient bytes and the lab's links, the doctor's cost model
(:func:`~lightning_hetero.plan.layout_choice.compare_layouts`) predicts every layout on the whole lab and on its
fastest classes alone, and picks the fastest.

Example::

    report["layouts"] = rehearsed_layouts(hetero, lab)   # after the ranks ran; None when a rank did not
"""

from collections.abc import Sequence
from typing import Any, Optional

from lightning_hetero.lab.emulation_env import link_class_of_spec
from lightning_hetero.lab.emulation_spec import parse_emulate
from lightning_hetero.plan.layout_choice import compare_layouts, comparison_table, trainer_code, trainer_yaml
from lightning_hetero.plan.step_cost import RankCost, Workload
from lightning_hetero.rehearse.job import RankResult


def measured_costs(hetero: Sequence[RankResult], lab: Sequence[Any]) -> Optional[list[RankCost]]:
    """Each rank's measured costs: forward + backward per sample at its batch, its optimizer step over the whole
    model (a sharded rank's step over its 1/N, times N), its card's memory and link; ``None`` unless every rank ran
    with its phases timed."""
    specs = parse_emulate(list(lab)) or (None,) * len(lab)
    costs = []
    for result, spec in zip(hetero, specs):
        phases = result.phases if result.ok else None
        if phases is None or not result.batch:
            return None
        optimizer = phases.optimizer * (len(hetero) if result.memory_modes else 1)
        costs.append(RankCost(result.card, max((phases.forward + phases.backward) / result.batch, 1e-12), 0.0,
                              optimizer, result.card_memory_bytes, link_class_of_spec(spec), measured=True))
    return costs


def rehearsed_layouts(hetero: Sequence[RankResult], lab: Sequence[Any]) -> Optional[dict[str, Any]]:
    """The layouts compared from the rehearsed ranks (JSON: samples/s per layout, the pick, its Trainer arguments
    and YAML, the table as ``text``), or ``None`` where a rank did not run."""
    costs = measured_costs(hetero, lab)
    base = hetero[0] if hetero else None
    if costs is None or base is None or not base.param_bytes:
        return None
    job = Workload(param_bytes=base.param_bytes, global_batch=base.global_batch or sum(r.batch or 0 for r in hetero),
                   compute_bytes=base.compute_bytes, blocks=base.blocks or 12)
    comparison = compare_layouts(job, costs)
    pick = comparison.pick
    accelerator = "cpu" if base.device in (None, "cpu") else "gpu"
    return {"layouts": {v.key: v.samples_per_s for v in comparison.verdicts},
            "pick": None if pick is None else pick.key, "why": comparison.why,
            "trainer": None if pick is None else trainer_code(pick.plan, len(costs), accelerator),
            "yaml": None if pick is None else trainer_yaml(pick.plan, len(costs), accelerator),
            "text": comparison_table(comparison, costs, job, accelerator)}
