"""Evaluation tasks as data: retrieval, reranking and STS, in the layouts C-MTEB and CMedTEB share.

    retrieval  a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv; graded qrels allowed), or
               any folder a source reader reads into query -> judged-candidate lists (e.g. a cMedQA2
               release folder with `reader: cmedqa_release`)
    reranking  JSON Lines {"query", "positive": [...], "negative": [...]}  (C-MTEB's columns).  Graded
               sets may add "positive_grades": [int >= 1, ...] beside "positive" (the gain nDCG gives each
               positive; negatives have gain 0); MAP, MRR and Hit stay binary (positive vs negative).
    sts        JSON Lines {"sentence1", "sentence2", "score"}
    candidates a Nano split (care/data/nano.py, reader `nano`): each query's stored candidate list (e.g.
               `reranking_hybrid`) is reranked; metrics count every positive, listed or not

Files are read by the source readers (care.data.sources: one reader per format, errors name file, line
and field).  The task runners (care.evaluation.tasks) score what `load_task` returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from care.data.io import DataError
from care.data.records import Pair, QueryCandidates, Text
from care.data.sources import read_source

TYPES = ("retrieval", "reranking", "sts", "candidates")
DEFAULT_READER = {"retrieval": "beir", "reranking": "cmteb_reranking", "sts": "sts_jsonl"}


@dataclass
class TaskData:
    """A loaded task.  Retrieval and reranking: queries {id: text}, docs {id: text}, qrels
    {query id: {doc id: grade}} (for reranking the qrels keys are exactly each query's candidates).
    STS: pairs [(text1, text2)] and gold scores.  Candidates: also `candidates` {query id: [doc ids]} and
    `safeguards` {query id: the doc a Nano builder appended at rank 101 (docs/nano.md s.8)}."""

    type: str
    path: str
    queries: dict[str, str] = field(default_factory=dict)
    docs: dict[str, str] = field(default_factory=dict)
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    gold: list[float] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    candidates: dict[str, list[str]] = field(default_factory=dict)
    safeguards: dict[str, str] = field(default_factory=dict)


def _grade(label, path: str, qid: str) -> int:
    if label is None or float(label) != int(label):
        raise DataError(path, None, "score", f"query {qid}: relevance {label!r} is not an integer grade")
    return int(label)


def load_task(kind: str, path: str | Path, split: str = "test", reader: str | None = None,
              reader_options: dict | None = None) -> TaskData:
    """Read a task file or folder with the source reader for its layout."""
    if kind not in TYPES:
        raise ValueError(f"unknown task type {kind!r} (choose one of {', '.join(TYPES)})")
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"task {kind} file {path} does not exist")
    if reader == "nano" or kind == "candidates":
        return _load_nano(kind, path, split, reader_options or {})
    reader = reader or DEFAULT_READER[kind]
    folder = path.parent if path.is_file() else path
    opts = {"reader": reader, "path": folder.name, **(reader_options or {})}
    if reader in ("cmteb_reranking", "sts_jsonl"):  # a JSON Lines file, or a folder of <split>.jsonl
        opts["files"] = {split: path.name if path.is_file() else f"{split}.jsonl"}
    elif reader in ("beir", "cmedqa_release"):
        opts.setdefault("splits", [split])
    records, report = read_source(folder.name, opts, folder.parent)
    texts = {r.id: r for r in records if isinstance(r, Text)}
    data = TaskData(kind, str(path), counts={"reader": reader, "read": report.as_dict()})

    if kind == "sts":
        for p in records:
            if isinstance(p, Pair) and p.split == split:
                data.pairs.append((texts[p.text1_id].text, texts[p.text2_id].text))
                data.gold.append(float(p.label))
        if len(data.pairs) < 2:
            raise DataError(path, None, "sentence1", f"split {split!r} has {len(data.pairs)} pairs; STS needs >= 2")
        data.counts["pairs"] = len(data.pairs)
        return data

    for qc in records:
        if isinstance(qc, QueryCandidates) and qc.split == split:
            judged = data.qrels.setdefault(qc.query_id, {})
            for doc, label in qc.candidates:
                judged[doc] = _grade(label, str(path), qc.query_id)
            data.queries[qc.query_id] = texts[qc.query_id].text
    if not data.queries:
        raise DataError(path, None, None, f"no judged query in split {split!r}")
    if kind == "retrieval":  # the corpus: every text that is not a query (BEIR documents, cMedQA answers)
        query_roles = {texts[q].role for q in data.queries}
        data.docs = {t.id: t.text for t in texts.values() if t.role not in query_roles}
    else:
        # A list with no positive or no negative cannot tell models apart (mteb skips them as well).
        one_sided = [q for q, judged in data.qrels.items() if len({g > 0 for g in judged.values()}) < 2]
        for q in one_sided:
            del data.qrels[q], data.queries[q]
        data.counts["skipped_one_sided_lists"] = len(one_sided)
        data.docs = {d: texts[d].text for judged in data.qrels.values() for d in judged}
        if not data.qrels:
            raise DataError(path, None, "positive", "no query has both a positive and a negative candidate")
    data.counts.update(queries=len(data.queries), docs=len(data.docs),
                       judgements=sum(len(j) for j in data.qrels.values()))
    return data


def _load_nano(kind: str, path: Path, split: str, options: dict) -> TaskData:
    """A Nano split as a retrieval task (its whole corpus) or a candidates task (one stored list per query).
    Queries with no positive are dropped and counted, as mteb and HAKARI skip them."""
    from care.data.nano import HYBRID, load_split

    if kind not in ("retrieval", "candidates"):
        raise ValueError(f"a Nano split is a retrieval or candidates task, not {kind!r}")
    s = load_split(path, split)
    queries = {q: t for q, t in s.queries.items() if s.qrels.get(q)}
    data = TaskData(kind, str(path), queries=queries, docs=s.corpus, qrels={q: s.qrels[q] for q in queries},
                    counts={"reader": "nano", "split": split, "skipped_no_positive": len(s.queries) - len(queries)})
    if kind == "candidates":
        config = options.get("candidates", HYBRID)
        if config not in s.candidates:
            raise FileNotFoundError(f"{path}: split {split} has no candidate config {config!r} "
                                    f"(it has {', '.join(s.candidates) or 'none'})")
        lists = s.candidates[config]
        missing = [q for q in queries if q not in lists]
        if missing:
            raise DataError(path / config, None, "query-id", f"split {split}: {len(missing)} queries have no "
                            f"candidate row, e.g. {missing[0]}")
        data.candidates = {q: lists[q] for q in queries}
        data.safeguards = {q: d for q, d in s.safeguards.items() if q in queries}
        data.counts["candidates"] = config
    data.counts.update(queries=len(data.queries), docs=len(data.docs),
                       judgements=sum(len(j) for j in data.qrels.values()))
    return data
