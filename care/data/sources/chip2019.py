"""CHIP 2019 task 2 (the source of CHIP-STS), CSV with a header:

    train.csv   question1,question2,label,category   (CRLF line ends, no final newline)
    dev_id.csv  id,question1,question2,category      (no labels: label null)

The header tells which of the two a file is; pairs without an id column are numbered by line.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import Pair, Text
from care.data.sources.common import Report, clean_text, delimited_rows, parse_label

LABELLED = ["question1", "question2", "label", "category"]
UNLABELLED = ["id", "question1", "question2", "category"]


def read(opts: dict, root: Path, report: Report) -> Iterator[Text | Pair]:
    source, folder = report.source, root / opts["path"]
    for split, name in opts["files"].items():
        path = folder / name
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            columns = UNLABELLED if fh.readline().strip() == ",".join(UNLABELLED) else LABELLED
        seen: set[str] = set()
        for line, cells in delimited_rows(path, report, columns):
            with report.row(path, line):
                row = dict(zip(columns, cells))
                rid = row.get("id", str(line))
                if not rid.strip() or rid in seen:
                    raise DataError(path, line, "id", f"{'duplicate' if rid in seen else 'empty'} id {rid!r}")
                seen.add(rid)
                label = parse_label(row["label"], path, line, "label", allowed=(0, 1)) if "label" in row else None
                t1 = Text.of(source, "question", clean_text(row["question1"], path, line, "question1"))
                t2 = Text.of(source, "question", clean_text(row["question2"], path, line, "question2"))
                category = clean_text(row["category"], path, line, "category")
                yield t1
                yield t2
                yield Pair(f"{source}:{split}:{rid}", source, split, t1.id, t2.id, label, category)
