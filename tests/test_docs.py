"""The API reference keeps up with the package: every public module has its ``:::`` line on its subpackage's page,
and every name the package exports has its row on the top-level page (``mkdocs build --strict`` then checks that
each of those references resolves)."""

import os
import pkgutil
import re

import lightning_hetero

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))
API = os.path.join(ROOT, "docs", "api")


def _api_pages() -> str:
    return "\n".join(open(os.path.join(API, name), encoding="utf-8").read() for name in sorted(os.listdir(API)))


def public_modules() -> set[str]:
    """Every module and subpackage under ``lightning_hetero`` without a ``_``-prefixed part."""
    names = {info.name for info in pkgutil.walk_packages(lightning_hetero.__path__, "lightning_hetero.")}
    return {name for name in names if not any(part.startswith("_") for part in name.split("."))}


def test_every_public_module_has_its_reference_line() -> None:
    documented = set(re.findall(r"^::: (lightning_hetero[\w.]*)\s*$", _api_pages(), flags=re.MULTILINE))
    modules = public_modules()
    assert "lightning_hetero.strategies.ddp" in modules and "lightning_hetero._compat" not in modules
    missing = sorted(modules - documented)
    assert not missing, f"add a `::: NAME` line to docs/api/<package>.md for each of {missing}"
    assert not any("._" in name for name in documented), "private modules stay out of the reference"


def test_every_exported_name_has_its_row() -> None:
    index = open(os.path.join(API, "index.md"), encoding="utf-8").read()
    listed = set(re.findall(r"^\| \[`(\w+)`\]\[lightning_hetero\.", index, flags=re.MULTILINE))
    # the user-facing API is exported (internals are not: they are reached through their modules)
    assert {"HeteroDDPStrategy", "HeteroFSDPStrategy", "PeriodicSync", "Profiling", "Resilience"} <= set(lightning_hetero.__all__)
    missing = sorted(set(lightning_hetero.__all__) - listed)
    assert not missing, f"add a row to docs/api/index.md for each of {missing}"


def test_every_file_path_in_the_docs_exists() -> None:
    """A moved module or test leaves no stale path in the pages, the README or the scripts that run tests."""
    pages = os.path.join(ROOT, "docs")
    texts = [os.path.join(pages, name) for name in os.listdir(pages) if name.endswith(".md")]
    texts += [os.path.join(ROOT, name) for name in ("README.md", ".ci/run", "benchmarks/run_all_gpu.sh")]
    named = set()
    for path in texts:
        text = open(path, encoding="utf-8").read()
        # Paths from the repository root only (module paths inside the package are written without the prefix).
        named |= set(re.findall(r"(?<![\w/.])((?:lightning_hetero|tests)/[\w/]+\.py)\b", text))
    assert "tests/test_equivalence.py" in named
    missing = sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"the docs name files that do not exist: {missing}"
