"""What every reader shares: the per-source report (rows read, rejected, filtered), the on_error policy,
and row iterators for the three container formats (delimited text, JSON arrays, JSON Lines) that give
every row its 1-based line number, so any bad row raises a DataError naming file, line and field.

Errors come in two kinds.  A bad *row* (truncated, empty text, bad label, unknown id, undecodable bytes)
goes through `Report.row`: under on_error=stop it raises, under on_error=skip it is recorded in full and
the row is left out.  A bad *file* (wrong header, a JSON array that does not parse) always raises: its
remaining rows cannot be trusted or even located.
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from care.data.io import DataError
from care.data.records import Label

ON_ERROR = ("stop", "skip")


@dataclass
class FileCounts:
    rows: int = 0  # data rows seen (header excluded)
    rejected: int = 0  # bad rows skipped under on_error=skip
    filtered: int = 0  # good rows a documented filter left out (known defects, collapsed repeats)

    def as_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.rows - self.rejected - self.filtered,
                "rejected": self.rejected, "filtered": self.filtered}


@dataclass
class Report:
    """Everything one source's reader did, for stats.json: nothing is dropped without being counted."""

    source: str
    root: Path
    on_error: str = "stop"
    files: dict[str, FileCounts] = field(default_factory=dict)
    rejected: list[dict] = field(default_factory=list)  # every skipped row: file, line, field, reason
    filters: dict[str, dict] = field(default_factory=dict)  # name -> {"reason", "rows", ...}
    counts: dict[str, object] = field(default_factory=dict)  # reader-specific facts (e.g. positives per question)
    _by_path: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")

    def file(self, path: Path) -> FileCounts:
        """The counts of `path`, named relative to the source's folder (looked up once per file: this is
        called for every row)."""
        if (counts := self._by_path.get(path)) is None:
            p = Path(path)
            name = str(p.relative_to(self.root)) if p.is_relative_to(self.root) else str(p)
            counts = self._by_path[path] = self.files.setdefault(name, FileCounts())
        return counts

    def row(self, path: Path, line: int) -> Report:
        """`with report.row(path, line):` around one data row: counts it; a DataError inside stops the
        import or, under skip, rejects just this row.  Build every record of the row before yielding any,
        so a rejected row leaves nothing behind.  (A plain class, not contextlib: it runs for every row.)"""
        self.file(path).rows += 1
        return self

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if kind is not None and issubclass(kind, DataError):
            self.reject(err)
            return True  # skip mode: the row is rejected, reading goes on
        return False

    def reject(self, err: DataError) -> None:
        if self.on_error == "stop":
            raise err
        self.file(Path(err.path)).rejected += 1
        self.rejected.append({"file": err.path, "line": err.line, "field": err.field, "reason": err.problem})

    def filter(self, path: Path, name: str, reason: str, rows: int = 1, **extra: int) -> None:
        """Leave out `rows` good rows of `path` under a named, documented filter (counted per filter)."""
        self.file(path).filtered += rows
        entry = self.filters.setdefault(name, {"reason": reason, "rows": 0})
        entry["rows"] += rows
        for key, n in extra.items():
            entry[key] = entry.get(key, 0) + n

    def as_dict(self) -> dict:
        return {"files": {k: v.as_dict() for k, v in self.files.items()}, "rejected": self.rejected,
                "filters": self.filters, "counts": self.counts}


# ---- cell checks --------------------------------------------------------------------------------------

def clean_text(value, path: Path, line: int, field: str) -> str:
    """A non-empty string, outer whitespace stripped (so ' 头痛' and '头痛' get one id)."""
    if not isinstance(value, str):
        raise DataError(path, line, field, f"expected a text, got {type(value).__name__}")
    value = value.strip()
    if not value:
        raise DataError(path, line, field, "empty text")
    return value


def parse_label(value, path: Path, line: int, field: str, allowed: Iterable[int] | None = None) -> Label:
    """A number from '2', 2 or 2.5 (int when integral); `allowed` restricts it to a few integer grades."""
    try:
        number = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number):
        raise DataError(path, line, field, f"bad label {value!r} (expected a number)")
    label = int(number) if number.is_integer() else number
    if allowed is not None and label not in allowed:
        raise DataError(path, line, field, f"bad label {value!r} (expected one of {sorted(allowed)})")
    return label


def field_of(row: dict, name: str, path: Path, line: int, where: str = ""):
    """row[name]; `where` prefixes the field in the error (e.g. 'documents[1].' for a nested object)."""
    if name not in row:
        raise DataError(path, line, where + name, "missing")
    return row[name]


# ---- row iterators ------------------------------------------------------------------------------------

def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 (see decoded_lines)
        return False


def decoded_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, is valid UTF-8) per physical line (a BOM is dropped).  A line that is not UTF-8
    is decoded with surrogateescape, so the caller can still split it and name the field with bad bytes."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield lineno, raw.decode("utf-8"), True
            except UnicodeDecodeError:
                yield lineno, raw.decode("utf-8", "surrogateescape"), False


def delimited_rows(path: Path, report: Report, columns: list[str], delimiter: str = ",",
                   header: bool = True) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) per data row, via the csv module (quoted fields with "" escapes, as the
    ChineseBLUE TSVs and CHIP CSVs use).  With `header`, the first row must equal `columns` exactly.
    A row whose cell count differs from `columns`, or with bytes that are not UTF-8, is a bad row."""
    state = {"line": 0, "undecodable": False}

    def lines():  # feeds csv.reader while remembering the physical line, for error messages
        for lineno, text, valid in decoded_lines(path):
            state["line"] = lineno
            state["undecodable"] |= not valid
            yield text

    reader = csv.reader(lines(), delimiter=delimiter)
    if header:
        first = next(reader, [])
        if first != columns:
            wrong = next((c for i, c in enumerate(columns) if i >= len(first) or first[i] != c), None)
            raise DataError(path, 1, wrong, f"wrong header {first!r}, expected {columns!r}")
    for cells in reader:
        line, undecodable = state["line"], state["undecodable"]
        state["undecodable"] = False
        if not cells:
            continue  # a blank line (e.g. the trailing newline) carries no row
        if len(cells) != len(columns) or undecodable:
            with report.row(path, line):
                if undecodable:
                    bad = next((c for c, cell in zip(columns, cells) if not _encodable(cell)), None)
                    raise DataError(path, line, bad, "undecodable bytes (not UTF-8)")
                missing = columns[len(cells)] if len(cells) < len(columns) else None
                raise DataError(path, line, missing,
                                f"{len(cells)} fields, expected {len(columns)} ({delimiter.join(columns)!r})")
            continue
        yield line, cells


def json_array_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number of the object's first character, object) per element of a JSON array file.
    The json module gives no positions for elements, so the array is walked with raw_decode."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(path, raw.count(b"\n", 0, e.start) + 1, None, "undecodable bytes (not UTF-8)") from None
    seen = [0, 1]  # (position, its line): positions only move forward, so count newlines incrementally

    def line_of(pos: int) -> int:
        seen[1] += text.count("\n", seen[0], pos)
        seen[0] = pos
        return seen[1]

    decoder, pos, n = json.JSONDecoder(), 0, len(text)

    def skip_space(p: int) -> int:
        while p < n and text[p] in " \t\r\n":
            p += 1
        return p

    pos = skip_space(pos)
    if pos >= n or text[pos] != "[":
        raise DataError(path, line_of(pos), None, "expected a JSON array")
    pos = skip_space(pos + 1)
    if pos < n and text[pos] == "]":
        return
    while True:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(path, e.lineno, None, f"not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(path, line_of(pos), None, "expected a JSON object in the array")
        yield line_of(pos), obj
        pos = skip_space(end)
        if pos < n and text[pos] == ",":
            pos = skip_space(pos + 1)
        elif pos < n and text[pos] == "]":
            if skip_space(pos + 1) != n:
                raise DataError(path, line_of(pos + 1), None, "text after the end of the JSON array")
            return
        else:
            raise DataError(path, line_of(pos), None, "truncated JSON array (expected ',' or ']')")


def jsonl_rows(path: Path, report: Report) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line.  Unlike care.data.io.read_jsonl, a bad line goes
    through the report, so on_error=skip can continue past it."""
    for lineno, text, valid in decoded_lines(path):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            problem, field = (None, None) if isinstance(obj, dict) else ("expected a JSON object", None)
        except json.JSONDecodeError as e:
            obj, problem, field = None, f"not valid JSON ({e.msg})", None
        if problem is None and not valid:
            problem = "undecodable bytes (not UTF-8)"
            field = next((k for k, v in obj.items() if not _encodable(json.dumps(v, ensure_ascii=False))), None)
        if problem is None:
            yield lineno, obj
            continue
        with report.row(path, lineno):
            raise DataError(path, lineno, field, problem)


def require_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (check data.root and the source's path/files)")
    return path
