# ruff: noqa: F811  (task_paths, imported from test_evaluate_cli, is a fixture named as a test parameter)
"""An evaluation's out_dir across runs (evaluate.py, care/evaluation/run_folder.py, care/runlock.py): a second
evaluate.py into a folder holding a summary.json adds its rows (a row of the same name replaced, said in one
line), one scored with other settings is refused before any scoring and leaves the folder untouched,
overwrite=true replaces the rows and removes their per-task files; a failed evaluation leaves the folder as
it found it (none at all when it created it).  The reference is the first run's own summary.json and
per-task files, read back as written, and the folder's listing before the run."""
from __future__ import annotations

import json
import shutil

import pytest
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: a fixture)

from care.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(paths, tmp_path, *extra):
    return load_config("evaluate", overrides(paths, tmp_path, "efficiency.enabled=false", *extra, cmedqa2=False))


def test_a_second_run_adds_its_rows_and_other_settings_are_refused(task_paths, tiny_bert_dir, tmp_path, capsys):
    from evaluate import evaluate

    other = tmp_path / "models" / "other"
    shutil.copytree(tiny_bert_dir, other)
    out = tmp_path / "eval"
    evaluate(_cfg(task_paths, tmp_path, "model=tiny_bert", f"model.path={tiny_bert_dir}", "baselines=[bm25]"))
    first = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    capsys.readouterr()

    evaluate(_cfg(task_paths, tmp_path, f"ckpt={other}", "baselines=[bm25]"))
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert [r["name"] for r in summary["models"]] == ["tiny_bert", "bm25", "other"]
    assert summary["models"][0] == first["models"][0]  # the earlier row as it was stored
    assert "1 kept (tiny_bert); 1 replaced (bm25); 1 added (other)" in printed
    table = (out / "summary.md").read_text(encoding="utf-8")
    assert all(f"| {r['label']} |" in table for r in summary["models"])
    assert (out / "tiny_bert" / "cmedteb" / "retrieval.json").is_file() and (out / "other").is_dir()

    # scored with another depth: refused before any scoring, the folder as it was
    before = (out / "summary.json").read_bytes()
    with pytest.raises(ValueError, match=f"{out} holds an evaluation scored with other scoring.*run_name=.*overwrite=true"):
        evaluate(_cfg(task_paths, tmp_path, "model=tiny_bert", f"model.path={other}", "model.name=third", "depth=5",
                      "baselines=[]"))
    assert (out / "summary.json").read_bytes() == before and not (out / "third").exists()

    # overwrite=true: only the new rows, the dropped rows' per-task files removed, and a line saying so
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={other}", "depth=5", "baselines=[]", "overwrite=true"))
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert [r["name"] for r in summary["models"]] == ["other"]
    assert "the 3 row(s) of the earlier run (tiny_bert, bm25, other) dropped" in printed
    assert not (out / "tiny_bert").exists() and not (out / "bm25").exists()


def test_a_failed_evaluation_leaves_the_folder_as_it_found_it(task_paths, tmp_path):
    """evaluate.py's main runs evaluate() under locked_out_dir; a model folder that does not exist fails at once."""
    from care.runlock import locked_out_dir
    from evaluate import evaluate

    bad = [f"model.path={tmp_path / 'nope'}", "model=tiny_bert", "baselines=[]"]
    with pytest.raises(FileNotFoundError):
        locked_out_dir(evaluate)(_cfg(task_paths, tmp_path, *bad))
    assert not (tmp_path / "eval").exists()

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(FileNotFoundError):
        locked_out_dir(evaluate)(_cfg(task_paths, tmp_path, *bad))
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["notes.txt"]
