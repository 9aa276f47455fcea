"""The architecture, held by tests: imports point one way (docs/design.md), and no module imports itself
back through others (an import cycle), counting imports inside functions too."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from care.paths import PROJECT_ROOT

CARE = PROJECT_ROOT / "care"


def imported_modules(source: str) -> set[str]:
    """Every module a Python source imports (absolute imports; the project uses no relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def violations(package: Path, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        for module in imported_modules(path.read_text(encoding="utf-8")):
            if module.split(".")[0] in forbidden or module.startswith(forbidden):
                out.append(f"{path.relative_to(PROJECT_ROOT)} imports {module}")
    return out


def test_the_scanner_sees_imports_at_any_depth():
    source = "import os\ndef f():\n    from data_pipeline.build import run\n    import care.training.trainer\n"
    assert imported_modules(source) == {"os", "data_pipeline.build", "care.training.trainer"}


@pytest.mark.parametrize(("package", "forbidden"), [
    ("", ("data_pipeline",)),                                            # the library never imports the stages
    ("data", ("torch", "care.models", "care.encoders", "care.retrieval", "care.evaluation", "care.training",
              "care.export", "care.tools")),
    ("models", ("care.encoders", "care.retrieval", "care.evaluation", "care.training", "care.export", "care.tools")),
    # encoders/builders makes model folders on first use: below the command lines that also call it (care.tools)
    ("encoders", ("care.retrieval", "care.evaluation", "care.training", "care.export", "care.tools")),
    ("retrieval", ("care.evaluation", "care.training", "care.export", "care.tools")),
    ("evaluation", ("care.training", "care.models", "care.export", "care.tools")),  # talks to the Encoder only
    ("export", ("care.training", "care.evaluation", "care.tools")),      # leaving the framework: above the encoders
    ("training", ("care.tools",)),                                       # validation runs evaluation task runners
    ("tools", ("care.training", "care.evaluation", "care.export")),      # command lines over encoders/builders only
])
def test_imports_point_down(package, forbidden):
    assert violations(CARE / package if package else CARE, forbidden) == []


def project_modules() -> dict[str, Path]:
    """Every module of the library, the stages and the benchmarks, by dotted name (a package by its own name)."""
    modules = {}
    for package in ("care", "data_pipeline", "bench"):
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` counts a.b, and a.b.c when c is a module)."""
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules in order, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_the_cycle_finder_finds_a_lazy_cycle():
    lazy = {"a": "from b import f\n", "b": "def g():\n    import c\n", "c": "def h():\n    from a import x\n"}
    graph = {name: imported_modules(source) & set(lazy) for name, source in lazy.items()}
    assert sorted(set(cycle(graph))) == ["a", "b", "c"]
    assert cycle({**graph, "c": set()}) is None


def test_no_import_cycles():
    assert cycle(import_graph(project_modules())) is None


def test_the_command_lines_sit_above_the_builds_they_run():
    # a tower folder is built on first use by the registry (care.encoders), so the build lives below it
    graph = import_graph(project_modules())
    assert "care.encoders.builders.towers" in graph["care.encoders.registry"]
    assert {"care.encoders.builders.me5", "care.encoders.builders.towers"} <= graph["care.tools.build_me5"] | graph[
        "care.tools.build_towers"]
