"""What a kill inside an atomic write leaves (care/data/io.py: atomic_open's `.NAME.<random>.tmp`, atomic_folder's
`.NAME.<random>`) is removed by the next start of the stage that writes NAME (care/data/stage_start.py), with a
note saying how many and how much, as training's start does (care/training/checkpoint.py); files of other
names, a user's own, stay.  The leftovers are made by real writes killed with os._exit in a child process."""
from __future__ import annotations

import subprocess
import sys

from test_stage_runs import ENV, PLAIN, dedup_cfg

from care.data.io import leftovers, write_jsonl
from care.data.stage_start import interrupted_writes
from care.paths import PROJECT_ROOT
from data_pipeline.dedup import stage as dedup

KILLED_WRITE = ("import os, sys; from care.data.io import atomic_open, atomic_folder\n"
                "if sys.argv[2] == 'file':\n"
                "    with atomic_open(sys.argv[1]) as fh:\n"
                "        fh.write('x' * 5000); fh.flush(); os._exit(9)\n"
                "with atomic_folder(sys.argv[1]) as tmp:\n"
                "    (tmp / 'half.bin').write_bytes(b'x' * 5000); os._exit(9)\n")


def killed_write(path, kind: str = "file") -> None:
    run = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(path), kind], env=ENV, cwd=PROJECT_ROOT,
                         check=False, timeout=60)
    assert run.returncode == 9


def test_a_stage_start_removes_what_a_killed_write_left(tmp_path, capsys):
    src, out = tmp_path / "plain.jsonl", tmp_path / "out"
    write_jsonl(src, PLAIN)
    dedup.run(dedup_cfg(src, out))
    killed_write(out / "kept.jsonl")
    killed_write(out / "stats.json")
    mine = [out / ".kept.jsonl.backup", out / ".notes.abcdefgh.tmp", out / "kept.jsonl.12345678.tmp"]
    for path in mine:
        path.write_text("the user's", encoding="utf-8")
    left = sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp") and p not in mine)
    assert len(left) == 2 and all(name.startswith((".kept.jsonl.", ".stats.json.")) for name in left), left
    capsys.readouterr()
    dedup.run(dedup_cfg(src, out))  # unchanged: skipped, and the leftovers go first
    err = capsys.readouterr().err
    assert f"note: removed what 2 interrupted writes left in {out} (0.0 MB): {', '.join(left)}" in err, err
    assert not any((out / name).exists() for name in left) and all(p.read_text(encoding="utf-8") == "the user's"
                                                                   for p in mine)
    capsys.readouterr()
    dedup.run(dedup_cfg(src, out))
    assert "interrupted" not in capsys.readouterr().err


def test_a_whole_folder_stage_finds_its_half_built_folder_beside_it(tmp_path):
    """atomic_folder's `.NAME.<random>` beside a whole-folder stage's out (nano), and one of an output
    folder inside out; a look-alike of another name is not taken."""
    out = tmp_path / "NanoX"
    out.mkdir()
    killed_write(out, "folder")
    killed_write(out / "corpus", "folder")
    other = tmp_path / ".NanoY.abcdefgh"
    other.mkdir()
    found = interrupted_writes(out, ("corpus/", "stats.json"), whole_folder=True)
    assert sorted(p.parent.name + "/" + p.name.split(".")[1] for p in found) == ["NanoX/corpus", f"{tmp_path.name}/NanoX"]
    assert all(p.is_dir() and (p / "half.bin").stat().st_size == 5000 for p in found)
    assert leftovers(tmp_path, ["NanoX"]) == [p for p in found if p.parent == tmp_path]
    assert [p.parent for p in interrupted_writes(out, ("corpus/",), whole_folder=False)] == [out]
    assert other.is_dir()
