"""Every citation of a section points somewhere: in code, configs, sweeps, the Makefile, tests and docs, each
`README "<section>"`, `docs/<page>.md "<section>"` (a comma after the file allowed) names a heading of that file,
and each `docs/<page>.md s.N` (or `s.N-M`) a numbered heading `N.` of it (docs/README.md: section numbers
never change).  A citation may be broken over two comment lines.  The reference is the cited file's own
markdown headings, read here outside fenced code; a heading is named by its whole text, or by its text up to
the first `:`, `,` or ` (` (`docs/training.md "CPU memory"` names "CPU memory: glibc's malloc keeps ...")."""
from __future__ import annotations

import re
from pathlib import Path

from care.paths import PROJECT_ROOT

SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".md", ".cfg", ".sh", ".txt"}
SKIPPED_DIRS = {"outputs", "multirun", "wandb", "__pycache__"}
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
# What a comment line starts with, dropped so that a citation broken over two lines reads as one.
COMMENT = re.compile(r"^\s*(?:#+|//|\*|\"\"\"|''')?\s*")
# README "X" (the project's README, not tests/README.md) and docs/<page>.md "X"; `<...>` is a placeholder.
NAMED = re.compile(r"(?<![\w/.-])(README(?:\.md)?|docs/[\w./-]+?\.md),?\s+[\"“]([^\"”<]{1,120})[\"”]")
NUMBERED = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md),?\s+s\.\s?(\d+[a-z]?)(?:-(\d+))?")


def source_files(root: Path) -> list[Path]:
    """Every text file of the project that may cite (hidden, built and output folders skipped; this file's
    examples are not citations)."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        hidden = any(p.startswith(".") or p in SKIPPED_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1])
        if hidden or rel == Path(__file__).relative_to(PROJECT_ROOT):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name == "Makefile"):
            files.append(path)
    return files


def joined(text: str) -> tuple[str, list[int]]:
    """The text with each line's comment marker dropped and lines joined by one space, and where each line
    starts in it (for line numbers)."""
    starts, parts, at = [], [], 0
    for line in text.split("\n"):
        starts.append(at)
        stripped = COMMENT.sub("", line, count=1).rstrip()
        parts.append(stripped)
        at += len(stripped) + 1
    return " ".join(parts), starts


def citations(path: Path) -> list[tuple[int, str, str]]:
    """(line, cited file relative to the project, section) of every citation in a file: a name, or `s.N`."""
    text, starts = joined(path.read_text(encoding="utf-8", errors="replace"))

    def line_of(pos: int) -> int:
        return next(i for i in range(len(starts), 0, -1) if starts[i - 1] <= pos)

    found = [(line_of(m.start()), "README.md" if m.group(1).startswith("README") else m.group(1),
              " ".join(m.group(2).replace("`", "").split())) for m in NAMED.finditer(text)]
    for m in NUMBERED.finditer(text):
        first, last = m.group(2), m.group(3)
        numbers = [first] if not last else [str(n) for n in range(int(first), int(last) + 1)]
        found += [(line_of(m.start()), m.group(1), f"s.{n}") for n in numbers]
    return sorted(found)


def headings(path: Path) -> set[str]:
    """The names a file's headings answer to: the whole text (inline code and links shown as text), the text up
    to the first `:`, `,` or ` (`, and `s.N` for a heading numbered `N.`."""
    names, fence = set(), None
    for line in path.read_text(encoding="utf-8").split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0]
        elif fence is not None and m and m.group(1)[0] == fence:
            fence = None
        elif fence is None and (h := HEADING.match(line)):
            text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", h.group(1)).replace("`", "").strip()
            names |= {text, re.split(r":|,| \(", text, maxsplit=1)[0].strip()}
            if num := re.match(r"(\d+[a-z]?)\.\s", text):
                names.add(f"s.{num.group(1)}")
    return names


def broken(root: Path) -> list[str]:
    """`file:line: cited -> section` for every citation whose file or section does not exist."""
    out, cache = [], {}
    for path in source_files(root):
        for line, cited, section in citations(path):
            target = root / cited
            if cited not in cache:
                cache[cited] = headings(target) if target.is_file() else set()
            if section not in cache[cited]:
                out.append(f"{path.relative_to(root)}:{line}: {cited} \"{section}\"")
    return out


def test_every_cited_section_exists():
    missing = broken(PROJECT_ROOT)
    assert not missing, f"{len(missing)} citations name no section of the file they cite:\n" + "\n".join(missing)


def test_the_checker_sees_each_style(tmp_path):
    """The reader itself on a small project: a citation of each style, found and checked, and a broken one of each
    style reported (the reference is the headings written here)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# p\n## Scale\n```\n## Not a heading\n```\n", encoding="utf-8")
    (tmp_path / "docs" / "a.md").write_text("# a\n## CPU memory: why (`x.py`)\n## 3. Three\n", encoding="utf-8")
    (tmp_path / "code.py").write_text(
        '# README "Scale", docs/a.md, "CPU memory" and docs/a.md s.3 hold; README "Gone" and\n'
        '# docs/a.md "Not there", docs/a.md s.2-3, README "Not a heading" and this one over two lines: docs/a.md,\n'
        '# "Missing too"; tests/README.md "Other file" and docs/design.md, "<section>" are not citations here.\n',
        encoding="utf-8")
    assert broken(tmp_path) == ['code.py:1: README.md "Gone"', 'code.py:2: README.md "Not a heading"',
                                'code.py:2: docs/a.md "Missing too"', 'code.py:2: docs/a.md "Not there"',
                                'code.py:2: docs/a.md "s.2"']


DURATION = re.compile(r"\d+(?:\.\d+)?(?:-\d+)?\s*min(?:utes)?(?:\s+\d+\s*s\b)?|\b\d+\s*s\b")


def section(text: str, name: str) -> str:
    """A README section's text, from its `## name` heading to the next `## `."""
    return text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]


def test_the_test_time_is_stated_once():
    """The measured time of `make test` is stated in one place, README "Tests and benchmarks" (one figure, in
    the paragraph on `make test`); the README's quick start, tests/README.md and the Makefile's `test` target
    point there instead of giving a number of their own, so that no two of them disagree."""
    readme = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = section(readme, "Tests and benchmarks").strip().split("\n\n")[0]
    figures = DURATION.findall(paragraph.split("`make bench`")[0])
    assert len(figures) == 1, f'README "Tests and benchmarks" states the test time {len(figures)} times: {figures}'
    quick = [line for line in section(readme, "Quick start").split("\n") if "`make test`" in line]
    makefile = (PROJECT_ROOT / "Makefile").read_text(encoding="utf-8").split("\ntest:")[0].rsplit("\n\n", 1)[1]
    tests_map = (PROJECT_ROOT / "tests" / "README.md").read_text(encoding="utf-8").split("\n\n")[1]
    for where, text in (("README's quick start", "\n".join(quick)), ("the Makefile's test target", makefile),
                        ("tests/README.md", tests_map)):
        assert not DURATION.findall(text), f"{where} states a test time of its own: {DURATION.findall(text)}"
        pointer = "Tests and benchmarks" in " ".join(text.split())
        assert pointer, f'{where} does not point at README "Tests and benchmarks"'
