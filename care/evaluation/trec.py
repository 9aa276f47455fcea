"""Score a TREC run file against a qrels file with trec_eval's conventions; print one JSON object.

    python -m care.evaluation.trec RUN QRELS [--metrics ndcg_cut_20,map_min_r_10,...]

RUN lines are `qid Q0 docid rank score tag`, QRELS lines `qid 0 docid rel` (whitespace separated).  As in
trec_eval, the rank column is ignored (documents are ordered by score, ties by docid) and means are taken
over the qrels' queries; a qrels query absent from the run counts 0 (trec_eval -c) unless --skip-missing.
See care/evaluation/metrics.py for every convention.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError, text_lines
from care.errors import app_errors
from care.evaluation.metrics import DEFAULT_METRICS, average, evaluate_per_query, parse_metric


def _rows(path: str | Path, columns: int, layout: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) for each non-blank line, checking the column count."""
    for lineno, line in text_lines(path):
        fields = line.split()
        if len(fields) != columns:
            raise DataError(path, lineno, None, f"expected {columns} whitespace-separated columns "
                                                f"({layout}), got {len(fields)}")
        yield lineno, fields


def _table(path: str | Path, width: int, layout: str, value_field: str, parse, judged: str):
    """`{qid: {docid: parse(value)}}` from whitespace-separated lines; a document twice for one query is an
    error naming both lines."""
    table: dict[str, dict] = {}
    first_seen: dict[tuple[str, str], int] = {}
    for lineno, cells in _rows(path, width, layout):
        qid, docid, value = cells[0], cells[2], parse(cells[4] if width == 6 else cells[3], path, lineno, value_field)
        if (qid, docid) in first_seen:
            raise DataError(path, lineno, "docid", f"document {docid!r} is {judged} twice for query {qid!r} "
                                                   f"(first on line {first_seen[qid, docid]})")
        first_seen[qid, docid] = lineno
        table.setdefault(qid, {})[docid] = value
    return table


def _score(text: str, path, lineno: int, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DataError(path, lineno, field, f"not a number: {text!r}") from None
    if math.isnan(value):
        raise DataError(path, lineno, field, "NaN cannot be ranked")
    return value


def _grade(text: str, path, lineno: int, field: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(path, lineno, field, f"not an integer relevance grade: {text!r}") from None


def read_trec_run(path: str | Path) -> dict[str, dict[str, float]]:
    """`qid Q0 docid rank score tag` lines -> `{qid: {docid: score}}`."""
    return _table(path, 6, "qid Q0 docid rank score tag", "score", _score, "listed")


def read_trec_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """`qid iter docid rel` lines -> `{qid: {docid: rel}}` (integer grades, as trec_eval requires)."""
    return _table(path, 4, "qid iter docid rel", "rel", _grade, "judged")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m care.evaluation.trec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="TREC run file: qid Q0 docid rank score tag")
    parser.add_argument("qrels", help="TREC qrels file: qid iter docid rel")
    parser.add_argument("--metrics", default="",
                        help=f"comma-separated metrics added to the defaults ({','.join(DEFAULT_METRICS)}), "
                             "e.g. ndcg_cut_20,map_cut_100,recall_1000,success_5,mrr_100,map_min_r_10")
    parser.add_argument("--relevance-level", type=int, default=1,
                        help="lowest grade that counts as relevant for MAP/MRR/success/recall (trec -l)")
    parser.add_argument("--skip-missing", action="store_true",
                        help="average only over queries present in both files (plain trec_eval, BEIR, mteb) "
                             "instead of counting qrels queries missing from the run as 0 (trec_eval -c)")
    args = parser.parse_args(argv)
    extra = [name.strip() for name in args.metrics.split(",") if name.strip()]
    metrics = list(dict.fromkeys([*DEFAULT_METRICS, *extra]))
    try:
        for name in metrics:
            parse_metric(name)
    except ValueError as e:
        parser.error(str(e))
    try:
        with app_errors("python -m care.evaluation.trec", resumes=False):
            run, qrels = read_trec_run(args.run), read_trec_qrels(args.qrels)
            per_query = evaluate_per_query(run, qrels, metrics, relevance_level=args.relevance_level,
                                           complete=not args.skip_missing)
    except SystemExit as e:  # the one-line error is said; main returns its status
        return e.code if isinstance(e.code, int) else 1
    print(json.dumps({"num_q": len(per_query), **average(per_query, metrics)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
