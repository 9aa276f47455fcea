"""Safety of the Nano path: an `input=` task never lands in (or is carded as) the open CMedNanoOpen, the
trust_remote_code hint is an override Hydra accepts as printed, and qrels the readers cannot use are counted
and said instead of silently dropped."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import DataError, write_jsonl
from care.data.nano import NanoDataWarning, load_split
from data_pipeline.nano import stage
from data_pipeline.nano.select import NanoSourceWarning, select
from data_pipeline.nano.sources import SourceTask

TOPICS = ["头痛", "发烧", "咳嗽", "腹泻", "失眠", "高血压", "糖尿病", "皮疹", "胃痛", "贫血"]


def _beir(folder, ghost_qrels: bool = False):
    """A tiny BEIR task: one question and one answer per topic, plus 30 unrelated answers."""
    docs = {f"d{i}": f"{t}的常见原因和处理方法，第{i}条建议" for i, t in enumerate(TOPICS)}
    docs.update({f"x{i}": f"与问题无关的健康常识第{i}条，多喝水多休息" for i in range(30)})
    write_jsonl(folder / "corpus.jsonl", ({"_id": d, "text": t} for d, t in docs.items()))
    write_jsonl(folder / "queries.jsonl", ({"_id": f"q{i}", "text": f"{t}怎么办？"} for i, t in enumerate(TOPICS)))
    (folder / "qrels").mkdir(parents=True)
    lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in range(len(TOPICS))]
    if ghost_qrels:
        lines += ["ghost\td0\t1", "ghost\td1\t1", "q0\tnowhere\t1"]
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _cfg(tmp_path, tiny_bert_dir, *extra):
    return load_config("data_pipeline", ["stage=nano", f"data_dir={tmp_path / 'data'}", "model=tiny_bert",
                                         f"model.path={tiny_bert_dir}", f"nano.dense.cache={tmp_path / 'cache'}",
                                         "nano.leakage.check=false", *extra])


# ---- A: input= without out= -------------------------------------------------------------------------------

def test_input_without_out_gets_its_own_folder_and_card(tmp_path, tiny_bert_dir):
    task = _beir(tmp_path / "tasks" / "tiny_task")
    open_dir = tmp_path / "data" / "nano" / "CMedNanoOpen"
    open_dir.mkdir(parents=True)  # an open dataset already there: it must stay as it is
    (open_dir / "README.md").write_text("# CMedNanoOpen\n", encoding="utf-8")
    (open_dir / "stats.json").write_text(json.dumps({"stage": "nano", "name": "CMedNanoOpen"}), encoding="utf-8")
    before = {p.name: p.read_bytes() for p in open_dir.iterdir()}

    stats = stage.run(_cfg(tmp_path, tiny_bert_dir, f"input={task}"))

    out = tmp_path / "data" / "nano" / "Nanotiny_task"
    # stats.json names no machine path (care.paths.portable): its folder and input by their relative names
    assert stats["name"] == "Nanotiny_task" and stats["out_dir"] == "Nanotiny_task" and stats["input"] == "tiny_task"
    assert {p.name: p.read_bytes() for p in open_dir.iterdir()} == before  # untouched
    assert sorted(p.name for p in (tmp_path / "data" / "nano").iterdir()) == ["CMedNanoOpen", "Nanotiny_task"]
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "# Nanotiny_task" in card and "`tiny_task`" in card and "BEIR folder tiny_task," in card
    assert str(tmp_path) not in card
    assert "# CMedNanoOpen" not in card and "public medical sets" not in card
    assert "not NanoCMTEB, nor the open CMedNanoOpen" in card
    assert "benchmark.nano.path=" in card
    meta = json.loads((out / "reranking_hybrid_metadata.json").read_text(encoding="utf-8"))
    assert meta["source_dataset"] == "Nanotiny_task"
    assert load_split(out, "tiny_task").counts["qrels_unknown_query"] == 0


def test_output_folder_rules(tmp_path):
    cfg = load_config("data_pipeline", ["stage=nano", f"data_dir={tmp_path}"])
    opts = OmegaConf.to_container(cfg.nano, resolve=True)
    root = (tmp_path / "nano").resolve()
    assert stage.output_folder(cfg, opts) == ("CMedNanoOpen", root / "CMedNanoOpen")  # the open splits
    cfg.input = str(tmp_path / "NanoCMTEB_copy")  # already a Nano name: kept as is
    assert stage.output_folder(cfg, opts) == ("NanoCMTEB_copy", root / "NanoCMTEB_copy")
    cfg.input = str(tmp_path / "CMedNanoOpen")  # a task folder that happens to bear the open name
    assert stage.output_folder(cfg, opts) == ("NanoCMedNanoOpen", root / "NanoCMedNanoOpen")
    cfg.input = str(tmp_path / "mytask")
    assert stage.output_folder(cfg, {**opts, "name": "Mine"}) == ("Mine", root / "Mine")
    cfg.out = str(tmp_path / "elsewhere")
    assert stage.output_folder(cfg, opts) == ("Nanomytask", (tmp_path / "elsewhere").resolve())


@pytest.mark.parametrize("override", ["nano.name=CMedNanoOpen", "out={root}/nano/CMedNanoOpen",
                                      "nano.out_dir={root}/nano/CMedNanoOpen"])
def test_input_into_the_open_dataset_is_refused(tmp_path, tiny_bert_dir, override):
    task = _beir(tmp_path / "tiny_task")
    cfg = _cfg(tmp_path, tiny_bert_dir, f"input={task}", override.format(root=tmp_path / "data"))
    with pytest.raises(ValueError, match="open dataset.*CMedNanoOpen"):
        stage.run(cfg)
    assert not (tmp_path / "data").exists()  # refused before anything was written


# ---- B: the trust_remote_code hint -------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["care_tiny", "care_0.3b_4b"])  # the key absent / present in the config
def test_trust_remote_code_hint_composes_as_printed(monkeypatch, tmp_path, model):
    from care.models import towers

    def needs_code(*args, **kwargs):
        raise ValueError("The repository for x contains custom code which must be executed to correctly load "
                         "the model. Please pass the argument `trust_remote_code=True` to allow custom code.")

    monkeypatch.setattr(towers, "local_folder", lambda path, hint="": tmp_path)
    monkeypatch.setattr(towers.AutoConfig, "from_pretrained", needs_code)
    with pytest.raises(ValueError, match="needs its own modelling code") as e:
        towers._load(towers.TowerSpec(path="some/remote-code-model"), "model.query", None)
    hint = re.search(r"pass (\S+=true)", str(e.value)).group(1)
    assert hint == "++model.query.trust_remote_code=true"
    cfg = load_config("train", [f"model={model}", hint])
    assert cfg.model.query.trust_remote_code is True


# ---- C: qrels the readers cannot use ----------------------------------------------------------------------

def _nano_folder(root, qrels: dict[str, list[str]], blank_query: bool = False):
    queries = {"q1": "头痛怎么办", "q2": "发烧怎么办", **({"q3": "  "} if blank_query else {})}
    corpus = {"d1": "多休息", "d2": "多喝水", "d3": "去医院"}
    for config, table in (("queries", {"_id": list(queries), "text": list(queries.values())}),
                          ("corpus", {"_id": list(corpus), "text": list(corpus.values())}),
                          ("qrels", {"query-id": [q for q, ds in qrels.items() for _ in ds],
                                     "corpus-id": [d for ds in qrels.values() for d in ds]})):
        (root / config).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(table), root / config / "test.parquet")
    return root


def test_reader_counts_and_warns_about_qrels_of_unknown_queries(tmp_path):
    root = _nano_folder(tmp_path / "nano", {"q1": ["d1"], "q2": ["d2", "d3"], "ghost": ["d1", "d2"], "q3": ["d3"]},
                        blank_query=True)
    with pytest.warns(NanoDataWarning, match=r"qrels/test\.parquet: 3 qrels of 2 query ids that are not in the "
                                             r"queries of split test.*1 of those ids have a blank query text"):
        s = load_split(root, "test")
    assert set(s.qrels) == {"q1", "q2"}
    assert s.counts == {"queries": 2, "corpus": 3, "qrels": 3, "blank_queries_dropped": 1, "blank_docs_dropped": 0,
                        "qrels_unknown_query": 3, "qrels_unknown_query_ids": 2}


def test_reader_is_silent_on_clean_qrels_and_names_the_file_of_an_unknown_doc(tmp_path, recwarn):
    s = load_split(_nano_folder(tmp_path / "ok", {"q1": ["d1"], "q2": ["d2"]}), "test")
    assert s.counts["qrels_unknown_query"] == 0 and not [w for w in recwarn if w.category is NanoDataWarning]
    root = _nano_folder(tmp_path / "bad", {"q1": ["d1", "nowhere"]})
    with pytest.raises(DataError, match=r"qrels/test\.parquet.*positive nowhere that is not in the corpus"):
        load_split(root, "test")


def test_selection_counts_and_warns_about_qrels_of_unknown_queries_and_docs():
    task = SourceTask("t", [("q1", "头痛怎么办"), ("q2", "发烧怎么办")], [("d1", "多休息"), ("d2", "多喝水")],
                      [("q1", "d1", 1.0), ("q2", "d2", 1.0), ("ghost", "d1", 1.0), ("ghost", "d2", 0.0),
                       ("q1", "nowhere", 1.0)],
                      {"path": "/data/task", "qrels_file": "qrels/test.tsv"})
    with pytest.warns(NanoSourceWarning, match=r"/data/task/qrels/test\.tsv: 2 qrels whose query id is not in "
                                               r"the queries and 1 qrels whose corpus id is not in the corpus"):
        sel = select(task)
    q = sel.metadata["qrels_selection"]
    assert (q["positive_qrels_unknown_query"], q["non_positive_qrels_unknown_query"]) == (1, 1)
    assert (q["positive_qrels_unknown_doc"], q["non_positive_qrels_unknown_doc"]) == (1, 0)
    assert sel.qrels == {"q1": ["d1"], "q2": ["d2"]}


def test_stage_records_unknown_qrels_of_an_input_task(tmp_path, tiny_bert_dir):
    task = _beir(tmp_path / "ghosty", ghost_qrels=True)
    with pytest.warns(NanoSourceWarning, match=r"ghosty/qrels/test\.tsv: 2 qrels whose query id"):
        stats = stage.run(_cfg(tmp_path, tiny_bert_dir, f"input={task}"))
    meta = json.loads((tmp_path / "data" / "nano" / "Nanoghosty" / "metadata" / "ghosty.json").read_text())
    assert meta["qrels_selection"]["positive_qrels_unknown_query"] == 2
    assert meta["qrels_selection"]["positive_qrels_unknown_doc"] == 1
    assert stats["splits"]["ghosty"]["queries"] == len(TOPICS)
