"""The architecture, held by tests: imports point one way (README, "Design")."""
from __future__ import annotations

import ast
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
    ("data", ("torch", "care.models", "care.encoders", "care.retrieval", "care.evaluation", "care.training")),
    ("models", ("care.encoders", "care.retrieval", "care.evaluation", "care.training")),
    ("encoders", ("care.retrieval", "care.evaluation", "care.training")),
    ("retrieval", ("care.evaluation", "care.training")),
    ("evaluation", ("care.training", "care.models", "care.export")),     # evaluation talks to the Encoder only
    ("export", ("care.training", "care.evaluation", "care.tools")),      # leaving the framework: above the encoders
])
def test_imports_point_down(package, forbidden):
    assert violations(CARE / package if package else CARE, forbidden) == []
