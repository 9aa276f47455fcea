"""The Nano builder's Stage A (data_pipeline/nano/sources.py, select.py): HAKARI's normalisation, query and
corpus selection (docs/nano.md s.2-4) on hand-made tasks whose results can be worked out by hand, the task
readers on tiny BEIR and parquet folders, and the four shared-data splits."""
from __future__ import annotations

import csv
import hashlib
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import DataError, write_jsonl
from data_pipeline.nano.select import select
from data_pipeline.nano.shared_data import shared_tasks
from data_pipeline.nano.sources import SourceTask, read_task


def task(queries, corpus, qrels, name="t") -> SourceTask:
    """A SourceTask from {qid: text}, {did: text} (or lists of pairs) and (qid, did[, score]) tuples."""
    pairs = (lambda x: list(x.items()) if isinstance(x, dict) else list(x))
    scored = [(q[0], q[1], float(q[2]) if len(q) > 2 else 1.0) for q in qrels]
    return SourceTask(name, pairs(queries), pairs(corpus), scored, {"path": "hand-made"})


# ---- query selection (docs/nano.md s.3) ---------------------------------------------------------------

def test_queries_skip_no_positive_duplicate_ids_and_texts_and_stop_at_the_limit():
    queries = [("q1", "头痛"), ("q2", "发热"), ("q1", "咳嗽"), ("q3", " 头痛 "), ("q4", "乏力"), ("q5", "腹泻"),
               ("q6", "失眠")]
    corpus = {f"d{i}": f"文档{i}" for i in range(1, 7)}
    qrels = [("q1", "d1"), ("q2", "d2"), ("q3", "d3"), ("q4", "d4", 0), ("q5", "d5"), ("q6", "d6")]
    sel = select(task(queries, corpus, qrels), query_limit=3)
    assert list(sel.queries) == ["q1", "q2", "q5"]  # q6 is never reached: the walk stops at 3
    qs = sel.metadata["query_selection"]
    assert (qs["skipped_duplicate_query_ids"], qs["skipped_duplicate_query_texts"],
            qs["skipped_queries_without_positive_qrels"]) == (1, 1, 1)
    assert sel.qrels == {"q1": ["d1"], "q2": ["d2"], "q5": ["d5"]}
    assert sel.metadata["source_positive_qrels"] == 5 and sel.metadata["source_non_positive_qrels"] == 1

    kept = select(task(queries, corpus, qrels), query_limit=3, dedupe_query_texts=False)
    assert list(kept.queries) == ["q1", "q2", "q3"]  # the same text twice, both kept without the dedupe


def test_no_query_selected_and_no_positive_are_errors_naming_the_task():
    with pytest.raises(ValueError, match="'lonely'.*skipped_queries_without_positive_qrels"):
        select(task({"q1": "头痛"}, {"d1": "休息"}, [("q9", "d1")], name="lonely"))
    # Its only positive is missing from the corpus: selected, then removed by the post-filter.
    with pytest.raises(ValueError, match="'gone'.*lost its positives"):
        select(task({"q1": "头痛"}, {"d1": "休息"}, [("q1", "d404")], name="gone"))


# ---- corpus selection and post-filter (docs/nano.md s.4) -----------------------------------------------

def test_a_positive_duplicating_an_earlier_document_loses_its_qrel_and_its_query():
    corpus = [("f1", "填充一"), ("p2", "同一个回答"), ("p1", "同一个回答"), ("p3", "另一个回答"), ("p4", "同一个回答")]
    qrels = [("q1", "p1"), ("q2", "p2"), ("q3", "p3"), ("q3", "p4")]
    sel = select(task({"q1": "问一", "q2": "问二", "q3": "问三"}, corpus, qrels))
    # p1 comes first in qrels order, so its copy p2 (earlier in the corpus) and p4 are left out.
    assert list(sel.corpus) == ["p1", "p3", "f1"]
    assert sel.qrels == {"q1": ["p1"], "q3": ["p3"]} and list(sel.queries) == ["q1", "q3"]
    m = sel.metadata
    assert m["corpus_selection"]["duplicate_doc_texts_removed"] == 2
    assert m["qrels_selection"]["removed_queries_after_corpus_filter"] == 1
    assert m["qrels_selection"]["removed_qrels_after_corpus_filter"] == 2
    assert (m["queries"], m["qrels"], m["query_selection"]["selected_before_corpus_filter"]) == (2, 2, 3)

    whole = select(task({"q1": "问一", "q2": "问二", "q3": "问三"}, corpus, qrels), dedupe_doc_texts=False)
    assert list(whole.corpus) == ["p1", "p2", "p3", "p4", "f1"] and len(whole.queries) == 3


def test_non_positives_round_robin_over_sorted_query_ids():
    queries = [("qb", "乙"), ("qa", "甲"), ("qc", "丙")]
    corpus = [(f"{k}", f"文{k}") for k in ("f1", "n1", "n2", "n3", "n4", "n5", "pa", "pb", "pc")]
    qrels = [("qb", "pb"), ("qa", "pa"), ("qc", "pc"),
             ("qa", "n1", 0), ("qa", "n2", 0), ("qa", "n3", 0),
             ("qb", "n4", 0), ("qb", "n1", 0), ("qb", "n4", 0),  # n4 twice for qb: dropped within the group
             ("qc", "n5", -1), ("qc", "n404", 0)]
    sel = select(task(queries, corpus, qrels))
    # sorted qa, qb, qc: 1st of each (n1, n4, n5), then 2nd (n2; qb's n1 already in), then 3rd (n3).
    assert list(sel.corpus) == ["pb", "pa", "pc", "n1", "n4", "n5", "n2", "n3", "f1"]
    assert list(sel.queries) == ["qb", "qa", "qc"]  # the query table keeps selection order
    cs = sel.metadata["corpus_selection"]
    assert (cs["source_hard_negative_doc_candidates"], cs["kept_hard_negative_docs"],
            cs["missing_hard_negative_docs"], cs["fill_docs"]) == (6, 5, 1, 1)
    assert sel.metadata["qrels_selection"]["duplicate_non_positive_qrels_removed"] == 1
    assert sel.metadata["source_non_positive_qrels"] == 7
    assert sel.qrels == {"qb": ["pb"], "qa": ["pa"], "qc": ["pc"]}  # non-positives never become qrels


def test_fill_takes_source_order_up_to_the_fill_limit_and_the_doc_limit():
    fill = [(f"f{i}", f"填充{i}") for i in range(15)]
    sel = select(task({"q1": "问"}, [*fill, ("p1", "答")], [("q1", "p1")]), doc_limit=3)
    assert list(sel.corpus) == ["p1", "f0", "f1"]
    cs = sel.metadata["corpus_selection"]
    assert cs["fill_candidate_limit"] == 9 and cs["fill_docs"] == 2 and not cs["corpus_below_doc_limit"]

    # The first 9 rows (max(3 * 3, 3 + 1)) are the only fill candidates: 9 copies of one text give one
    # document, and f9.. (distinct, but past the limit) are never looked at.
    same = [(f"f{i}", "同" if i < 9 else f"填充{i}") for i in range(15)]
    short = select(task({"q1": "问"}, [*same, ("p1", "答")], [("q1", "p1")]), doc_limit=3)
    assert list(short.corpus) == ["p1", "f0"]
    cs = short.metadata["corpus_selection"]
    assert cs["duplicate_doc_texts_removed"] == 8 and cs["corpus_below_doc_limit"]
    assert cs["source_corpus_rows"] == 16 and cs["fill_candidates"] == 9


def test_qrels_cap_and_a_missing_positive():
    corpus = {f"p{i}": f"答{i}" for i in range(5)}
    qrels = [("q1", f"p{i}") for i in (3, 1, 4, 0, 2)] + [("q2", "p404"), ("q2", "p0")]
    sel = select(task({"q1": "问一", "q2": "问二"}, corpus, qrels), qrels_cap=2)
    assert sel.qrels == {"q1": ["p3", "p1"], "q2": ["p0"]}  # the first two of q1 in qrels order
    assert set(sel.corpus) == set(corpus)  # the cap trims qrels, not the corpus
    assert sel.metadata["qrels_selection"]["removed_qrels_over_cap"] == 3
    assert sel.metadata["corpus_selection"]["missing_positive_docs"] == 1
    assert sel.metadata["qrels"] == 3


def test_hashed_order_is_a_permutation_independent_of_row_order():
    corpus = [(f"d{i}", f"文档{i}") for i in range(30)]
    qrels = [(f"q{i}", f"d{i}") for i in range(5)]
    queries = {f"q{i}": f"问题{i}" for i in range(5)}
    plain = select(task(queries, corpus, qrels))
    hashed = select(task(queries, corpus, qrels), corpus_order="hashed")
    assert list(plain.corpus)[:5] == [f"d{i}" for i in range(5)]  # HAKARI: positives first
    assert sorted(hashed.corpus) == sorted(plain.corpus) and list(hashed.corpus) != list(plain.corpus)
    assert hashed.corpus == plain.corpus and hashed.qrels == plain.qrels  # same rows, same texts
    key = (lambda d: hashlib.sha256(f"20260524\0{d}".encode()).hexdigest())
    assert list(hashed.corpus) == sorted(plain.corpus, key=key)

    shuffled = corpus[:]
    random.Random(3).shuffle(shuffled)
    again = select(task(queries, shuffled, qrels[::-1]), corpus_order="hashed")  # the whole corpus fits
    assert list(again.corpus) == list(hashed.corpus)
    other = select(task(queries, corpus, qrels), corpus_order="hashed", seed=7)
    assert list(other.corpus) != list(hashed.corpus)


def test_random_selection_is_reproducible_per_seed_and_differs_across_seeds():
    queries = {f"q{i:02d}": f"问题{i}" for i in range(60)}
    corpus = [(f"d{i:02d}", f"文档{i}") for i in range(200)]
    t = task(queries, corpus, [(q, f"d{i:02d}") for i, q in enumerate(queries)])
    opts = {"query_selection": "random", "query_limit": 10, "doc_limit": 40}
    one, same, two = select(t, seed=1, **opts), select(t, seed=1, **opts), select(t, seed=2, **opts)
    assert list(one.queries) == list(same.queries) and list(one.corpus) == list(same.corpus)
    assert set(one.queries) != set(two.queries)
    assert list(select(t, query_limit=10).queries) == [f"q{i:02d}" for i in range(10)]  # first = source order
    assert one.metadata["query_selection"]["seed"] == 1
    assert "seed" not in select(t).metadata["query_selection"]
    # The fill is a sample of the rows, not their beginning: with 10 positives and 30 fill documents
    # out of 200, source order would end at d39.
    fill = [d for d in one.corpus if d not in {d for ds in one.qrels.values() for d in ds}]
    assert len(fill) == 30 and max(fill) > "d39"
    assert one.metadata["corpus_selection"]["fill_policy"] == "seeded_random_sample"


# ---- readers ------------------------------------------------------------------------------------------

def _beir(folder, corpus_rows, query_rows, qrels_lines, split="test"):
    write_jsonl(folder / "corpus.jsonl", corpus_rows)
    write_jsonl(folder / "queries.jsonl", query_rows)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(qrels_lines),
                                                   encoding="utf-8")
    return folder


def test_beir_reader_normalises_like_hakari(tmp_path):
    folder = _beir(tmp_path / "beir", [
        {"_id": 1, "title": "头痛", "text": "多休息"},
        {"_id": "d2", "title": "发热", "text": "发热"},
        {"_id": "d3", "title": "", "text": "  咳嗽 "},
        {"_id": "d4", "title": "只有标题"},
        {"_id": "d5", "title": " ", "text": ""},
        {"_id": "", "text": "无编号"},
        {"id": "d6", "contents": "内容"},
    ], [{"_id": "q1", "text": "头痛怎么办"}, {"_id": "q2", "text": "", "query": None, "question": "发热吗"},
        {"_id": "q3", "text": " "}],
        ["q1\t1\t2\n", "q1\td3\t0\n", "q2\td2\t1\n"])
    t = read_task(folder, name="mine")
    assert t.name == "mine" and t.provenance["split"] == "test" and t.provenance["layout"] == "beir"
    assert t.corpus == [("1", "头痛\n\n多休息"), ("d2", "发热"), ("d3", "咳嗽"), ("d4", "只有标题"), ("d6", "内容")]
    assert t.queries == [("q1", "头痛怎么办"), ("q2", "发热吗")]
    assert t.qrels == [("q1", "1", 2.0), ("q1", "d3", 0.0), ("q2", "d2", 1.0)]
    assert t.provenance["dropped_empty"] == {"corpus_rows": 2, "queries": 1, "qrels": 0}

    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq1\t1\t1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="several splits.*dev, test"):
        read_task(folder)
    assert read_task(folder, "dev").qrels == [("q1", "1", 1.0)]


def test_beir_reader_errors_name_file_line_and_field(tmp_path):
    folder = _beir(tmp_path / "bad", [{"_id": "d1", "text": "头痛"}], [{"_id": "q1", "text": "问"}],
                   ["q1\td1\t1\n"])
    with open(folder / "corpus.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"_id": "d2", "text": "x"}\n{"_id": "d3", "text": \n')
    with pytest.raises(DataError) as err:
        read_task(folder)
    assert err.value.line == 3 and err.value.path.endswith("corpus.jsonl") and "line 3" in str(err.value)

    folder = _beir(tmp_path / "score", [{"_id": "d1", "text": "头痛"}], [{"_id": "q1", "text": "问"}],
                   ["q1\td1\t1\n", "q1\td1\thigh\n"])
    with pytest.raises(DataError) as err:
        read_task(folder)
    assert (err.value.line, err.value.field) == (3, "score") and "test.tsv" in str(err.value)


def _parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_parquet_reader_mteb_layout_through_the_readme_configs(tmp_path):
    folder = tmp_path / "CmedqaLike"
    _parquet(folder / "corpus" / "corpus-00000-of-00001.parquet",  # C-MTEB names the corpus split "corpus"
             [{"_id": "d1", "title": "标题", "text": "正文"}, {"_id": "d2", "title": "", "text": "二"},
              {"_id": "d3", "title": "三", "text": "三"}])
    _parquet(folder / "queries" / "dev-00000-of-00001.parquet",
             [{"_id": "q1", "text": "问一"}, {"_id": "q2", "text": "问二"}])
    _parquet(folder / "qrels" / "dev-00000-of-00001.parquet",  # not listed in the README: must be ignored
             [{"query-id": "q1", "corpus-id": "d3"}])
    _parquet(folder / "data" / "dev-00000-of-00001.parquet",
             [{"query-id": "q1", "corpus-id": "d1", "score": 1},
              {"query-id": "q2", "corpus-id": "d2", "score": 0},
              {"query-id": "q2", "corpus-id": "d3", "score": 2}])
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: corpus\n  data_files:\n  - split: corpus\n    path: corpus/corpus-*.parquet\n"
        "- config_name: queries\n  data_files:\n  - split: dev\n    path: queries/dev-*.parquet\n"
        "- config_name: default\n  data_files:\n  - split: dev\n    path: data/dev-*.parquet\n"
        "---\n# a retrieval task\n", encoding="utf-8")
    t = read_task(folder)
    assert t.name == "CmedqaLike" and t.provenance["files_from"] == "README configs"
    assert t.provenance["qrels_config"] == "default" and t.provenance["split"] == "dev"
    assert t.corpus == [("d1", "标题\n\n正文"), ("d2", "二"), ("d3", "三")]
    assert t.queries == [("q1", "问一"), ("q2", "问二")]
    assert t.qrels == [("q1", "d1", 1.0), ("q2", "d2", 0.0), ("q2", "d3", 2.0)]


def test_parquet_reader_hakari_layout_from_files(tmp_path):
    folder = tmp_path / "NanoX"
    _parquet(folder / "corpus" / "med.parquet", [{"_id": "d1", "text": "一"}, {"_id": "d2", "text": "二"},
                                                 {"_id": "d3", "text": "三"}])
    _parquet(folder / "queries" / "med.parquet", [{"_id": "q1", "text": "问一"}, {"_id": "q2", "text": "问二"}])
    _parquet(folder / "qrels" / "med.parquet", [{"query-id": "q1", "corpus-id": ["d1", "d3"]},
                                                {"query-id": "q2", "corpus-id": ["d2"]}])
    # A `default` config beside `qrels`: qrels wins.
    _parquet(folder / "default" / "med.parquet", [{"query-id": "q2", "corpus-id": "d1", "score": 1}])
    t = read_task(folder)
    assert t.provenance["files_from"] == "<config>/<split>*.parquet" and t.provenance["split"] == "med"
    assert t.provenance["qrels_config"] == "qrels"
    assert t.qrels == [("q1", "d1", 1.0), ("q1", "d3", 1.0), ("q2", "d2", 1.0)]  # no score: every qrel 1.0
    assert [d for d, _ in t.corpus] == ["d1", "d2", "d3"]

    _parquet(folder / "qrels" / "other-00000-of-00002.parquet", [{"query-id": "q1", "corpus-id": "d2"}])
    _parquet(folder / "qrels" / "other-00001-of-00002.parquet", [{"query-id": "q2", "corpus-id": "d1"}])
    with pytest.raises(ValueError, match="several splits.*med, other"):
        read_task(folder)
    # Shards read in name order; corpus and queries have one split, used for any qrels split.
    assert read_task(folder, "other").qrels == [("q1", "d2", 1.0), ("q2", "d1", 1.0)]


def test_task_errors_no_positive_and_missing_folders(tmp_path):
    folder = _beir(tmp_path / "neg", [{"_id": "d1", "text": "头痛"}], [{"_id": "q1", "text": "问"}],
                   ["q1\td1\t0\n"])
    with pytest.raises(ValueError, match="'negatives only'.*no qrel with score > 0"):
        read_task(folder, name="negatives only")
    with pytest.raises(FileNotFoundError, match="nowhere.*BEIR folder.*parquet"):
        read_task(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*BEIR folder"):
        read_task(tmp_path / "empty")
    (tmp_path / "half" / "corpus").mkdir(parents=True)
    _parquet(tmp_path / "half" / "corpus" / "dev.parquet", [{"_id": "d1", "text": "一"}])
    with pytest.raises(FileNotFoundError, match="no config queries, qrels or default"):
        read_task(tmp_path / "half")


# ---- the shared data ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tasks(shared):
    data = OmegaConf.to_container(load_config("data_pipeline").data, resolve=True)
    return shared_tasks(data)


@pytest.fixture(scope="module")
def selections(tasks):
    return {name: select(t) for name, t in tasks.items()}


def _raw_counts(shared) -> dict:
    """The sizes straight from the files, without the project's readers (the independent reference)."""
    kuake = [shared / "cblue_kuake_qtr" / f"KUAKE-QTR_{split}.json" for split in ("train", "dev", "test")]
    titles = {r["title"].strip() for path in kuake for r in json.loads(path.read_text(encoding="utf-8"))}
    urls = set()  # cMedIR: one id per (url, title), a stray leading ':' cut
    for name in ("dev.json", "test.json"):
        for line in (shared / "chineseblue_cmedir" / name).read_text(encoding="utf-8").splitlines():
            urls |= {(d["url"], d["title"].removeprefix(":").strip()) for d in json.loads(line)["documents"]}
    with open(shared / "cepilepsyqa" / "test_candidates.txt", encoding="utf-8") as fh:
        epilepsy_questions = {r["question_id"] for r in csv.DictReader(fh)}
    with open(shared / "chineseblue_cmedqa2_pairs" / "test.txt", encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t"))
    positives: dict[str, int] = {}
    for label, q, _ in rows:
        positives[q.strip()] = positives.get(q.strip(), 0) + int(label)
    return {"kuake_qtr": len(titles - {""}), "cmedir": len(urls),
            "cepilepsyqa_queries": len(epilepsy_questions),
            "cmedqa2_answers": len({a.strip() for _, _, a in rows}),
            "cmedqa2_queries": sum(1 <= n <= 2 for n in positives.values())}


def test_shared_tasks_sizes(tasks, shared):
    assert list(tasks) == ["kuake_qtr", "cmedir", "cepilepsyqa", "cmedqa2"]
    sizes = {n: (len(t.queries), len(t.corpus)) for n, t in tasks.items()}
    assert sizes == {"kuake_qtr": (2369, 32172), "cmedir": (4287, 19426), "cepilepsyqa": (490, 4900),
                     "cmedqa2": (124, 5106)}
    raw = _raw_counts(shared)
    assert (raw["kuake_qtr"], raw["cmedir"], raw["cepilepsyqa_queries"]) == (32172, 19426, 490)
    assert (raw["cmedqa2_queries"], raw["cmedqa2_answers"]) == (124, 5106)
    for t in tasks.values():
        ids = {d for d, _ in t.corpus}
        assert len(ids) == len(t.corpus) and len({q for q, _ in t.queries}) == len(t.queries)
        assert all(":" not in q for q, _ in t.queries) and all(d in ids for _, d, _ in t.qrels)
    assert any(d.startswith("http://") for d, _ in tasks["cmedir"].corpus)  # urls kept whole
    assert {s for *_, s in tasks["cmedir"].qrels} == {0.0, 2.0, 3.0, 4.0}  # labels 0-1 -> 0
    assert {s for *_, s in tasks["kuake_qtr"].qrels} == {0.0, 1.0, 2.0, 3.0}
    assert sum(s > 0 for *_, s in tasks["cepilepsyqa"].qrels) == 490  # one positive a question
    assert tasks["cmedir"].provenance["split"] == "test" and tasks["kuake_qtr"].provenance["split"] == "dev"


def test_shared_selections_follow_hakari(tasks, selections):
    for name, sel in selections.items():
        t, m = tasks[name], sel.metadata
        assert len(sel.queries) == (124 if name == "cmedqa2" else 200), name
        assert list(sel.qrels) == list(sel.queries) and all(sel.qrels[q] for q in sel.queries)
        assert all(d in sel.corpus for ds in sel.qrels.values() for d in ds)
        assert (m["queries"], m["corpus"], m["qrels"]) == (len(sel.queries), len(sel.corpus),
                                                           sum(map(len, sel.qrels.values())))
        # HAKARI's row order: the positives in qrels order, then hard negatives, then fill in source order.
        assert m["qrels_selection"]["removed_queries_after_corpus_filter"] == 0  # sel.queries: all selected
        cs, rows = m["corpus_selection"], list(sel.corpus)
        positives = dict.fromkeys(d for q, d, s in t.qrels if s > 0 and q in sel.queries)
        added = [d for d in positives if d in sel.corpus]
        assert rows[:len(added)] == added and len(added) >= len(sel.queries), name
        hard = rows[len(added):len(added) + cs["kept_hard_negative_docs"]]
        assert set(hard) <= {d for q, d, s in t.qrels if s <= 0 and q in sel.queries}, name
        position = {d: i for i, (d, _) in enumerate(t.corpus)}
        fill = [position[d] for d in rows[len(added) + len(hard):]]
        assert fill == sorted(fill) and len(fill) == cs["fill_docs"], name
        # The first queries in source order with a positive (no duplicate texts in these sets).
        with_positive = {q for q, _, s in t.qrels if s > 0}
        assert list(sel.queries) == [q for q, _ in t.queries if q in with_positive][:200]
    sizes = {n: len(s.corpus) for n, s in selections.items()}
    distinct_answers = len({text for _, text in tasks["cepilepsyqa"].corpus})
    assert sizes == {"kuake_qtr": 10000, "cmedir": 10000, "cepilepsyqa": distinct_answers, "cmedqa2": 5106}
    # cEpilepsyQA's 4,900 answers hold duplicate texts: taken whole, each text once.
    ep = selections["cepilepsyqa"].metadata["corpus_selection"]
    assert ep["corpus_below_doc_limit"] and ep["duplicate_doc_texts_removed"] == 4900 - distinct_answers > 0
    assert len(select(tasks["cepilepsyqa"], dedupe_doc_texts=False).corpus) == 4900


def test_shared_selection_orders_and_random_policy(tasks, selections):
    t = tasks["kuake_qtr"]
    hashed = select(t, corpus_order="hashed")
    plain = selections["kuake_qtr"].corpus
    assert hashed.corpus == plain and list(hashed.corpus) != list(plain)
    positives = {d for ds in hashed.qrels.values() for d in ds}
    assert len(positives & set(list(hashed.corpus)[:300])) < 50  # the 267 positives are no longer on top
    rnd = select(t, query_selection="random", seed=5)
    assert rnd.queries != selections["kuake_qtr"].queries and len(rnd.queries) == 200
    assert all(rnd.qrels[q] for q in rnd.queries) and len(rnd.corpus) == 10000
