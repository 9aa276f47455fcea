"""The training-examples file (docs/design.md, "Files between stages"): one reader and one writer, one set of
rules, so the build, mine and score stages, the FlagEmbedding export and the trainer read the same file the
same way.

One JSON object a line, texts referred to by id (the text store beside it, `read_text_store`):
    query_id            a text id (a JSON string); required
    pos_ids             a non-empty list of text ids; required
    neg_ids             a list of text ids (the mine stage's hard negatives); the build stage's
                        examples.jsonl has none, and a reader that needs them asks (`need`)
    pool, rule          the build rule's pool (negatives are mined within it) and the rule's name: a string
                        or null
    neg_scores          the miner's similarities, one number per neg_ids, in order
    pos_scores          the miner's similarities of the positives, one per pos_ids
    teacher_pos_scores  a teacher's scores (stage score), one per pos_ids / neg_ids; the two come together,
    teacher_neg_scores  and on every line of a file or on none
    fallback            how many trailing neg_ids the mine stage's fallback filled (0..len(neg_ids))
Any other field is kept.  A row is returned as parsed, so a stage that adds fields and writes the row
again (stage score) changes nothing else: every optional field round-trips exactly.

Every refusal is a DataError naming the file, the line and the field.  The writer checks its rows by the
same rules (naming the row's line-to-be), so no stage writes a file the next one refuses.
"""
from __future__ import annotations

import math
from collections.abc import Container, Iterable
from pathlib import Path

from care.data.io import DataError, read_jsonl_numbered, write_jsonl

ID_LISTS = ("pos_ids", "neg_ids")
# score field -> the id list it is aligned with (one number per id, in order)
SCORES = {"pos_scores": "pos_ids", "neg_scores": "neg_ids",
          "teacher_pos_scores": "pos_ids", "teacher_neg_scores": "neg_ids"}
TEACHER = ("teacher_pos_scores", "teacher_neg_scores")
LABELS = ("pool", "rule")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def row_problem(row: dict, texts: Container[str] | None = None, need: Iterable[str] = (),
                store: str | Path | None = None) -> tuple[str | None, str] | None:
    """(field, problem) for a row that breaks the format, else None.  `texts`: the ids of the text store
    (every id must be one; None: not checked); `need`: optional fields this reader cannot do without."""
    if not isinstance(row, dict):
        return None, "expected a JSON object"
    for field in ("query_id", "pos_ids", *need):
        if field not in row:
            return field, "missing"
    if not isinstance(row["query_id"], str):
        return "query_id", f"expected a text id (a string), got {type(row['query_id']).__name__}"
    for field in ID_LISTS:
        ids = row.get(field, [])
        if not isinstance(ids, list):
            return field, f"expected a list of text ids, got {type(ids).__name__}"
        bad = next((i for i in ids if not isinstance(i, str)), None)
        if bad is not None:
            return field, f"expected text ids (strings), got {type(bad).__name__} {bad!r}"
    if not row["pos_ids"]:
        return "pos_ids", "an example with no positive"
    if texts is not None:
        where = f"not in the text store {store}" if store else "not in the text store"
        for field in ("query_id", *ID_LISTS):
            for tid in [row[field]] if field == "query_id" else row.get(field, []):
                if tid not in texts:
                    return field, f"unknown text id {tid!r} ({where})"
    for field in LABELS:
        if row.get(field) is not None and not isinstance(row[field], str):
            return field, f"expected a string or null, got {type(row[field]).__name__}"
    for field, ids in SCORES.items():
        if field not in row:
            continue
        scores, n = row[field], len(row.get(ids, []))
        what = "teacher scores" if field in TEACHER else "scores"
        if not isinstance(scores, list) or len(scores) != n:
            got = len(scores) if isinstance(scores, list) else f"a {type(scores).__name__}, not a list of"
            return field, f"{got} {what} for {n} {ids}: one per id, in order"
        if not all(_number(x) for x in scores):
            return field, f"{what} must be finite numbers"
    present = [f for f in TEACHER if f in row]
    if len(present) == 1:
        missing = next(f for f in TEACHER if f not in row)
        return missing, f"missing: this line has {present[0]}, and the two teacher fields come together"
    fallback = row.get("fallback", 0)
    if not (isinstance(fallback, int) and not isinstance(fallback, bool)
            and 0 <= fallback <= len(row.get("neg_ids", []))):
        return "fallback", f"expected a count of neg_ids (0 to {len(row.get('neg_ids', []))}), got {fallback!r}"
    return None


def _teacher_everywhere(path: Path, line: int, row: dict, first: bool | None) -> bool:
    """The file rule for teacher scores: on every line or on none, as the first line says."""
    has = TEACHER[0] in row
    if first is not None and has != first:
        if first:
            raise DataError(path, line, TEACHER[0], "missing: the first line carries teacher scores "
                            f"({' and '.join(TEACHER)}), so every line must")
        raise DataError(path, line, TEACHER[0], "teacher scores on some lines only: the first line has none "
                        f"({' and '.join(TEACHER)} go on every line or on none)")
    return has


def read_example_rows(path: str | Path, texts: Container[str] | None = None, need: Iterable[str] = (),
                      limit: int | None = None, store: str | Path | None = None) -> list[tuple[int, dict]]:
    """(line number, row) for every example of a training-examples file, each row checked (`row_problem`,
    the teacher fields on every line or none) and returned as parsed.  `limit`: read the first `limit`
    examples only.  No example at all is an error: every reader here needs one."""
    path, need = Path(path), tuple(need)
    rows: list[tuple[int, dict]] = []
    teacher = None
    for line, row in read_jsonl_numbered(path):
        if limit is not None and len(rows) >= limit:
            break
        problem = row_problem(row, texts, need, store)
        if problem:
            raise DataError(path, line, *problem)
        teacher = _teacher_everywhere(path, line, row, teacher)
        rows.append((line, row))
    if not rows:
        raise DataError(path, None, None, "no training examples")
    return rows


def write_examples(path: str | Path, rows: Iterable[dict]) -> int:
    """Write a training-examples file (atomically, care.data.io.write_jsonl), each row checked by the
    reader's rules first: a row the reader would refuse is a DataError naming the line it would have had,
    and nothing is written."""
    path = Path(path)

    def checked():
        teacher = None
        for line, row in enumerate(rows, 1):
            problem = row_problem(row)
            if problem:
                raise DataError(path, line, *problem)
            teacher = _teacher_everywhere(path, line, row, teacher)
            yield row

    return write_jsonl(path, checked())
