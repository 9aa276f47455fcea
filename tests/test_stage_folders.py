"""What a pipeline stage may do to its output folder (care/data/stage_start.py, care/data/stage_cache.py): the
nano stage, which replaces its whole folder, never deletes what it did not write (a user's `out=` folder, the
folder holding CMedNanoOpen, a file added to a dataset it built) but refuses, whatever force says; two input
folders with one last name do not replace each other's Nano<name>; a corrupt stats.json is called corrupt.
The reference is the file system itself: every byte of the user's files is compared before and after."""
from __future__ import annotations

import json

import pytest

from care.config import load_config
from care.data.io import write_jsonl
from care.data.stage_cache import ForeignOutputError
from data_pipeline import import_stage
from data_pipeline.nano import stage as nano

TOPICS = ["头痛", "发烧", "咳嗽", "腹泻", "失眠", "高血压", "糖尿病", "皮疹", "胃痛", "贫血"]


def task(folder, tag: str = ""):
    """A tiny BEIR task (a question and an answer per topic, 30 unrelated answers)."""
    docs = {f"d{i}": f"{t}的常见原因和处理方法，第{i}条建议{tag}" for i, t in enumerate(TOPICS)}
    docs.update({f"x{i}": f"与问题无关的健康常识第{i}条，多喝水多休息" for i in range(30)})
    write_jsonl(folder / "corpus.jsonl", ({"_id": d, "text": t} for d, t in docs.items()))
    write_jsonl(folder / "queries.jsonl", ({"_id": f"q{i}", "text": f"{t}怎么办？"} for i, t in enumerate(TOPICS)))
    (folder / "qrels").mkdir(parents=True)
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(len(TOPICS))), encoding="utf-8")
    return folder


def nano_cfg(tmp_path, tiny_bert_dir, *extra):
    return load_config("data_pipeline", ["stage=nano", f"data_dir={tmp_path / 'data'}", "model=tiny_bert",
                                         f"model.path={tiny_bert_dir}", f"nano.dense.cache={tmp_path / 'cache'}",
                                         "nano.leakage.check=false", *extra])


def snapshot(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("force", [False, True])
def test_nano_out_a_users_folder_refuses_and_keeps_its_files(tmp_path, tiny_bert_dir, force):
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("my notes", encoding="utf-8")
    (user / "sub" / "x.txt").write_text("x", encoding="utf-8")
    before = snapshot(user)
    cfg = nano_cfg(tmp_path, tiny_bert_dir, f"input={task(tmp_path / 'retrieval')}", f"out={user}",
                   f"force={str(force).lower()}")
    with pytest.raises(ForeignOutputError, match=r"it holds notes.txt \(and 1 more: sub/\).*out=DIR") as e:
        nano.run(cfg)
    assert "\n" not in str(e.value) and "force=true does not delete" in str(e.value)
    assert snapshot(user) == before and sorted(p.name for p in user.iterdir()) == ["notes.txt", "sub"]


def test_nano_out_the_nano_root_does_not_delete_cmednanoopen(tmp_path, tiny_bert_dir):
    root = tmp_path / "data" / "nano"
    (root / "CMedNanoOpen").mkdir(parents=True)
    (root / "CMedNanoOpen" / "README.md").write_text("# CMedNanoOpen\n", encoding="utf-8")
    before = snapshot(root)
    with pytest.raises(ForeignOutputError, match=r"it holds CMedNanoOpen/"):
        nano.run(nano_cfg(tmp_path, tiny_bert_dir, f"input={task(tmp_path / 'retrieval')}", f"out={root}"))
    assert snapshot(root) == before and [p.name for p in root.iterdir()] == ["CMedNanoOpen"]


def test_a_file_added_to_a_built_nano_folder_is_kept(tmp_path, tiny_bert_dir):
    source = task(tmp_path / "retrieval")
    nano.run(nano_cfg(tmp_path, tiny_bert_dir, f"input={source}"))
    out = tmp_path / "data" / "nano" / "Nanoretrieval"
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    (out / "corpus" / "notes.txt").write_text("mine too", encoding="utf-8")
    changed = nano_cfg(tmp_path, tiny_bert_dir, f"input={source}", "nano.seed=7")
    with pytest.raises(ForeignOutputError, match=r"it holds corpus/notes.txt \(and 1 more: notes.txt\)"):
        nano.run(changed)
    (out / "corpus" / "notes.txt").unlink()
    (out / "notes.txt").unlink()
    assert not nano.run(changed).get("skipped")  # its own files only: rebuilt


def test_two_inputs_with_one_last_name_do_not_replace_each_other(tmp_path, tiny_bert_dir):
    a, b = task(tmp_path / "a" / "retrieval", "甲"), task(tmp_path / "b" / "retrieval", "乙")
    first = nano.run(nano_cfg(tmp_path, tiny_bert_dir, f"input={a}"))
    out = tmp_path / "data" / "nano" / "Nanoretrieval"
    before = snapshot(out)
    with pytest.raises(ForeignOutputError) as e:
        nano.run(nano_cfg(tmp_path, tiny_bert_dir, f"input={b}"))
    message = str(e.value)
    assert f"built from another input folder (recorded as retrieval), not input={b.resolve()}" in message, message
    assert "out=DIR" in message and "force=true" in message and "\n" not in message
    assert snapshot(out) == before and first["input_key"] == nano.input_key(str(a.resolve()))
    assert json.loads((out / "stats.json").read_text(encoding="utf-8"))["input_key"] == nano.input_key(str(a.resolve()))
    other = nano.run(nano_cfg(tmp_path, tiny_bert_dir, f"input={b}", f"out={tmp_path / 'Nanoretrieval_b'}"))
    assert other["input_key"] == nano.input_key(str(b.resolve())) and snapshot(out) == before
    forced = nano.run(nano_cfg(tmp_path, tiny_bert_dir, f"input={b}", "force=true"))
    assert forced["input_key"] == nano.input_key(str(b.resolve()))
    assert json.loads((out / "stats.json").read_text(encoding="utf-8"))["input_key"] == nano.input_key(str(b.resolve()))


def test_a_corrupt_stats_json_is_called_corrupt(tmp_path):
    write_jsonl(tmp_path / "src" / "r" / "t.jsonl", [{"query": "头痛", "positive": ["休息"], "negative": ["运动"]}])
    out = tmp_path / "import"
    out.mkdir()
    (out / "texts.jsonl").write_text("{}\n", encoding="utf-8")
    (out / "stats.json").write_text('{"stage": "import", "fingerprint": ', encoding="utf-8")  # cut short
    cfg = load_config("data_pipeline", [f"data_dir={tmp_path}", f"data.root={tmp_path / 'src'}"])
    cfg.data.sources = {"r": {"reader": "cmteb_reranking", "path": "r", "files": {"test": "t.jsonl"}}}
    with pytest.raises(ForeignOutputError) as e:
        import_stage.run(cfg)
    message = str(e.value)
    assert f"{out / 'stats.json'} is corrupt or unreadable (not valid JSON" in message, message
    assert "not written by stage" not in message and "force=true" in message
    assert (out / "texts.jsonl").read_text(encoding="utf-8") == "{}\n"
