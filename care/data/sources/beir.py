"""A BEIR-layout retrieval folder (how C-MTEB / CMedTEB retrieval tasks are shared):

    corpus.jsonl        {"_id", "title"?, "text"}
    queries.jsonl       {"_id", "text"}
    qrels/<split>.tsv   query-id \\t corpus-id \\t score   (with that header; graded scores allowed)

Every qrels file becomes one split of graded candidate lists.  A document's title, when present, is put
before its text with a space (mteb's convention for title + text corpora).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import QueryCandidates, Text
from care.data.sources.common import (
    Report,
    clean_text,
    delimited_rows,
    field_of,
    jsonl_rows,
    parse_label,
    require_file,
)

QRELS = ["query-id", "corpus-id", "score"]


def _texts(path: Path, report: Report, source: str, role: str) -> Iterator[tuple[str, Text]]:
    seen: set[str] = set()
    for line, row in jsonl_rows(require_file(path), report):
        with report.row(path, line):
            native = str(field_of(row, "_id", path, line)).strip()
            if not native or native in seen:
                raise DataError(path, line, "_id", f"{'duplicate' if native in seen else 'empty'} id {native!r}")
            title = row.get("title") or ""
            if not isinstance(title, str):
                raise DataError(path, line, "title", f"expected a text, got {type(title).__name__}")
            text = clean_text(field_of(row, "text", path, line), path, line, "text")
            seen.add(native)
            yield native, Text.of(source, role, f"{title.strip()} {text}".strip(), native)


def read(opts: dict, root: Path, report: Report) -> Iterator[Text | QueryCandidates]:
    source, folder = report.source, root / opts["path"]
    docs, queries = {}, {}
    for native, text in _texts(folder / "corpus.jsonl", report, source, "document"):
        docs[native] = text.id
        yield text
    for native, text in _texts(folder / "queries.jsonl", report, source, "query"):
        queries[native] = text.id
        yield text

    splits = opts.get("splits") or sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
    if not splits:
        raise FileNotFoundError(f"no qrels/<split>.tsv in {folder}")
    for split in splits:
        path = require_file(folder / "qrels" / f"{split}.tsv")
        lists: dict[str, dict[str, int | float]] = {}  # query id -> {doc id: score}, in file order
        for line, (qid, did, score) in delimited_rows(path, report, QRELS, delimiter="\t"):
            with report.row(path, line):
                if qid not in queries:
                    raise DataError(path, line, "query-id", f"unknown id {qid!r} (not in queries.jsonl)")
                if did not in docs:
                    raise DataError(path, line, "corpus-id", f"unknown id {did!r} (not in corpus.jsonl)")
                score = parse_label(score, path, line, "score")
                judged = lists.get(qid, {})
                if judged.get(did, score) != score:
                    raise DataError(path, line, "score", f"({qid}, {did}) judged {judged[did]} and {score}")
                if did in judged:
                    report.filter(path, "repeated_qrel", "a (query, document) row repeated: collapsed")
                lists.setdefault(qid, judged)[did] = score
        for qid, judged in lists.items():
            yield QueryCandidates(f"{source}:{split}:{qid}", source, split, queries[qid],
                                  [(docs[did], score) for did, score in judged.items()])
