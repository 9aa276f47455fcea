"""The nCoV-2019 similar-question pairs: TAB-separated despite the .csv name, no header,

    category:question1 \t category:question2 \t label

Quirk handled here: each question carries its disease category as a 'category:' prefix; it is cut off
the text and kept as the pair's category (joined with '|' should the two sides ever differ).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import Pair, Text
from care.data.sources.common import Report, clean_text, delimited_rows, parse_label


def _split_prefix(cell: str, path: Path, line: int, field: str) -> tuple[str, str]:
    category, sep, text = cell.partition(":")
    if not sep or not category.strip():
        raise DataError(path, line, field, "missing the 'category:' prefix")
    return category.strip(), clean_text(text, path, line, field)


def read(opts: dict, root: Path, report: Report) -> Iterator[Text | Pair]:
    source, folder = report.source, root / opts["path"]
    for split, name in opts["files"].items():
        path = folder / name
        for line, (cell1, cell2, label) in delimited_rows(path, report, ["question1", "question2", "label"],
                                                          delimiter="\t", header=False):
            with report.row(path, line):
                cat1, text1 = _split_prefix(cell1, path, line, "question1")
                cat2, text2 = _split_prefix(cell2, path, line, "question2")
                label = parse_label(label, path, line, "label", allowed=(0, 1))
                t1, t2 = Text.of(source, "question", text1), Text.of(source, "question", text2)
                yield t1
                yield t2
                yield Pair(f"{source}:{split}:{line}", source, split, t1.id, t2.id, label,
                           cat1 if cat1 == cat2 else f"{cat1}|{cat2}")
