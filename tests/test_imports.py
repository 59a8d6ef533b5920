"""No import cycles between the package's modules (module-level and function-level imports alike).

A cycle hidden behind a lazy import still ties two modules together: neither can be read, tested or split alone.
Imports under ``if TYPE_CHECKING:`` do not run and are not counted.
"""

import ast
import pathlib
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "lightning_hetero"

def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its body."""
    found: set[str] = set()

    def resolve(name: str) -> Optional[str]:
        # `from a.b import c` may name a module (a.b.c) or an attribute of a.b.
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    found.add(resolve(alias.name) or alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith(PACKAGE):
                for alias in node.names:
                    target = resolve(f"{base}.{alias.name}")
                    if target is not None:
                        found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    known = set(files)
    return {name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_sees_lazy_and_relative_imports():
    """The parser finds a function-level import, a relative one, and skips TYPE_CHECKING blocks."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .b import x\n"
        "if TYPE_CHECKING:\n    from lightning_hetero.c import y\n"
        "def f():\n    import lightning_hetero.d\n"
    )
    known = {"lightning_hetero.a", "lightning_hetero.b", "lightning_hetero.c", "lightning_hetero.d"}
    assert _imports(ast.parse(source), "lightning_hetero.a", False, known) == {"lightning_hetero.b",
                                                                               "lightning_hetero.d"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles between modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_config_imports_no_other_layer():
    """The options are the bottom layer: every subpackage reads them, they read none."""
    graph = import_graph()
    assert graph["lightning_hetero.config"] <= {"lightning_hetero._compat"}, graph["lightning_hetero.config"]


def test_plan_does_not_import_data():
    """The data path reads the share plan; the plan never reaches into the data path."""
    graph = import_graph()
    reaching = {(m, t) for m, ts in graph.items() if m.startswith("lightning_hetero.plan.") for t in ts
                if t.startswith("lightning_hetero.data.")}
    assert not reaching, reaching


def test_grad_does_not_import_data():
    """The gradient layer sits below the data path: the step state that reads both lives with the strategies."""
    graph = import_graph()
    reaching = {(m, t) for m, ts in graph.items() if m.startswith("lightning_hetero.grad.") for t in ts
                if t.startswith("lightning_hetero.data.")}
    assert not reaching, reaching


def test_compression_configs_import_no_hook_or_runtime():
    """The user's compression configs are plain data: the hooks and the runtime read them, never the reverse."""
    graph = import_graph()
    assert graph["lightning_hetero.grad.compression_config"] <= {"lightning_hetero.config"}, graph[
        "lightning_hetero.grad.compression_config"]


# The layers from the bottom up: a module imports modules of its own layer and of the layers below, never above, and
# no import is excused. The package root's modules first (the options, the strategy list, the rule language, the
# strategy view, the private-API adapter); the lab (devices, the process group: its rendezvous and its teardown);
# resilience (the fault watchdog, checkpoint files, pre-emption), which the loader split and the step use; the share
# plan (the model's blocks included); the package itself (""); the commands on top: the command line and the
# rehearsal, which read every layer and which nothing below them imports.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"_compat", "config", "registry", "rules", "view"}),
    frozenset({"lab"}),
    frozenset({"resilience"}),
    frozenset({"plan"}),
    frozenset({"observe"}),
    frozenset({"data"}),
    frozenset({"grad"}),
    frozenset({"strategies"}),
    frozenset({""}),
    frozenset({"__main__", "rehearse"}),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a module's subpackage (or of a root module, or of the package itself)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise KeyError(f"{module}: its subpackage {name!r} has no place in LAYERS; add it where it belongs")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a module imports from a layer above its own."""
    return sorted((m, t) for m, ts in graph.items() for t in ts if layer_of(t) > layer_of(m))


def test_the_layer_check_sees_an_upward_import():
    graph = {"lightning_hetero.lab.a": {"lightning_hetero.plan.b", "lightning_hetero.config"},
             "lightning_hetero.plan.b": {"lightning_hetero.lab.a"}, "lightning_hetero": {"lightning_hetero.plan.b"}}
    assert upward_imports(graph) == [("lightning_hetero.lab.a", "lightning_hetero.plan.b")]


def test_subpackages_import_downwards_only():
    """Subpackages form one-way layers: no subpackage-level cycle, no exception."""
    upward = upward_imports(import_graph())
    assert not upward, "imports from a higher layer: " + "; ".join(f"{m} -> {t}" for m, t in upward)
