# ruff: noqa: F811  (task_paths, imported from test_evaluate_cli, is a fixture named as a test parameter)
"""An evaluation's out_dir across runs (evaluate.py, care/evaluation/run_folder.py, care/runlock.py): a second
evaluate.py into a folder holding a summary.json adds its rows (a row of the same name replaced, said in one
line), one scored with other settings is refused before any scoring and leaves the folder untouched,
overwrite=true replaces the rows and removes their per-task files; a failed evaluation leaves the folder as
it found it (none at all when it created it).  The reference is the first run's own summary.json and
per-task files, read back as written, and the folder's listing before the run."""
from __future__ import annotations

import json
import re
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


# ---- one row, one model, one folder (issue #40 item 2) ---------------------------------------------------

def _tiny(folder, seed):
    from care.models.tiny import save_tiny

    return save_tiny(folder, "bert", seed=seed)


def _folder(row: dict) -> str:
    """A row's per-task folder; a row written before rows named it: its name as evaluate.py made it a folder."""
    return row.get("folder") or re.sub(r"[^A-Za-z0-9_.-]+", "_", row["name"]).strip("_")


def _rows(out) -> dict:
    return {r["name"]: r for r in json.loads((out / "summary.json").read_text(encoding="utf-8"))["models"]}


def test_two_row_names_of_one_folder_name_keep_their_own_per_task_files(task_paths, tmp_path, capsys):
    """`ckpt=p/run/final` then `ckpt=q/run_final`: both names make the folder name run_final.  The first row
    keeps its own per-task files, and its gain interval is the one it had (recomputed from them), not the
    second model's."""
    from evaluate import evaluate

    first, second = _tiny(tmp_path / "p" / "run" / "final", 1), _tiny(tmp_path / "q" / "run_final", 2)
    out = tmp_path / "eval"
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={first}", "baselines=[bm25]", "gain_over=bm25"))
    before = _rows(out)["run/final"]
    files = {p.relative_to(out): p.read_bytes() for p in (out / _folder(before)).rglob("*.json")}
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={second}", "baselines=[bm25]", "gain_over=bm25"))
    rows = _rows(out)
    assert list(rows) == ["run/final", "bm25", "run_final"]
    assert rows["run/final"]["gain"] == before["gain"]  # its intervals, from its own files
    assert _folder(rows["run/final"]) != _folder(rows["run_final"])
    assert {p.relative_to(out): p.read_bytes() for p in (out / _folder(before)).rglob("*.json")} == files
    for name, row in rows.items():
        record = json.loads((out / _folder(row) / "cmedteb" / "retrieval.json").read_text(encoding="utf-8"))
        assert record["fingerprint"] == row["fingerprint"], name
    assert rows["run/final"]["fingerprint"] != rows["run_final"]["fingerprint"]
    assert "row " not in capsys.readouterr().out  # no row lost an interval


def test_another_model_under_a_row_name_is_refused_and_the_same_model_replaces_its_row(task_paths, tmp_path, capsys):
    """A saved checkpoint's model/ is named "<run>/step-N" (as checkpoints=all names it), so two steps are two
    rows; two other folders called `model` are one row name of two models: the second is refused in one line
    that says how to name it, and the folder is left as it was; the same folder evaluated again replaces its
    row."""
    from evaluate import evaluate

    out = tmp_path / "eval"
    step5 = _tiny(tmp_path / "run" / "checkpoints" / "step-0000005" / "model", 5)
    step6 = _tiny(tmp_path / "run" / "checkpoints" / "step-0000006" / "model", 6)
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={step5}", "baselines=[]"))
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={step6}", "baselines=[]"))
    rows = _rows(out)
    assert list(rows) == ["run/step-0000005", "run/step-0000006"]
    assert rows["run/step-0000005"]["fingerprint"] != rows["run/step-0000006"]["fingerprint"]

    a, b = _tiny(tmp_path / "a" / "model", 7), _tiny(tmp_path / "b" / "model", 8)
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={a}", "baselines=[]"))
    listing = sorted(p.relative_to(out) for p in out.rglob("*"))
    stored = (out / "summary.json").read_bytes()
    with pytest.raises(ValueError, match=rf"has a row 'model' of another model \({a}\); this one "
                                         rf"\({b}\) would replace it: .*run_name=.*overwrite=true") as e:
        evaluate(_cfg(task_paths, tmp_path, f"ckpt={b}", "baselines=[]"))
    assert "\n" not in str(e.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == listing
    assert (out / "summary.json").read_bytes() == stored

    capsys.readouterr()
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={a}", "baselines=[]"))  # the same model again: its row replaced
    assert "1 replaced (model)" in capsys.readouterr().out
    assert list(_rows(out)) == ["run/step-0000005", "run/step-0000006", "model"]
    shutil.copytree(a, tmp_path / "c" / "model")  # the same weights in another folder: the same model
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={tmp_path / 'c' / 'model'}", "baselines=[]"))
    assert "1 replaced (model)" in capsys.readouterr().out
    assert _rows(out)["model"]["model_folders"] == ["../c/model"]

    # model= rows: the model under test named as a baseline of another folder is two rows of one name
    _tiny(tmp_path / "models_root" / "models" / "tiny-bert", 9)
    with pytest.raises(ValueError, match=r"two rows named 'tiny_bert'.*model\.name="):
        evaluate(_cfg(task_paths, tmp_path, "model=tiny_bert", f"model.path={a}", "baselines=[tiny_bert]",
                      f"cache_root={tmp_path / 'models_root'}"))


def test_a_summary_from_before_still_reads_and_a_row_that_lost_its_files_says_so(task_paths, tmp_path, capsys):
    """A summary.json written before rows named their folders (no `folder`, `model_folders`) keeps working:
    its rows are kept with their intervals.  A kept row whose per-task folder is gone, or whose file holds
    another model's scores (two rows that shared a folder before), loses those intervals with one line each."""
    from evaluate import evaluate

    a, b = _tiny(tmp_path / "a" / "run" / "final", 1), _tiny(tmp_path / "b" / "other", 2)
    out = tmp_path / "eval"
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={a}", "baselines=[bm25]", "gain_over=bm25"))
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    for row in summary["models"]:  # as evaluate.py wrote rows before
        row.pop("folder", None), row.pop("model_folders", None)
    (out / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    first = summary["models"][0]

    evaluate(_cfg(task_paths, tmp_path, f"ckpt={b}", "baselines=[bm25]", "gain_over=bm25"))
    assert " per-task files are gone" not in capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == ["run/final", "bm25", "other"] and rows["run/final"] == first

    other = out / _folder(rows["other"]) / "cmedteb" / "retrieval.json"
    shutil.copy(other, out / "run_final" / "cmedteb" / "retrieval.json")  # another model's file in its folder
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={b}", "baselines=[bm25]", "gain_over=bm25"))
    printed = capsys.readouterr().out
    assert (f"row run/final: {out / 'run_final' / 'cmedteb' / 'retrieval.json'} holds another model's scores "
            f"(fingerprint {rows['other']['fingerprint']}, the row's {first['fingerprint']})") in printed
    intervals = _rows(out)["run/final"]["gain"]["intervals"]
    assert intervals.get("cmedteb/retrieval") is None and intervals["cmedteb/cmed_v1"] == first["gain"]["intervals"]["cmedteb/cmed_v1"]

    shutil.rmtree(out / "run_final")
    evaluate(_cfg(task_paths, tmp_path, f"ckpt={b}", "baselines=[bm25]", "gain_over=bm25"))
    printed = capsys.readouterr().out
    assert f"row run/final: 5 of its per-task files are gone (e.g. {out / 'run_final' / 'cmedteb'}" in printed
    assert not any(_rows(out)["run/final"]["gain"]["intervals"].values())
