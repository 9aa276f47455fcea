"""Every test file is listed in this map (tests/README.md), so a newcomer finds the test of a module."""
from __future__ import annotations

import re

from care.paths import PROJECT_ROOT


def test_every_test_file_is_in_the_map():
    tests = PROJECT_ROOT / "tests"
    listed = set(re.findall(r"\]\((test_\w+\.py)\)", (tests / "README.md").read_text(encoding="utf-8")))
    files = {p.name for p in tests.glob("test_*.py")}
    assert files - listed == set(), "add these to tests/README.md"
    assert listed - files == set(), "tests/README.md lists files that do not exist"
