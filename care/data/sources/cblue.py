"""CBLUE JSON arrays of pairs: one reader for the three tasks, told by the source config which fields hold
the two texts, their roles and the allowed labels:

    KUAKE-QTR  {id, query, title, label '0'..'3'}
    KUAKE-QQR  {id, query1, query2, label '0'..'2'}
    CHIP-STS   {id, text1, text2, label '0'|'1', category}

Quirks handled here: the leaderboard test splits carry no labels (splits listed under `unlabelled` may lack
them: label null); `drop_ids` names rows to leave out, with the reason (KUAKE-QQR dev s9 has a label
disputed between copies; KUAKE-QTR test s4127 has an empty title); `category_aliases` mends misspelt
categories (one CHIP-STS test row says 'daibetes').
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import Pair, Text
from care.data.sources.common import Report, clean_text, field_of, json_array_rows, parse_label


def read(opts: dict, root: Path, report: Report) -> Iterator[Text | Pair]:
    source, folder = report.source, root / opts["path"]
    (field1, field2), (role1, role2) = opts["fields"], opts["roles"]
    category, unlabelled = opts.get("category"), set(opts.get("unlabelled", []))
    aliases = opts.get("category_aliases") or {}  # misspelt categories -> the right ones
    mended = report.counts.setdefault("categories_mended", {}) if aliases else {}
    for split, name in opts["files"].items():
        path, seen = folder / name, set()
        drop = (opts.get("drop_ids") or {}).get(split, {})
        for line, row in json_array_rows(path):
            with report.row(path, line):
                rid = field_of(row, "id", path, line)
                rid = str(rid).strip() if isinstance(rid, (str, int)) and not isinstance(rid, bool) else ""
                if not rid or rid in seen:
                    raise DataError(path, line, "id", f"{'duplicate' if rid else 'empty or bad'} id {row['id']!r}")
                seen.add(rid)
                if rid in drop:
                    report.filter(path, f"{split}:{rid}", drop[rid])
                    continue
                if "label" in row or split not in unlabelled:
                    label = parse_label(field_of(row, "label", path, line), path, line, "label", opts["labels"])
                else:
                    label = None
                t1 = Text.of(source, role1, clean_text(field_of(row, field1, path, line), path, line, field1))
                t2 = Text.of(source, role2, clean_text(field_of(row, field2, path, line), path, line, field2))
                cat = clean_text(field_of(row, category, path, line), path, line, category) if category else None
                if cat in aliases:
                    mended[cat] = mended.get(cat, 0) + 1
                    cat = aliases[cat]
                yield t1
                yield t2
                yield Pair(f"{source}:{split}:{rid}", source, split, t1.id, t2.id, label, cat)
