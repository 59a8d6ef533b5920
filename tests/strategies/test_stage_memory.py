"""What a stage rank's device holds: its stage's parameters and optimizer state (the step count where Adam wants it)."""

import pytest
import torch
from torch import nn

from lightning_hetero.strategies.stage_memory import StageHolding


@pytest.mark.parametrize(("options", "step_device"), [({}, "cpu"), ({"capturable": True}, "meta"),
                                                      ({"fused": True}, "meta")])
def test_kept_stage_state_follows_the_parameter(options, step_device):
    """A resumed state loaded in host memory moves to the device with its stage; Adam's ``step`` too where the
    group is fused or capturable (their step runs beside the parameter), else it stays on the host."""
    module = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(module.parameters(), **options)
    for p in module.parameters():
        optimizer.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    holding = StageHolding(module, torch.device("meta"))
    holding.keep_only(["weight", "bias"], [optimizer])
    for p in module.parameters():
        state = optimizer.state[p]
        assert state["exp_avg"].device.type == "meta" and state["step"].device.type == step_device
