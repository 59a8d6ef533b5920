"""Messages that are true: the shared modules never hard-code a strategy's name in what users read, the emulation
warning names the running strategy and only what applies to its device type, and the unused-parameter hint names
this strategy's own argument."""

import ast
import re
import pathlib

import pytest
import torch

import lightning_hetero
from lightning_hetero import HeteroDDPStrategy, HeteroFSDPStrategy
from lightning_hetero.lab.emulation import lab_warning
from lightning_hetero.view import name_running_strategy, running_strategy

PACKAGE = pathlib.Path(lightning_hetero.__file__).parent
STRATEGY_NAMES = ("HeteroDDPStrategy", "HeteroFSDPStrategy")
# A strategy's own module may name itself; the package's __init__ registers both.
OWN_NAME = {"strategies/ddp.py": "HeteroDDPStrategy", "strategies/fsdp.py": "HeteroFSDPStrategy"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (documentation, not messages)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _hard_coded_names(source: str, where: str, allowed: set[str]) -> list[str]:
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            # An import path (a config's `class_path`) names a class, not the running strategy.
            if re.fullmatch(r"lightning_hetero\.\w+", node.value):
                continue
            for name in STRATEGY_NAMES:
                if name in node.value and name not in allowed:
                    hits.append(f"{where}:{node.lineno}: {node.value[:80]!r}")
    return hits


def test_shared_modules_name_no_strategy_in_their_strings() -> None:
    """Every string literal outside docstrings (messages, warnings, errors, f-string parts) in the shared modules
    names the running strategy through ``running_strategy()`` / ``type(strategy).__name__``, never a fixed one."""
    hits = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "__init__.py":
            continue
        hits += _hard_coded_names(path.read_text(), rel, {OWN_NAME[rel]} if rel in OWN_NAME else set())
    assert not hits, "hard-coded strategy names in user-facing strings:\n" + "\n".join(hits)


def test_the_check_finds_a_hard_coded_name() -> None:
    """The check above can fail: a message naming a strategy is found, a docstring naming it is not, and a
    strategy's own module may name itself only."""
    source = (
        '"""HeteroDDPStrategy in a docstring is documentation."""\n'
        'def f(n):\n'
        '    """HeteroFSDPStrategy too."""\n'
        '    raise ValueError(f"HeteroDDPStrategy: {n} ranks")\n'
        'HINT = "use HeteroFSDPStrategy(...)"\n'
    )
    assert sorted(h.split(":")[1] for h in _hard_coded_names(source, "x.py", set())) == ["4", "5"]
    assert [h.split(":")[1] for h in _hard_coded_names(source, "x.py", {"HeteroDDPStrategy"})] == ["5"]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_emulation_warning_names_the_strategy_and_only_what_applies(device_type: str) -> None:
    said = lab_warning("HeteroFSDPStrategy", device_type, ["slowdown 3.00x, gloo (link not emulated)", "real device"])
    assert said.startswith("HeteroFSDPStrategy is EMULATING") and "HeteroDDPStrategy" not in said
    assert "rank 0: slowdown 3.00x" in said and "rank 1: real device" in said
    if device_type == "cpu":
        assert "green-context" not in said and "NCCL" not in said and "SM" not in said
        assert "slowdown" in said and "CPU" in said
    else:
        assert "green-context" in said and "NCCL" in said


def test_running_strategy_is_the_one_set_up() -> None:
    fsdp = HeteroFSDPStrategy(capacities=[1, 1])
    name_running_strategy(fsdp)
    assert running_strategy() == "HeteroFSDPStrategy"
    name_running_strategy(HeteroDDPStrategy(capacities=[1, 1]))
    assert running_strategy() == "HeteroDDPStrategy"


def test_unused_parameter_error_names_this_strategy_and_its_argument() -> None:
    """torch's reducer error (what a parameter without gradient raises on the next step) gets a hint that keeps this
    strategy: ``HeteroDDPStrategy(ddp_kwargs={"find_unused_parameters": True})``, not Lightning's ``DDPStrategy``."""
    strategy = HeteroDDPStrategy(capacities=[1, 1], parallel_devices=[torch.device("cpu")] * 2, accelerator="cpu")
    error = RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
        "that your module has parameters that were not used in producing loss."
    )
    strategy.on_exception(error)
    said = str(error)
    assert 'HeteroDDPStrategy(ddp_kwargs={"find_unused_parameters": True})' in said
    assert "DDPStrategy(find_unused_parameters" not in said
    # The argument named exists and is accepted.
    HeteroDDPStrategy(capacities=[1, 1], ddp_kwargs={"find_unused_parameters": True})
    other = RuntimeError("something else")
    strategy.on_exception(other)
    assert str(other) == "something else"


def test_sharded_blocks_return_no_view_so_fsdp2_does_not_warn(tmp_path) -> None:
    """The strategy's sharding (each ``nn.Linear`` its own unit when the model has no ``ModuleList``) on a 3-D input:
    ``nn.Linear`` returns a view there, which FSDP2 warns about ("returned a view tensor"); the blocks return a copy
    instead, with the same gradients as the unsharded model."""
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hetero.grad.sharding import shard_module
    from lightning_hetero.plan.blocks import default_blocks

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        reference.load_state_dict(model.state_dict())
        shard_module(model, init_device_mesh("cpu", (1,)), default_blocks(model), checkpoint=False, offload=False)
        x = torch.randn(4, 3, 8)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model(x).sum().backward()
        assert not [w for w in said if "view tensor" in str(w.message)], [str(w.message) for w in said]
        reference(x).sum().backward()
        for sharded, plain in zip(model.parameters(), reference.parameters()):
            assert torch.equal(sharded.grad.full_tensor(), plain.grad)
    finally:
        dist.destroy_process_group()
