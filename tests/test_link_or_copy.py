"""One link-or-copy helper (care/data/io.py link_or_copy, used per file by link_or_copy_tree and by the score
stage for its text store): a hard link where the filesystem allows it, a copy where it does not, an existing
file replaced whole, no temporary file left behind."""
from __future__ import annotations

import os

from care.data import io
from care.data.io import link_or_copy, link_or_copy_tree


def test_a_hard_link_replaces_the_target(tmp_path):
    src, dst = tmp_path / "a.jsonl", tmp_path / "out" / "a.jsonl"
    src.write_text("新\n", encoding="utf-8")
    dst.parent.mkdir()
    dst.write_text("old\n", encoding="utf-8")
    assert link_or_copy(src, dst) == dst
    assert os.path.samefile(src, dst) and dst.read_text(encoding="utf-8") == "新\n"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["a.jsonl"]


def test_a_copy_where_no_link_can_be_made(tmp_path, monkeypatch):
    def no_links(*_):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(io.os, "link", no_links)
    src = tmp_path / "a" / "w.bin"
    (src.parent / "sub").mkdir(parents=True)
    src.write_bytes(b"\x00\x01")
    (src.parent / "sub" / "x.json").write_text("{}", encoding="utf-8")
    (src.parent / "README.md").write_text("skip me", encoding="utf-8")
    out = link_or_copy_tree(src.parent, tmp_path / "b", skip=frozenset({"README.md"}))
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["sub", "sub/x.json", "w.bin"]
    assert (out / "w.bin").read_bytes() == b"\x00\x01" and not os.path.samefile(src, out / "w.bin")
