"""The `nano` stage end to end on a small real task (cMedQA2 test texts, a tiny encoder): HAKARI's files and
columns, `datasets` loading every config, the BM25 list equal to bm25s over HAKARI's tokens, the audit of
the written files, the leakage check, and what happens to existing folders and interrupted builds."""
from __future__ import annotations

import itertools
import json
import shutil
from collections import defaultdict

import bm25s
import numpy as np
import pyarrow.parquet as pq
import pytest

from care.config import load_config
from care.data.io import DataError, write_jsonl
from care.data.nano import config_files, load_split
from care.data.stage_cache import ForeignOutputError
from care.retrieval.bm25 import wordseg
from data_pipeline.nano import split, stage
from data_pipeline.nano.candidates import NanoAuditError

CONFIGS = {"queries", "corpus", "qrels", "bm25", "tiny_bert", "reranking_hybrid",
           "mteb-corpus", "mteb-queries", "mteb-qrels", "mteb-top_ranked"}


@pytest.fixture(scope="module")
def beir(shared, tmp_path_factory):
    """40 cMedQA2 test questions, their judged answers (label 1 positive, 0 non-positive) and 300 more
    answers of the file, as a BEIR folder."""
    rows = [line.split("\t") for line in (shared / "chineseblue_cmedqa2_pairs" / "test.txt")
            .read_text(encoding="utf-8").splitlines() if line.count("\t") == 2]
    by_question = defaultdict(list)
    for label, question, answer in rows:
        by_question[question.strip()].append((answer.strip(), int(label)))
    questions = [q for q, judged in by_question.items() if any(lab for _, lab in judged)][:40]
    answers = list(dict.fromkeys(a for _, _, a in rows))[:600]
    doc_id = {}
    for q in questions:
        for a, _ in by_question[q]:
            doc_id.setdefault(a, f"d{len(doc_id)}")
    for a in answers:
        if len(doc_id) >= 360:
            break
        doc_id.setdefault(a, f"d{len(doc_id)}")
    folder = tmp_path_factory.mktemp("tasks") / "cmedqa2_small"
    write_jsonl(folder / "corpus.jsonl", ({"_id": i, "text": a} for a, i in doc_id.items()))
    write_jsonl(folder / "queries.jsonl", ({"_id": f"q{n}", "text": q} for n, q in enumerate(questions)))
    (folder / "qrels").mkdir()
    lines = ["query-id\tcorpus-id\tscore\n"] + [f"q{n}\t{doc_id[a]}\t{lab}\n" for n, q in enumerate(questions)
                                                for a, lab in by_question[q]]
    (folder / "qrels" / "test.tsv").write_text("".join(lines), encoding="utf-8")
    return folder


def _cfg(beir_dir, out, tiny_bert_dir, cache, *extra):
    return load_config("data_pipeline", ["stage=nano", f"input={beir_dir}", f"out={out}", "model=tiny_bert",
                                         f"model.path={tiny_bert_dir}", f"nano.dense.cache={cache}",
                                         "nano.dense.shard_size=100", "nano.leakage.check=false", *extra])


@pytest.fixture(scope="module")
def built(beir, tiny_bert_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nano")
    cfg = _cfg(beir, tmp / "NanoSmall", tiny_bert_dir, tmp / "cache")
    return tmp / "NanoSmall", stage.run(cfg), cfg


def test_files_load_with_datasets_in_hakari_columns(built):
    import datasets

    out, stats, _ = built
    assert set(config_files(out)) == CONFIGS and stats["dense"] == "tiny_bert"
    split = "cmedqa2_small"
    columns = {"queries": ["_id", "text"], "corpus": ["_id", "text"], "qrels": ["query-id", "corpus-id"],
               "mteb-qrels": ["query-id", "corpus-id", "score"]}
    for config in CONFIGS:
        ds = datasets.load_dataset(str(out), config, split=split)
        assert ds.column_names == columns.get(config.replace("mteb-", "") if config != "mteb-qrels" else config,
                                              ["query-id", "corpus-ids"]), config
    queries = datasets.load_dataset(str(out), "queries", split=split)
    assert queries.num_rows == stats["splits"][split]["queries"] == 40
    assert pq.read_schema(out / "bm25" / f"{split}.parquet").field("corpus-ids").type.value_type == "string"
    meta = json.loads((out / "reranking_hybrid_metadata.json").read_text())
    assert set(meta["configs"]) == {"bm25", "tiny_bert", "reranking_hybrid"}
    assert meta["configs"]["reranking_hybrid"]["rrf_k"] == 100 and meta["configs"]["reranking_hybrid"]["random_seed"] == 20260524
    hybrid = meta["splits"][split]["reranking_hybrid"]
    assert hybrid["query_coverage"] == 1.0 and hybrid["safeguard_rank"] == 101
    assert hybrid["safeguard_positive_count"] == len(hybrid["additions"])
    per_split = json.loads((out / "metadata" / f"{split}.json").read_text())
    assert per_split["query_selection"]["skipped_queries_without_positive_qrels"] == 0
    assert set(per_split["files_sha256"]) >= {f"{c}/{split}.parquet" for c in ("corpus", "queries", "qrels", "bm25")}
    card = (out / "README.md").read_text()
    assert "## Split Statistics" in card and "## Candidate Quality" in card and "not NanoCMTEB" in card
    assert f"| {split} | wordseg@zh |" in card


def test_bm25_list_is_bm25s_robertson_over_hakari_tokens(built):
    """The stored list equals an independent bm25s run (k1 1.5, b 0.75, robertson) over jieba tokens with
    punctuation kept: the same ids in the same order wherever scores differ (ties may swap)."""
    out, _, _ = built
    s = load_split(out, "cmedqa2_small")
    ids, docs = list(s.corpus), list(s.corpus.values())
    index = bm25s.BM25(k1=1.5, b=0.75, method="robertson")
    index.index([wordseg(d) for d in docs], show_progress=False)
    for qid, stored in s.candidates["bm25"].items():
        assert len(stored) == len(ids)  # the corpus is under 500 documents: everything ranked
        scores = dict(zip(ids, index.get_scores(wordseg(s.queries[qid]))))
        got = [scores[d] for d in stored]
        assert all(a >= b - 1e-6 for a, b in itertools.pairwise(got)), qid
        want = sorted(scores.values(), reverse=True)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_rerun_is_skipped_and_a_changed_config_rebuilds(built, beir, tiny_bert_dir):
    out, stats, cfg = built
    again = stage.run(cfg)
    assert again.get("skipped") and again["fingerprint"] == stats["fingerprint"]
    cache = cfg.nano.dense.cache
    changed = stage.run(_cfg(beir, out, tiny_bert_dir, cache, "nano.corpus_order=hashed"))
    assert not changed.get("skipped") and changed["fingerprint"] != stats["fingerprint"]
    assert changed["embeddings_encoded"] == 0  # every vector came from the cache
    s = load_split(out, "cmedqa2_small")
    first_docs = list(s.corpus)[:5]
    assert first_docs != [d for q in s.qrels for d in s.qrels[q]][:5]  # positives no longer lead the corpus
    stage.run(cfg)  # back to the default order for the other tests


def test_audit_catches_a_corrupted_file(built, tmp_path):
    import pyarrow as pa

    out, _, _ = built
    copy = tmp_path / "corrupt"
    shutil.copytree(out, copy)
    assert stage.audit_folder(copy) == ["cmedqa2_small"]
    path = copy / "reranking_hybrid" / "cmedqa2_small.parquet"
    table = pq.read_table(path).to_pylist()
    table[3]["corpus-ids"] = table[3]["corpus-ids"][:-1] + table[3]["corpus-ids"][:1]  # a duplicate candidate
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), path)
    with pytest.raises(NanoAuditError, match="duplicate candidate"):
        stage.audit_folder(copy)


def test_a_folder_the_stage_did_not_write_is_refused(beir, tiny_bert_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes", encoding="utf-8")
    with pytest.raises(ForeignOutputError, match="refusing to overwrite"):
        stage.run(_cfg(beir, mine, tiny_bert_dir, tmp_path / "cache"))
    assert (mine / "README.md").read_text(encoding="utf-8") == "my notes"


def test_an_interrupted_build_keeps_the_previous_dataset_and_its_vectors(built, beir, tiny_bert_dir, tmp_path,
                                                                         monkeypatch):
    out, _, cfg = built
    before = (out / "stats.json").read_bytes()
    real = split.bm25_lists

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(split, "bm25_lists", fail)
    with pytest.raises(KeyboardInterrupt):
        stage.run(_cfg(beir, out, tiny_bert_dir, cfg.nano.dense.cache, "nano.seed=1"))
    assert (out / "stats.json").read_bytes() == before  # nothing half-written, the old dataset intact
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".NanoSmall")]
    monkeypatch.setattr(split, "bm25_lists", real)


def test_bad_tasks_are_named(beir, tiny_bert_dir, tmp_path):
    none = tmp_path / "no_positives"
    shutil.copytree(beir, none)
    lines = (none / "qrels" / "test.tsv").read_text(encoding="utf-8").splitlines()
    (none / "qrels" / "test.tsv").write_text("\n".join([lines[0]] + [line.rsplit("\t", 1)[0] + "\t0" for line in lines[1:]])
                                             + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no_positives"):
        stage.run(_cfg(none, tmp_path / "out", tiny_bert_dir, tmp_path / "cache"))
    with pytest.raises(FileNotFoundError):
        stage.run(_cfg(tmp_path / "nowhere", tmp_path / "out2", tiny_bert_dir, tmp_path / "cache"))


def test_leakage_check_stops_a_nano_query_in_training(built, tmp_path):
    """A Nano query among the training queries (a near duplicate: one character added) stops the build;
    a clean training set passes."""
    out, _, _ = built
    s = load_split(out, "cmedqa2_small")
    query = next(iter(s.queries.values()))
    from data_pipeline.nano.select import Selection

    sel = {"cmedqa2_small": Selection(s.queries, s.corpus, {q: list(j) for q, j in s.qrels.items()}, {})}
    opts = load_config("data_pipeline").build.leakage
    build = tmp_path / "build"
    write_jsonl(build / "texts.jsonl", [{"id": "t:q", "text": "完全无关的训练问题，讲的是牙齿美白的方法"},
                                        {"id": "t:a", "text": "刷牙"}])
    write_jsonl(build / "examples.jsonl", [{"query_id": "t:q", "pos_ids": ["t:a"]}])
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(opts, resolve=True)
    assert stage.leakage_check(sel, build, options)["leaks"] == 0
    write_jsonl(build / "texts.jsonl", [{"id": "t:q", "text": query + "啊"}, {"id": "t:a", "text": "刷牙"}])
    with pytest.raises(DataError, match="Nano queries are in the training data"):
        stage.leakage_check(sel, build, options)
