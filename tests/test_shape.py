"""No class of the package longer than ``MAX_CLASS_LINES``, and no exception: a class that grows past it holds more
than one job (the fault watchdog was one 359-line class written by two threads before it was split by job)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "lightning_hetero"
MAX_CLASS_LINES = 250


def class_lengths(source: str) -> dict[str, int]:
    """Lines of every class (nested ones too) from its ``class`` line to its last, by qualified name."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                found[name] = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_count_sees_nested_classes():
    source = "class A:\n    x = 1\n\n    class B:\n        y = 2\n\n\ndef f():\n    class C:\n        pass\n"
    assert class_lengths(source) == {"A": 5, "A.B": 2, "C": 2}


def test_no_class_is_longer_than_the_limit():
    long = {f"{path.relative_to(ROOT)}::{name}": lines
            for path in sorted((ROOT / PACKAGE).rglob("*.py"))
            for name, lines in class_lengths(path.read_text()).items() if lines > MAX_CLASS_LINES}
    assert not long, f"classes over {MAX_CLASS_LINES} lines (split them by job): {long}"
