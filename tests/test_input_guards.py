"""Guards on what the stages read and write.

- `stage=dedup input=FILE` takes a plain {"id","text"} store: the role/source filters are for the import
  store and default to off with input=; an explicit dedup.roles / dedup.sources still applies.
- No stage overwrites files it did not write (care.data.stage_cache.claim_outputs): a file it would write
  in a folder whose stats.json is not its own is refused, naming the file, unless force=true; a re-run over
  its own outputs is skipped when unchanged and redone when changed, an interrupted one is redone.
- Missing training files name the command that writes them.
- Error lines are the file's lines, blank lines included.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from care.config import load_config
from care.data import stage_start
from care.data.io import DataError
from care.data.stage_cache import ForeignOutputError, claim_outputs, mark_in_progress
from care.paths import PROJECT_ROOT
from care.training.data import TrainingGroups
from care.training.samplers import EpochSampler
from data_pipeline import benchmarks, build, import_stage, mining
from data_pipeline.dedup import calibrate_labels
from data_pipeline.dedup import stage as dedup

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TRANSFORMERS_OFFLINE": "1"}


@functools.cache
def _base():
    return load_config("data_pipeline")  # composed once: Hydra takes ~1 s a call


def cfg_with(*dotlist: str):
    """The pipeline config with command-line style `key=value` overrides."""
    return OmegaConf.merge(_base(), OmegaConf.from_dotlist(list(dotlist)))


def _jsonl(path: Path, rows, blank_before: int | None = None) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    if blank_before is not None:
        lines.insert(blank_before, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


PLAIN = [{"id": "a", "text": "头痛怎么办"}, {"id": "b", "text": "头痛怎么办"}, {"id": "c", "text": "发烧了吃什么药"}]


def _dedup(src: Path, out: Path, *extra: str) -> dict:
    return dedup.run(cfg_with(f"input={src}", f"out={out}", "dedup.stages=[exact,minhash]", *extra))


# ---- 1. dedup on any text store ------------------------------------------------------------------------

def test_dedup_takes_a_plain_text_store_with_input_and_explicit_filters_still_apply(tmp_path):
    plain = _jsonl(tmp_path / "plain.jsonl", PLAIN)
    stats = _dedup(plain, tmp_path / "out")
    assert stats["roles"] is None and stats["sources"] is None and stats["texts_in"] == 3
    kept = [json.loads(x) for x in (tmp_path / "out" / "kept.jsonl").read_text(encoding="utf-8").splitlines()]
    assert kept == [PLAIN[0], PLAIN[2]]

    rows = [{**r, "role": "answer", "source": s} for r, s in zip(PLAIN, ["x", "y", "x"])]
    src = _jsonl(tmp_path / "store.jsonl", rows)
    stats = _dedup(src, tmp_path / "out", "dedup.sources=[x]")
    assert stats["sources"] == ["x"] and stats["roles"] is None and stats["rows_filtered_out"] == 1
    with pytest.raises(DataError, match=r"line 1, field 'role': missing, but dedup.roles filters on it"):
        _dedup(plain, tmp_path / "out3", "dedup.roles=[answer]")


def test_filters_default_to_the_import_filter_without_input():
    assert dedup.row_filters(cfg_with()) == (["answer"], ["cepilepsyqa"])
    assert dedup.row_filters(cfg_with("input=/some/store.jsonl")) == (None, None)
    assert dedup.row_filters(cfg_with("dedup.roles=null")) == (None, ["cepilepsyqa"])
    assert dedup.row_filters(cfg_with("input=/s.jsonl", "dedup.roles=[question]")) == (["question"], None)
    with pytest.raises(ValueError, match="dedup.roles must be a list, null"):
        dedup.row_filters(cfg_with("dedup.roles=answer"))


# ---- 2. no stage overwrites files it did not write ---------------------------------------------------------

def _import_cfg(tmp_path: Path, *extra: str):
    _jsonl(tmp_path / "src" / "r" / "t.jsonl", [{"query": "头痛", "positive": ["休息"], "negative": ["运动"]}])
    cfg = cfg_with(f"data_dir={tmp_path}", *extra)
    with open_dict(cfg):
        cfg.data.root = str(tmp_path / "src")
        cfg.data.sources = {"r": {"reader": "cmteb_reranking", "path": "r", "files": {"test": "t.jsonl"}}}
    return cfg


STAGE_CASES = {
    # stage: (run it on tmp_path, its output folder under tmp_path, a file it writes there)
    "import": (lambda tmp: import_stage.run(_import_cfg(tmp)), "import", "texts.jsonl"),
    "dedup": (lambda tmp: _dedup(_jsonl(tmp / "plain.jsonl", PLAIN), tmp / "dedup"), "dedup", "kept.jsonl"),
    "build": (lambda tmp: build.run(cfg_with(f"data_dir={tmp}")), "build", "examples.jsonl"),
    "mine": (lambda tmp: mining.run(cfg_with(f"data_dir={tmp}", "model=tiny_bert", f"model.path={tmp / 'none'}",
                                             "mine.window=[0.5,0.8]", "mine.dedup_clusters=null")),
             "train", "flag_train.jsonl"),
    "benchmarks": (lambda tmp: benchmarks.build(
        "cmedqa2_retrieval", OmegaConf.to_container(_base().data, resolve=True), tmp),
        "benchmarks/cmedqa2_retrieval", "cmedqa2_test/qrels/test.tsv"),
}


@pytest.mark.parametrize("stage", list(STAGE_CASES))
def test_every_stage_refuses_a_file_it_did_not_write(tmp_path, stage, request):
    if stage == "benchmarks":
        request.getfixturevalue("shared")  # the stand-in builder fingerprints the shared data's files
    runner, folder, name = STAGE_CASES[stage]
    mine = tmp_path / folder / name
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's own file\n", encoding="utf-8")
    with pytest.raises(ForeignOutputError, match="force=true") as err:
        runner(tmp_path)
    assert f"refusing to overwrite {mine}" in str(err.value) and f"stage {stage}" in str(err.value)
    assert isinstance(err.value, ValueError)  # the pipeline CLI prints it as one line
    assert mine.read_text(encoding="utf-8") == "the user's own file\n"
    assert not (tmp_path / folder / "stats.json").exists()  # nothing written


def test_force_overwrites(tmp_path):
    (tmp_path / "import").mkdir()
    (tmp_path / "import" / "texts.jsonl").write_text("mine\n", encoding="utf-8")
    with pytest.raises(ForeignOutputError):
        import_stage.run(_import_cfg(tmp_path))
    stats = import_stage.run(_import_cfg(tmp_path, "force=true"))
    assert stats["stage"] == "import" and (tmp_path / "import" / "texts.jsonl").read_text() != "mine\n"
    assert import_stage.run(_import_cfg(tmp_path)).get("skipped")  # its own outputs, unchanged: skipped


def test_dedup_reruns_over_its_own_outputs(tmp_path, monkeypatch):
    src, out = _jsonl(tmp_path / "plain.jsonl", PLAIN), tmp_path / "out"
    first = _dedup(src, out)
    assert first["stage"] == "dedup"
    assert _dedup(src, out).get("skipped")                                   # unchanged: skipped
    _jsonl(src, PLAIN + [{"id": "d", "text": "咳嗽"}])
    changed = _dedup(src, out)                                               # changed: redone, not refused
    assert not changed.get("skipped") and changed["texts_in"] == 4

    # an interrupted first run (everything written but stats.json) is redone, not refused
    other = tmp_path / "other"

    def crash(path, obj):
        raise RuntimeError("killed")

    monkeypatch.setattr(stage_start, "write_json", crash)  # stats.json, written last (care/data/stage_start.py)
    with pytest.raises(RuntimeError, match="killed"):
        _dedup(src, other)
    assert (other / "kept.jsonl").exists()
    monkeypatch.undo()
    assert _dedup(src, other)["texts_out"] == 3

    # stats.json written before it carried the stage name is still this stage's
    old = json.loads((other / "stats.json").read_text(encoding="utf-8"))
    del old["stage"]
    (other / "stats.json").write_text(json.dumps({**old, "fingerprint": "older"}), encoding="utf-8")
    assert not _dedup(src, other).get("skipped")


def test_another_stages_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stats.json").write_text(json.dumps({"stage": "build", "fingerprint": "x"}), encoding="utf-8")
    wanted = rf"refusing to overwrite {out / 'stats.json'}.*not written by stage dedup \(it names stage 'build'\)"
    with pytest.raises(ForeignOutputError, match=wanted):
        _dedup(_jsonl(tmp_path / "plain.jsonl", PLAIN), out)
    claim_outputs(out, "build", ["examples.jsonl"])  # its own stage may


def test_claim_outputs_names_every_foreign_file_and_force_takes_the_folder(tmp_path):
    (tmp_path / "kept.jsonl").write_text("x", encoding="utf-8")
    (tmp_path / "clusters.jsonl").write_text("y", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("z", encoding="utf-8")  # not a file the stage writes: no conflict
    with pytest.raises(ForeignOutputError, match=r"kept.jsonl \(and 1 more: clusters.jsonl\)"):
        claim_outputs(tmp_path, "dedup", ["kept.jsonl", "clusters.jsonl"])
    claim_outputs(tmp_path, "dedup", ["kept.jsonl", "clusters.jsonl"], force=True)
    assert not (tmp_path / "stats.json").exists()  # claiming writes nothing
    mark_in_progress(tmp_path, "dedup")
    assert json.loads((tmp_path / "stats.json").read_text())["stage"] == "dedup"
    claim_outputs(tmp_path, "dedup", ["kept.jsonl", "clusters.jsonl"])  # now the folder is its own
    claim_outputs(tmp_path / "fresh", "dedup", ["kept.jsonl"])  # an empty folder is taken
    with pytest.raises(ForeignOutputError, match="is a file, not a folder"):
        claim_outputs(tmp_path / "notes.txt", "dedup", ["kept.jsonl"])


def test_cli_refusal_is_one_line(tmp_path):
    src, out = _jsonl(tmp_path / "plain.jsonl", PLAIN), tmp_path / "out"
    out.mkdir()
    (out / "kept.jsonl").write_text("mine\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "data_pipeline", "stage=dedup", f"input={src}", f"out={out}",
           "dedup.stages=[exact,minhash]", f"hydra.run.dir={tmp_path / 'h'}"]
    run = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"error in stage dedup: stage dedup: refusing to overwrite {out / 'kept.jsonl'}" in run.stderr
    assert (out / "kept.jsonl").read_text(encoding="utf-8") == "mine\n"
    forced = subprocess.run(cmd + ["force=true"], check=False, cwd=PROJECT_ROOT, capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert json.loads((out / "kept.jsonl").read_text(encoding="utf-8").splitlines()[0]) == PLAIN[0]


# ---- 4. missing training files ------------------------------------------------------------------------------

def test_missing_training_files_name_the_command_that_writes_them(tmp_path):
    texts, train = tmp_path / "train" / "texts.jsonl", tmp_path / "train" / "train.jsonl"
    with pytest.raises(FileNotFoundError) as err:
        TrainingGroups(texts, train)
    msg = str(err.value)
    assert str(texts) in msg and "python -m data_pipeline" in msg and "stage mine writes outputs/data/train/" in msg
    _jsonl(texts, [{"id": "q", "text": "头痛"}])
    with pytest.raises(FileNotFoundError, match=rf"{train} does not exist: it is written by python -m data_pipeline"):
        TrainingGroups(texts, train)


# ---- 5. error lines are file lines (read_jsonl skips blank lines) --------------------------------------------

def _calibrate(tmp):
    path = _jsonl(tmp / "labels.jsonl", [{"cosine": 0.9, "label": 1}, {"cosine": 0.8, "label": 7}], blank_before=1)
    return lambda: calibrate_labels.read_labels(path), path, "label"


def _dedup_rows(tmp):
    path = _jsonl(tmp / "store.jsonl", [PLAIN[0], PLAIN[0]], blank_before=1)
    return lambda: dedup.load_rows(path, None, None), path, "id"


def _mining(tmp):
    path = _jsonl(tmp / "examples.jsonl", [{"query_id": "q", "pos_ids": ["p"], "pool": "a"},
                                           {"query_id": "nope", "pos_ids": ["p"], "pool": "a"}], blank_before=1)
    return lambda: mining.read_examples(path, {"q": "头痛", "p": "休息"}), path, "query_id"


def _build_rows(tmp):
    path = _jsonl(tmp / "pairs.jsonl", [
        {"source": "s", "split": "train", "text1_id": "q", "text2_id": "p", "label": 1},
        {"source": "s", "split": "train", "text1_id": "q", "text2_id": "nope", "label": 1}], blank_before=1)
    rules = [{"name": "r", "source": "s", "split": "train", "from": "pairs", "min_label": 1, "pool": "a"}]
    return lambda: build.collect_examples(tmp, rules, {"q": "头痛", "p": "休息"}), path, "text2_id"


def _export_flag(tmp):
    texts = _jsonl(tmp / "texts.jsonl", [{"id": "q", "text": "头痛"}, {"id": "p", "text": "休息"}])
    path = _jsonl(tmp / "train.jsonl", [{"query_id": "q", "pos_ids": ["p"], "neg_ids": [], "neg_scores": []},
                                        {"query_id": "q", "pos_ids": ["p"], "neg_ids": ["nope"], "neg_scores": [0.5]}],
                  blank_before=1)
    return lambda: build.export_flag(path, texts, tmp / "flag.jsonl"), path, "neg_ids"


def _training_groups(tmp):
    texts = _jsonl(tmp / "texts.jsonl", [{"id": "q", "text": "头痛"}, {"id": "p", "text": "休息"}])
    path = _jsonl(tmp / "train.jsonl", [{"query_id": "q", "pos_ids": ["p"]}, {"query_id": "q", "pos_ids": ["nope"]}],
                  blank_before=1)
    return lambda: TrainingGroups(texts, path, group_size=1), path, "pos_ids"


READERS = [_calibrate, _dedup_rows, _mining, _build_rows, _export_flag, _training_groups]


@pytest.mark.parametrize("reader", READERS, ids=[r.__name__.strip("_") for r in READERS])
def test_error_line_counts_blank_lines(tmp_path, reader):
    call, path, field = reader(tmp_path)
    with pytest.raises(DataError) as err:
        call()
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 3, field)  # line 2 is blank


# ---- 6. EpochSampler always shuffles --------------------------------------------------------------------------

def test_epoch_sampler_has_no_shuffle_option():
    assert "shuffle" not in inspect.signature(EpochSampler).parameters
    sampler = EpochSampler(50, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    assert sorted(i for _, i in first) == list(range(50)) and [i for _, i in first] != list(range(50))
    assert [i for _, i in sampler] != [i for _, i in first] and all(e == 1 for e, _ in sampler)
