"""Every relative link in the README and docs/ resolves: the file exists, and a `#anchor` names a heading of it.

Checked: README.md, docs/*.md and conf/README.md when it exists; markdown links `[text](path)`,
`[text](path#anchor)`, `[text](#anchor)` and reference definitions `[label]: path`.  Skipped: external links
(any `scheme:` such as http, https, mailto) and anything inside code (fenced blocks, `inline code`), which is
text, not a link.  A path must stay inside the repository (GitHub cannot follow `../` out of it).  Links are
read line by line, so a link whose text is broken over two lines is reported: keep each link on one line.

Anchors follow GitHub's rule for headings: the heading's text (inline markup such as backticks and link
syntax removed), lowercased, every character other than a letter, digit, space, '-' or '_' dropped, each
space turned into '-'; a repeated heading gets -1, -2, ... in order.
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from care.paths import PROJECT_ROOT

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
SPLIT = re.compile(r"^[^\[]*\]\(")  # the end of a link whose opening bracket is on an earlier line


def doc_files(root: Path) -> list[Path]:
    """The files whose links are checked."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "conf" / "README.md"]
    return [f for f in files if f.is_file()]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None and m and m.group(1).startswith(fence):
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading shows its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub("", line)
        if SPLIT.match(line):
            out.append((number, "\n"))  # not a target: reported as a split link
        targets = [m.group(1) for m in LINK.finditer(line)]
        ref = REFERENCE.match(line)
        if ref:
            targets.append(ref.group(1))
        out += [(number, t[1:-1] if t.startswith("<") else t) for t in targets]
    return out


def broken_links(path: Path, root: Path) -> list[str]:
    """'file:line: target: why' for every relative link of `path` that does not resolve."""
    bad = []
    root = root.resolve()
    for number, target in links(path):
        if target == "\n":
            bad.append(f"{path.relative_to(root)}:{number}: a link broken over two lines (keep it on one line)")
            continue
        if SCHEME.match(target):
            continue  # external: http(s), mailto, ...
        where, _, anchor = target.partition("#")
        dest = (path.parent / unquote(where)).resolve() if where else path.resolve()
        name = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.is_relative_to(root):
            bad.append(f"{name}: points outside the repository")
        elif not dest.exists():
            bad.append(f"{name}: no such file")
        elif anchor and dest.suffix == ".md" and dest.is_file() and unquote(anchor) not in anchors(dest):
            bad.append(f"{name}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return bad


@pytest.mark.parametrize("path", doc_files(PROJECT_ROOT), ids=lambda p: str(p.relative_to(PROJECT_ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path, PROJECT_ROOT) == []


def test_the_checked_files_are_there():
    names = {p.relative_to(PROJECT_ROOT).as_posix() for p in doc_files(PROJECT_ROOT)}
    assert {"README.md", "docs/README.md", "docs/design.md"} <= names


def test_github_anchor_rule():
    assert slug("Data pipeline (`python -m data_pipeline`)") == "data-pipeline-python--m-data_pipeline"
    assert slug("What `make run` does, and what it printed") == "what-make-run-does-and-what-it-printed"
    assert slug("5. The ablation (`make ablation-signals`)") == "5-the-ablation-make-ablation-signals"
    assert slug("Is a gain more than noise?") == "is-a-gain-more-than-noise"
    assert slug("See [the design](design.md)") == "see-the-design"
    assert slug("中文 标题") == "中文-标题"


def test_the_check_fails_on_broken_links(tmp_path):
    """The checker reports a missing file, a missing anchor, a path out of the repository, a reference
    definition to a missing file and a link broken over two lines; nothing inside code, nothing external."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Same\n\n## Same\n\n```\n## Not a heading\n```\n",
                                              encoding="utf-8")
    (tmp_path / "README.md").write_text("""# Title
[fine](docs/page.md) [fine](docs/page.md#a-page) [fine](docs/page.md#same-1) [fine](#title)
[fine](https://example.org/missing.md) `[code](missing.md)`
```
[in a block](missing-too.md)
```
[gone](docs/missing.md)
[no anchor](docs/page.md#not-a-heading)
[out](../outside.md)
[label]: docs/also-missing.md
[split over
two lines](docs/page.md)
""", encoding="utf-8")
    bad = broken_links(tmp_path / "README.md", tmp_path)
    assert [b.split(": ", 1)[0] for b in bad] == ["README.md:7", "README.md:8", "README.md:9", "README.md:10",
                                                  "README.md:12"]
    assert "no such file" in bad[0] and "#not-a-heading" in bad[1] and "outside the repository" in bad[2]
    assert "also-missing" in bad[3] and "broken over two lines" in bad[4]
