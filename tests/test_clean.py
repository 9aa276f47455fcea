"""`make clean` removes only what the project wrote (care/tools/clean.py): the known sub-folders of the outputs
root, never the root with a user's own files in it, nor a sibling of a root whose name holds a space; each
removed path is printed.  The reference: the folders each test made itself, and the sub-folders conf/, the
Makefile and the code name under the outputs root."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from care.paths import PROJECT_ROOT
from care.tools.clean import OUT_ROOT_FOLDERS, PROJECT_FOLDERS, clean

PROJECT_WRITES = ("data/import/texts.jsonl", "train/cpu_default-me5_small/final/model.safetensors",
                  "eval/run/summary.json", "mteb/results/x.json", "compare/2026/compare.json",
                  "hydra/train/2026/train.log", "multirun/train/2026/0/train.log")
USER_FILES = ("notes.txt", "thesis/chapter1.tex", "数据/我的.txt")


def fill(root: Path, names) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x" * 1000, encoding="utf-8")


def test_make_clean_keeps_the_users_files_and_a_sibling_of_a_root_with_a_space(tmp_path):
    """`make clean OUT_ROOT="<tmp>/数据 out"` in a copy of the project (its Makefile and clean tool; no
    virtualenv there, so make runs the tool with python3): the project's sub-folders go, each named with its
    size; the user's files in the root stay and are named; the sibling `<tmp>/数据` (the old `rm -rf` of the
    unquoted path removed it and `out`) and the project's own files stay; multirun/ and .pytest_cache/ beside
    the Makefile go; the care table's links go without touching what they point to."""
    project = tmp_path / "checkout"
    (project / "care" / "tools").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "Makefile", project / "Makefile")
    shutil.copy(PROJECT_ROOT / "care" / "tools" / "clean.py", project / "care" / "tools" / "clean.py")
    fill(project, ["multirun/x/log", ".pytest_cache/v/cache", "README.md"])
    root = tmp_path / "数据 out"
    fill(root, PROJECT_WRITES + USER_FILES)
    (root / "care_table").mkdir()
    (root / "care_table" / "e-symmetric").symlink_to(root / "train" / "cpu_default-me5_small" / "final")
    sibling, elsewhere = tmp_path / "数据", tmp_path / "out"
    fill(tmp_path, ["数据/keep.txt", "out/keep.txt"])

    run = subprocess.run(["make", "--no-print-directory", "clean", f"OUT_ROOT={root}"], cwd=project,
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/bin:/bin:" + str(Path(shutil.which("python3")).parent)})
    assert run.returncode == 0, run.stderr
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == sorted(USER_FILES)
    assert (sibling / "keep.txt").is_file() and (elsewhere / "keep.txt").is_file()
    assert (project / "README.md").is_file() and (project / "Makefile").is_file()
    assert not (project / "multirun").exists() and not (project / ".pytest_cache").exists()
    removed = re.findall(r"^clean: removed (.*) \((?:[\d.]+ MB|a link)\)$", run.stdout, re.MULTILINE)
    assert sorted(removed) == sorted([str(root / n) for n in ("data", "train", "eval", "mteb", "compare", "hydra",
                                                              "multirun", "care_table")]
                                     + [str(project / "multirun"), str(project / ".pytest_cache")]), run.stdout
    assert f"clean: kept {root} and what the project did not write there: notes.txt, thesis, 数据" in run.stdout


def test_a_linked_sub_folder_is_unlinked_not_followed(tmp_path):
    """data/ linked to a big disk elsewhere: the link goes, the folder it points to stays whole."""
    root, disk = tmp_path / "out", tmp_path / "big-disk" / "care-data"
    fill(disk, ["import/texts.jsonl"])
    root.mkdir()
    (root / "data").symlink_to(disk, target_is_directory=True)
    said = []
    clean(root, tmp_path / "project", say=said.append)
    assert not (root / "data").exists() and (disk / "import" / "texts.jsonl").is_file()
    assert said[0] == f"clean: removed {root / 'data'} (a link)"


def test_dry_run_removes_nothing_and_the_default_root_goes_once_empty(tmp_path):
    project = tmp_path / "project"
    fill(project / "outputs", PROJECT_WRITES)
    said = []
    clean(project / "outputs", project, dry_run=True, say=said.append)
    assert all(line.startswith("clean: would remove ") for line in said) and len(said) == 7
    assert all((project / "outputs" / n).is_file() for n in PROJECT_WRITES)
    said.clear()
    clean(project / "outputs", project, say=said.append)
    assert not (project / "outputs").exists() and said[-1] == f"clean: removed {project / 'outputs'} (empty)"
    said.clear()
    clean(project / "outputs", project, say=said.append)
    assert said == [f"clean: nothing the project wrote under {project / 'outputs'}"]


@pytest.mark.parametrize("where", ["conf", "Makefile", "code"])
def test_every_folder_the_project_writes_under_the_root_is_known_to_clean(where):
    """The sub-folders of the outputs root named in conf/ (${out_root}/X), the Makefile ($(OUT_ROOT)/X) and
    the code (outputs_dir() / "X", out_root / "X") are all cleaned: a new one must be added to clean.py."""
    if where == "conf":
        texts = [p.read_text(encoding="utf-8") for p in (PROJECT_ROOT / "conf").rglob("*.yaml")]
        pattern = r"\$\{out_root\}/(\w+)"
    elif where == "Makefile":
        texts, pattern = [(PROJECT_ROOT / "Makefile").read_text(encoding="utf-8")], r"\$\(OUT_ROOT\)/(\w+)"
    else:
        files = [p for d in ("care", "data_pipeline", "bench") for p in (PROJECT_ROOT / d).rglob("*.py")]
        texts = [p.read_text(encoding="utf-8") for p in files + list(PROJECT_ROOT.glob("*.py"))]
        pattern = r'(?:outputs_dir\(\)|out_root(?:"\])?\)?) / "(\w+)"'
    named = {m for text in texts for m in re.findall(pattern, text)}
    assert named, f"no folder found in {where}: the pattern is stale"
    assert named <= set(OUT_ROOT_FOLDERS), f"clean.py does not know {sorted(named - set(OUT_ROOT_FOLDERS))}"
    assert set(PROJECT_FOLDERS) <= {line.strip("/") for line in
                                    (PROJECT_ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()}
