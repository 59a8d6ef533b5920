"""`doctor --lab` for the hybrid layout on one GPU: the lab's three ranks run together on it (gloo, each in its own
process capped as its card; a pipeline's activations pass through host memory), and each rank's peak is its own
process's allocator peak under its card's cap. A stage rank holds its stage alone, well under the data-parallel
replica's peak; a stage card capped too small runs out of memory and is named, and the rehearsal does not fail.

    python -m pytest -q -s tests/gpu/test_gpu_rehearse_hybrid.py
    REHEARSE_CHECK_OUT=DIR python -m pytest ...   # keep each rehearsal.log/.json/.png in DIR/fits and DIR/oom
"""

import os
from typing import Any

import pytest

from lightning_hetero.plan.memory import GIB
from lightning_hetero.rehearse.command import rehearse
from lightning_hetero.rehearse.job import RankResult
from lightning_hetero.rehearse.together import format_together

pytestmark = pytest.mark.gpu  # one CUDA device: the lab's ranks share it

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "rehearse_hybrid.yaml")  # a 350M GPT (untied head), bf16-mixed, AdamW
LABS = {
    "fits": "A100-40GB,RTX3090,RTX3090",
    # The last stage's card capped at 1 GiB: less than its stage's parameters.
    "oom": '["A100-40GB", "RTX3090", {"preset": "RTX3090", "memory_gib": 1}]',
}


def _rehearsed(case: str, tmp_path: Any, monkeypatch: Any) -> tuple[dict[str, Any], list[RankResult]]:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    keep = os.environ.get("REHEARSE_CHECK_OUT")
    report = rehearse(CONFIG, LABS[case], steps=5, out_dir=os.path.join(keep, case) if keep else str(tmp_path),
                      timeout=240)
    return report, [RankResult(**r) for r in report["hetero"]]


def test_each_rank_of_the_hybrid_layout_peaks_under_its_card(tmp_path: Any, monkeypatch: Any) -> None:
    report, ranks = _rehearsed("fits", tmp_path, monkeypatch)
    assert report["failed"] is None and all(r.ok for r in ranks), [r.error for r in ranks]
    assert [(r.stage, r.pipelines, r.share) for r in ranks] == [(None, [[1, 2]], 0.5), (0, [[1, 2]], 0.5),
                                                                (1, [[1, 2]], 0.5)]
    assert [r.micro_batches for r in ranks] == [None, 3, 3]
    for r in ranks:
        assert r.peak_allocated_bytes is not None and 0 < r.peak_allocated_bytes <= r.card_memory_bytes, r
    # A stage holds about half the parameters, gradients and AdamW state, and half the layers' activations.
    replica = ranks[0].peak_allocated_bytes
    assert all(r.peak_allocated_bytes < 0.8 * replica for r in ranks[1:]), [r.peak_allocated_bytes / GIB for r in ranks]
    assert "Memory: every rank fits its card" in format_together(report)


def test_a_stage_card_too_small_is_named_as_out_of_memory(tmp_path: Any, monkeypatch: Any) -> None:
    report, ranks = _rehearsed("oom", tmp_path, monkeypatch)
    assert ranks[2].oom, [r.error for r in ranks]
    assert report["failed"] is None  # running out of memory on a card is the rehearsal's answer
    assert "OUT OF MEMORY: rank 2 (RTX3090" in format_together(report)
