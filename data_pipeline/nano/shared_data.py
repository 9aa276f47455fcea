"""The Nano stage's default splits: the four retrieval-shaped evaluation splits of the shared data
(KUAKE-QTR, cMedIR, cEpilepsyQA, cMedQA2) as SourceTasks (sources.py), read as data_pipeline/benchmarks.py
reads them for the open CMedTEB stand-in, which already holds them out of training.  Ids are the sources'
native ids (no `source:role:` prefix).
"""
from __future__ import annotations

from care.data.records import Pair, QueryCandidates, Text, native_id
from data_pipeline.benchmarks import read_shared_source
from data_pipeline.nano.sources import SourceTask, checked_task


def _read_with_provenance(data: dict, name: str, **overrides) -> tuple[list, dict[str, Text], dict]:
    """read_shared_source's records and texts, and where they came from (a split's `source` metadata)."""
    opts = {**data["sources"][name], **overrides}
    records, texts, report = read_shared_source(data, name, **overrides)
    return records, texts, {"source": name, "reader": opts["reader"], "data_root": str(data["root"]),
                            "path": opts["path"], "reader_filters": report["filters"]}


def _role(texts: dict[str, Text], role: str) -> list[tuple[str, str]]:
    return [(native_id(t.id), t.text) for t in texts.values() if t.role == role]


def _candidate_task(name: str, records, texts: dict[str, Text], split: str, corpus: list, score,
                    provenance: dict) -> SourceTask:
    """QueryCandidates of one split -> queries in reader order and one qrel per judged candidate."""
    queries, qrels = [], []
    for qc in records:
        if isinstance(qc, QueryCandidates) and qc.split == split:
            qid = native_id(qc.query_id)
            queries.append((qid, texts[qc.query_id].text))
            qrels.extend((qid, native_id(d), float(score(label))) for d, label in qc.candidates)
    return checked_task(name, queries, corpus, qrels, {**provenance, "split": split, "layout": "shared data"})


def _kuake_qtr(data: dict) -> SourceTask:
    records, texts, prov = _read_with_provenance(data, "kuake_qtr")
    queries, qrels = {}, []
    for p in records:
        if isinstance(p, Pair) and p.split == "dev":
            qid = native_id(p.text1_id)
            queries.setdefault(qid, texts[p.text1_id].text)
            qrels.append((qid, native_id(p.text2_id), float(p.label)))
    return checked_task(
        "kuake_qtr", list(queries.items()), _role(texts, "title"), qrels,
        {**prov, "split": "dev", "layout": "shared data",
         "description": "KUAKE-QTR dev queries against every KUAKE-QTR title, graded qrels 0-3",
         "queries": "dev queries in order of first appearance in the dev pairs",
         "corpus": "every KUAKE-QTR title (train + dev + test), reader order, each text once",
         "positive_rule": "score = label 0-3; label >= 1 is positive (score > 0)"})


def _cmedir(data: dict) -> SourceTask:
    records, texts, prov = _read_with_provenance(data, "cmedir")
    return _candidate_task(
        "cmedir", records, texts, "test", _role(texts, "title"), lambda label: label if label >= 2 else 0,
        {**prov, "description": "cMedIR test queries against every cMedIR title, positive = label >= 2",
         "corpus": "every cMedIR title (dev + test), reader order, one row per id (url)",
         "positive_rule": "label >= 2 is positive with score = label; label 0-1 gets score 0 (non-positive), "
                          "the project's cMedIR criterion (data_pipeline/benchmarks.py)"})


def _cepilepsyqa(data: dict) -> SourceTask:
    records, texts, prov = _read_with_provenance(data, "cepilepsyqa")
    return _candidate_task(
        "cepilepsyqa", records, texts, "test", _role(texts, "answer"), lambda label: label,
        {**prov, "description": "cEpilepsyQA test questions against all its answers",
         "corpus": "every cEpilepsyQA answer (answer.csv order)",
         "positive_rule": "candidate label 1 is positive, 0 non-positive; repeated candidate rows collapsed "
                          "by the reader (reader_filters.repeated_candidate)"})


def _cmedqa2(data: dict) -> SourceTask:
    test = {"test": data["sources"]["cmedqa2_pairs"]["files"]["test"]}
    # As data_pipeline/benchmarks.py build_cmedqa2_retrieval: every answer of the test file is the corpus,
    # the untrusted questions' answers included; the queries are the trusted questions only.
    _, every, _ = read_shared_source(data, "cmedqa2_pairs", files=test, min_positives=0, max_positives=None)
    records, texts, prov = _read_with_provenance(data, "cmedqa2_pairs", files=test)
    return _candidate_task(
        "cmedqa2", records, texts, "test", _role(every, "answer"), lambda label: label,
        {**prov, "description": "ChineseBLUE cMedQA2 test, trusted questions, against every test answer",
         "corpus": "every answer of the ChineseBLUE cMedQA2 test file (untrusted questions' answers "
                           "included), one row per distinct answer text",
         "queries": "the trusted test questions (min_positives..max_positives of the data config)",
         "positive_rule": "candidate label 1 is positive, 0 non-positive"})


def shared_tasks(data: dict) -> dict[str, SourceTask]:
    """kuake_qtr, cmedir, cepilepsyqa, cmedqa2 from the resolved data config (conf/data/shared.yaml): the
    evaluation splits the open CMedTEB stand-in uses (data_pipeline/benchmarks.py), so none of them is
    trained on.  Ids are the sources' native ids (no `source:role:` prefix)."""
    return {"kuake_qtr": _kuake_qtr(data), "cmedir": _cmedir(data), "cepilepsyqa": _cepilepsyqa(data),
            "cmedqa2": _cmedqa2(data)}
