"""Every app ends a user-fixable error with one line `<app>: error: ...` naming the file (exit 1), Ctrl-C with
one line saying a re-run resumes (exit 130), and shows the traceback with HYDRA_FULL_ERROR=1 (care.errors)."""
from __future__ import annotations

import errno
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

import evaluate
from care.config import load_config
from care.data.io import DataError
from care.errors import app_errors
from care.evaluation import entries


@pytest.fixture(autouse=True)
def _no_full_error(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


def _one_line(err: str, *parts: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # not a progress bar
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def _exit_status(main, cfg):
    """The app's exit status; a KeyboardInterrupt that escapes it fails the test (not the whole session)."""
    try:
        main(cfg)
    except SystemExit as e:
        return e.code
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the app (a KeyboardInterrupt traceback)")
    pytest.fail("the app did not exit")


def _nano_folder(root, corrupt: str = "corpus"):
    """A one-split Nano folder (<config>/<split>-*.parquet) whose `corrupt` file keeps its size and its
    PAR1 magic but has garbage where its pages are: corrupt, not truncated."""
    ids = [f"d{i}" for i in range(40)]
    tables = {"queries": {"_id": ["q0", "q1"], "text": ["头痛怎么办", "发烧吃什么药"]},
              "corpus": {"_id": ids, "text": [f"医学文本 {i} " * 8 for i in range(40)]},
              "qrels": {"query-id": ["q0", "q1"], "corpus-id": ["d0", "d1"]},
              "reranking_hybrid": {"query-id": ["q0", "q1"], "corpus-ids": [ids[:10], ids[5:15]]}}
    for config, columns in tables.items():
        path = root / config / "medical-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(columns), path)
    bad = root / corrupt / "medical-00000-of-00001.parquet"
    data = bytearray(bad.read_bytes())
    data[4:min(200, len(data) - 100)] = b"\x11" * (min(200, len(data) - 100) - 4)
    bad.write_bytes(bytes(data))
    return bad


def _evaluate_cfg(tmp_path, *overrides):
    return load_config("evaluate", ["~benchmark@extra_benchmark", "model=tiny_bert", f"model.path={tmp_path}",
                                    "baselines=[]", f"out_dir={tmp_path / 'eval'}", f"cache.dir={tmp_path / 'cache'}",
                                    *overrides])


def test_a_corrupt_parquet_in_a_nano_folder_is_one_line_naming_it(tmp_path, capsys):
    bad = _nano_folder(tmp_path / "nano")
    cfg = _evaluate_cfg(tmp_path, "benchmark=nano", f"benchmark.nano.path={tmp_path / 'nano'}")
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(cfg)
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "evaluate.py: error:", str(bad), "parquet")


def test_the_nano_readers_name_the_corrupt_file(tmp_path):
    """stage=nano input=<folder> and the mteb adapter read through the same reader (care.data.nano.read_rows)."""
    from data_pipeline.nano.sources import read_task

    bad = _nano_folder(tmp_path / "nano", corrupt="qrels")
    with pytest.raises(DataError) as e:
        read_task(tmp_path / "nano")
    assert e.value.path == str(bad) and "not a readable parquet file" in str(e.value)


def test_hydra_full_error_shows_the_traceback(tmp_path, monkeypatch):
    _nano_folder(tmp_path / "nano")
    cfg = _evaluate_cfg(tmp_path, "benchmark=nano", f"benchmark.nano.path={tmp_path / 'nano'}")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(DataError, match="parquet"):
        evaluate.main(cfg)


def test_a_full_disk_says_so_and_where(tmp_path, monkeypatch, capsys):
    """A write failing with ENOSPC (as a file's write() does: no file name) names the disk and the folder."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluate, "model_entries", lambda cfg: [])
    monkeypatch.setattr(evaluate, "load_benchmarks", lambda cfg: [])
    monkeypatch.setattr(evaluate, "write_summary", full)
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(_evaluate_cfg(tmp_path))
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "evaluate.py: error: no space left on /", f"writing under {tmp_path / 'eval'}")


def test_a_full_disk_names_the_file_when_the_error_has_it(tmp_path, capsys):
    target = tmp_path / "out" / "shard.npz"
    with pytest.raises(SystemExit) as exit_, app_errors("encode.py", writes_to=tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "encode.py: error: no space left on /", f"writing {target}")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "load_benchmarks", interrupted)
    assert _exit_status(evaluate.main, _evaluate_cfg(tmp_path)) == 130
    _one_line(capsys.readouterr().err, "evaluate.py: interrupted; the same command resumes")


def test_ctrl_c_in_the_data_pipeline(monkeypatch, capsys):
    import data_pipeline.__main__ as pipeline
    from data_pipeline import benchmarks

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmarks, "run", interrupted)
    assert _exit_status(pipeline.main, load_config("data_pipeline", ["stage=benchmarks"])) == 130
    _one_line(capsys.readouterr().err, "python -m data_pipeline: interrupted; the same command resumes")


def test_compare_names_a_broken_summary(tmp_path, capsys):
    from care.evaluation.compare import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"models": [', encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        main([str(run), "--out", str(tmp_path / "cmp")])
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "compare: error:", str(run / "summary.json"), "line 1", "not valid JSON")


def test_a_missing_model_folder_fails_before_any_benchmark(tmp_path, monkeypatch, capsys):
    """model.path=<a folder of the user's> that does not exist: said at once, without `make model` (the
    hint of the project's own me5_small folder)."""
    def no_benchmarks(cfg):
        raise AssertionError("benchmarks loaded before the model folder was checked")

    monkeypatch.setattr(evaluate, "load_benchmarks", no_benchmarks)
    cfg = load_config("evaluate", ["model=me5_small", "model.path=/nonexistent", "baselines=[]",
                                   f"out_dir={tmp_path / 'eval'}"])
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(cfg)
    assert exit_.value.code == 1
    line = _one_line(capsys.readouterr().err, "evaluate.py: error:", "/nonexistent does not exist")
    assert "make model" not in line


def test_the_build_hint_stays_for_the_projects_own_folder(tmp_path):
    """The configured folder of me5_small (under this run's cache_root), missing: `make model` is the right
    advice there."""
    cfg = OmegaConf.to_container(load_config("evaluate", [f"cache_root={tmp_path}"]), resolve=True)
    with pytest.raises(FileNotFoundError, match="make model"):
        entries.check_model_folders([{"name": "me5_small", "model": cfg["model"]}], cfg)


def test_bugs_keep_their_traceback():
    with pytest.raises(TypeError), app_errors("x"):
        raise TypeError("a bug")


def test_a_json_error_without_a_file_is_still_one_line(capsys):
    with pytest.raises(SystemExit) as exit_, app_errors("x"):
        json.loads("{")
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "x: error: invalid JSON (line 1")


def test_a_corrupt_training_record_is_named(tmp_path, shared, capsys):
    """train.py run again over a run folder whose final/care_training.json is corrupt: the file is named."""
    from _training_helpers import make_training_files, train_config

    import train

    texts, examples = make_training_files(tmp_path, shared, n_questions=16)
    cfg = train_config(tmp_path, texts, examples, "run")
    record = tmp_path / "run" / "final" / "care_training.json"
    record.parent.mkdir(parents=True)
    record.write_text('{\n  "config_hash', encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        train.main(cfg)
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "train.py: error:", str(record), "line 2")


def test_a_truncated_head_file_is_named(tmp_path, capsys):
    """An M3 folder whose colbert_linear.pt is cut short, loaded as evaluate.py loads a model: the file is named."""
    from care.encoders import build_encoder
    from care.models.m3 import tiny_m3

    folder = tiny_m3().save(tmp_path / "m3")
    head = folder / "colbert_linear.pt"
    head.write_bytes(head.read_bytes()[:300])
    with pytest.raises(SystemExit) as exit_, app_errors("evaluate.py"):
        build_encoder({"kind": "m3", "path": str(folder)}, device="cpu")
    assert exit_.value.code == 1
    _one_line(capsys.readouterr().err, "evaluate.py: error:", str(head), "truncated")
