"""The C-MTEB evaluation layouts a user may bring, one JSON Lines file per split:

    reranking  {"query": str, "positive": [str, ...], "negative": [str, ...]}  -> `read_reranking`
               graded sets add "positive_grades": [int >= 1, ...], one per positive: a positive's label
               is its grade (the nDCG gain; relevance stays binary, grade >= 1), else 1; a negative's is 0
    STS        {"sentence1": str, "sentence2": str, "score": number}          -> `read_sts`

Texts carry no ids: they get md5 ids.  A query on several lines is merged into one candidate list;
a text repeated in one list is collapsed (a positive keeps its highest grade) and counted, one listed both
positive and negative is a bad row.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import Pair, QueryCandidates, Text, md5_key
from care.data.sources.common import Report, clean_text, field_of, jsonl_rows, parse_label, require_file


def read_reranking(opts: dict, root: Path, report: Report) -> Iterator[Text | QueryCandidates]:
    source, folder, role = report.source, root / opts["path"], opts.get("doc_role", "document")
    for split, name in opts["files"].items():
        path = require_file(folder / name)
        lists: dict[str, dict[str, int]] = {}  # query -> {candidate: label}, in file order
        repeats = report.counts.setdefault("repeated_candidates", {})
        for line, row in jsonl_rows(path, report):
            with report.row(path, line):
                query = clean_text(field_of(row, "query", path, line), path, line, "query")
                judged, n_repeats = dict(lists.get(query, {})), 0
                columns = {column: field_of(row, column, path, line) for column in ("positive", "negative")}
                for column, texts in columns.items():
                    if not isinstance(texts, list):
                        raise DataError(path, line, column, "expected a list of texts")
                grades = _positive_grades(row, len(columns["positive"]), path, line)
                for column, labels in (("positive", grades), ("negative", [0] * len(columns["negative"]))):
                    for i, (text, label) in enumerate(zip(columns[column], labels)):
                        text = clean_text(text, path, line, f"{column}[{i}]")
                        if text in judged and (judged[text] > 0) != (label > 0):
                            raise DataError(path, line, f"{column}[{i}]", "listed both as positive and as negative")
                        n_repeats += text in judged
                        judged[text] = max(judged.get(text, label), label)
                if not judged:
                    raise DataError(path, line, "positive", "no candidates (positive and negative both empty)")
                lists[query] = judged
                repeats[split] = repeats.get(split, 0) + n_repeats
        for query, judged in lists.items():
            q = Text.of(source, "query", query)
            docs = [Text.of(source, role, text) for text in judged]
            yield q
            yield from docs
            yield QueryCandidates(f"{source}:{split}:{md5_key(query)}", source, split, q.id,
                                  [(d.id, label) for d, label in zip(docs, judged.values())])


def _positive_grades(row: dict, n_positive: int, path: Path, line: int) -> list[int]:
    """Each positive's grade: row["positive_grades"] (integers >= 1, one per positive), else (absent or
    null) 1 for every positive."""
    grades = row.get("positive_grades")
    if grades is None:
        return [1] * n_positive
    if not isinstance(grades, list) or len(grades) != n_positive:
        got = f"{len(grades)} grades" if isinstance(grades, list) else type(grades).__name__
        raise DataError(path, line, "positive_grades",
                        f"expected a list of {n_positive} grades (one per positive), got {got}")
    for i, grade in enumerate(grades):
        if isinstance(grade, bool) or not isinstance(grade, int) or grade < 1:
            raise DataError(path, line, f"positive_grades[{i}]",
                            f"bad grade {grade!r} (expected an integer >= 1)")
    return grades


def read_sts(opts: dict, root: Path, report: Report) -> Iterator[Text | Pair]:
    source, folder = report.source, root / opts["path"]
    for split, name in opts["files"].items():
        path = require_file(folder / name)
        for line, row in jsonl_rows(path, report):
            with report.row(path, line):
                t1 = Text.of(source, "sentence", clean_text(field_of(row, "sentence1", path, line), path, line, "sentence1"))
                t2 = Text.of(source, "sentence", clean_text(field_of(row, "sentence2", path, line), path, line, "sentence2"))
                score = parse_label(field_of(row, "score", path, line), path, line, "score")
                yield t1
                yield t2
                yield Pair(f"{source}:{split}:{line}", source, split, t1.id, t2.id, score)
