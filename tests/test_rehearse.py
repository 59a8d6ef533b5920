"""`doctor --lab`: the rehearsed plan and shares equal those of a real multi-process CPU run of the same job."""

import pytest

from lightning_hetero.observe.rehearse import honesty_check, parse_lab

CONFIG = """seed_everything: 0
model:
  class_path: tests.helpers.TinyModel
  init_args: {batch_size: 8, n: 200}
trainer:
  strategy:
    class_path: lightning_hetero.HeteroFSDPStrategy
    init_args:
      capacities: {A100: 3, "3090": 1}
"""


def test_parse_lab_names_the_flag():
    assert parse_lab("A100-80GB,RTX3090,RTX3090") == ["A100-80GB", "RTX3090", "RTX3090"]
    with pytest.raises(ValueError, match="--lab"):
        parse_lab("A100-80GB")
    with pytest.raises(ValueError, match="not a preset"):
        parse_lab("A100-80GB,GTX9999")


@pytest.mark.slow
def test_rehearsed_plan_and_shares_equal_a_real_cpu_run(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    report = honesty_check(str(config), "A100-80GB,RTX3090,RTX3090", steps=4, out_dir=str(tmp_path / "out"))
    rows = report["check"]["rows"]
    assert len(rows) == 3
    for row in rows:
        rehearsed_plan, real_plan = row["plan"]
        rehearsed_split, real_split = row["split"]
        assert rehearsed_plan == real_plan and rehearsed_plan is not None
        assert rehearsed_split == real_split and sum(rehearsed_split) == 24
    assert rows[0]["split"][0][0] > rows[1]["split"][0][1]
