"""What a pipeline stage rank's device holds of the model: its own stage's parameters, not the whole model.

Each parameter keeps its object (the optimizer's reference, the traced stage's attribute) and changes only its data,
in three states:

- *parked* (from set-up to the first step's split): the values in host memory, a placeholder on the device;
- *own stage* (training): this stage's parameters on the device; every other stage's is a placeholder with no
  values anywhere (the ranks that train them hold them), and no optimizer state;
- *whole* (evaluation, predict, the end of training): every parameter on the device, the others' values re-broadcast
  by the caller from the ranks that train them.

A placeholder is a one-element tensor expanded to the parameter's shape: its shape, dtype and device are all that
``torch.distributed.pipelining``'s trace reads, so the stages are traced (and re-traced for a new micro-batch size)
without the model's values on the device.

Example::

    holding = StageHolding(module, device)
    holding.park()                          # before the model goes to the device
    holding.keep_only(own_names, optimizers)  # once a trace has split the model
    holding.hold_whole()                    # before evaluation; then broadcast the others' values
"""

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def placeholder(param: Tensor, device: torch.device) -> Tensor:
    """A tensor of ``param``'s shape and dtype on ``device`` with one element of storage."""
    return torch.zeros((), dtype=param.dtype, device=device).expand(param.shape)


def _state_to(optimizer: torch.optim.Optimizer, param: Tensor, device: torch.device) -> None:
    """Move ``param``'s optimizer state to ``device``; Adam's ``step`` too where its group is fused or capturable
    (those keep it beside the parameter), else it stays on the host, where the optimizer keeps it."""
    state = optimizer.state.get(param)
    if not state:
        return
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    step_too = bool(group.get("fused") or group.get("capturable"))
    for key, value in state.items():
        if isinstance(value, Tensor) and (key != "step" or step_too):
            state[key] = value.to(device)


class StageHolding:
    """The parameters of ``module`` a stage rank's ``device`` holds (see the module's docstring)."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self._host: dict[str, Tensor] = {}  # parked: the values, in host memory
        self._released: set[str] = set()  # no values on this rank (another rank trains them)

    @property
    def parked(self) -> bool:
        return bool(self._host)

    def host_values(self) -> dict[str, Tensor]:
        """The parked parameters' values by name (e.g. to receive the job's initial model)."""
        return self._host

    def park(self) -> None:
        """Every parameter's values to host memory, a placeholder on the device."""
        for name, param in self.module.named_parameters():
            if name in self._host or name in self._released:
                continue
            self._host[name] = param.data.to("cpu")
            param.data = placeholder(param, self.device)

    @contextmanager
    def on_host(self) -> Iterator[None]:
        """Parked parameters hold their host values inside the block: an optimizer state loaded there (a resumed
        checkpoint's, every stage's) lands in host memory, as the optimizer casts state to its parameter's device."""
        params = dict(self.module.named_parameters())
        for name, values in self._host.items():
            params[name].data = values
        try:
            yield
        finally:
            for name in self._host:
                params[name].data = placeholder(params[name], self.device)

    def load_optimizer_states(self, optimizers: Sequence[torch.optim.Optimizer],
                              states: Sequence[dict[str, Any]]) -> None:
        """A parked rank's optimizer states, every stage's, into host memory: the first step's split moves this
        stage's to the device."""
        with self.on_host():
            for optimizer, state in zip(optimizers, states):
                optimizer.load_state_dict(state)

    def keep_only(self, own: Iterable[str], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """This stage's parameters (and optimizer state) on the device; every other one released, its state dropped."""
        own = set(own)
        for name, param in self.module.named_parameters():
            if name in own:
                if name in self._host:
                    param.data = self._host.pop(name).to(self.device)
                for optimizer in optimizers:
                    _state_to(optimizer, param, self.device)
            elif name not in self._released:
                self._host.pop(name, None)
                param.data = placeholder(param, self.device)
                for optimizer in optimizers:
                    optimizer.state.pop(param, None)
                self._released.add(name)

    def hold_whole(self) -> bool:
        """Every parameter on the device: parked values from host memory, released ones uninitialized. Returns
        whether any was released (its values must then be broadcast from the ranks that train it)."""
        params = dict(self.module.named_parameters())
        for name, values in self._host.items():
            params[name].data = values.to(self.device)
        self._host.clear()
        released, self._released = self._released, set()
        for name in released:
            param = params[name]
            param.data = torch.empty(param.shape, dtype=param.dtype, device=self.device)
        return bool(released)
