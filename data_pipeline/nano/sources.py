"""A retrieval task as the Nano builder reads it: queries, corpus and qrels in source order, normalised the
way HAKARI's Stage A normalises them (docs/nano.md s.2), so selection (select.py) sees what HAKARI sees.

    read_task(path, split, name)  a task folder in one of the layouts users have:
        BEIR      corpus.jsonl, queries.jsonl, qrels/<split>.tsv (header `query-id corpus-id score`)
        parquet   configs `corpus`, `queries` and the qrels in `qrels` (HAKARI / NanoBEIR: no score column,
                  `corpus-id` possibly a list) or `default` (mteb: with `score`); files found as
                  care/data/nano.py finds them (a README's `configs:`, else `<config>/<split>*.parquet`)

The other way in, the four retrieval-shaped evaluation splits of the shared data (the stage's default), is
shared_data.py's shared_tasks; both give a SourceTask through checked_task.

Texts are normalised here, not with the project's BEIR reader (care/data/sources/beir.py): that one joins a
title and its text with a space, HAKARI with a blank line.
"""
from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from care.data.io import DataError, read_jsonl_numbered, text_lines
from care.data.nano import config_files, read_rows

# docs/nano.md s.2: the columns HAKARI looks at, in its order of preference.
CORPUS_ID = ("_id", "id", "docid", "doc_id", "corpus-id", "corpus_id", "document_id")
BODY = ("text", "document", "contents", "content", "body", "passage")
QUERY_TEXT = ("text", "query", "question")
SCORE = ("score", "relevance", "label")
# Not pinned by HAKARI's recipe: the usual names of a query's id and of the two qrels id columns.
QUERY_ID = ("_id", "id", "query-id", "query_id", "qid")
QRELS_QUERY = ("query-id", "query_id", "qid")
QRELS_DOC = ("corpus-id", "corpus_id", "doc_id", "docid", "document_id", "pid")

ACCEPTED = ("accepted layouts: a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv); a parquet "
            "dataset folder with configs corpus, queries and qrels (HAKARI) or default (mteb), listed in "
            "README.md `configs:` or as files <config>/<split>.parquet or <config>/<split>-*.parquet")


@dataclass
class SourceTask:
    name: str  # the split name it will become
    queries: list[tuple[str, str]]  # (id, text) in source order
    corpus: list[tuple[str, str]]  # (id, text) in source order
    qrels: list[tuple[str, str, float]]  # (query id, doc id, score) in qrels order
    provenance: dict = field(default_factory=dict)  # layout, path, split, and what else identifies the source


# ---- normalisation (docs/nano.md s.2) ------------------------------------------------------------------

def _first_present(row: Container[str], names: Iterable[str]) -> str | None:
    """The first of `names` that is a key of `row` (present, whatever its value)."""
    return next((n for n in names if n in row), None)


def _id(value) -> str:
    return "" if value is None else str(value)


def _part(value) -> str:
    return str(value or "").strip()


def document_text(row: dict) -> str:
    """`title` and the first present body column, each stripped: `title\\n\\nbody` when both are non-empty
    and differ, else `body or title` (HAKARI's rule, docs/nano.md s.2)."""
    title = _part(row.get("title"))
    key = _first_present(row, BODY)
    body = _part(row[key]) if key else ""
    return f"{title}\n\n{body}" if title and body and title != body else body or title


def query_text(row: dict) -> str:
    """The first non-empty of `text`, `query`, `question` (stripped)."""
    return next((t for k in QUERY_TEXT if (t := _part(row.get(k)))), "")


def _score(row: dict, path: Path, line: int) -> float:
    """The first present (non-null) of score / relevance / label; 1.0 when none is (HAKARI's default)."""
    for key in SCORE:
        if row.get(key) is not None:
            try:
                return float(row[key])
            except (TypeError, ValueError):
                raise DataError(path, line, key, f"bad score {row[key]!r} (expected a number)") from None
    return 1.0


class _Normaliser:
    """Turns rows into the three lists and counts what it drops (empty ids or texts), for provenance.
    A repeated id or (query, doc) pair is kept: the selection skips and counts those (select.py)."""

    def __init__(self):
        self.dropped = {"corpus_rows": 0, "queries": 0, "qrels": 0}

    def corpus(self, rows: Iterable[dict], out: list) -> None:
        for row in rows:
            key = _first_present(row, CORPUS_ID)
            did, text = _id(row[key]) if key else "", document_text(row)
            if did.strip() and text:
                out.append((did, text))
            else:
                self.dropped["corpus_rows"] += 1

    def queries(self, rows: Iterable[dict], out: list) -> None:
        for row in rows:
            key = _first_present(row, QUERY_ID)
            qid, text = _id(row[key]) if key else "", query_text(row)
            if qid.strip() and text:
                out.append((qid, text))
            else:
                self.dropped["queries"] += 1

    def qrel(self, qid, docs, score: float, out: list) -> None:
        """One qrels row; `docs` may be a list of ids (HAKARI and NanoBEIR allow a list-valued corpus-id)."""
        qid = _id(qid)
        for did in docs if isinstance(docs, (list, tuple)) else [docs]:
            did = _id(did)
            if qid.strip() and did.strip():
                out.append((qid, did, score))
            else:
                self.dropped["qrels"] += 1


def checked_task(name: str, queries: list, corpus: list, qrels: list, provenance: dict) -> SourceTask:
    """The SourceTask, refused when no qrel is positive (selection picks queries by their positives)."""
    if not any(score > 0 for _, _, score in qrels):
        raise ValueError(f"task {name!r}: no qrel with score > 0 among {len(qrels)} qrels "
                         f"({provenance.get('path')}): a Nano split needs positives to select queries by")
    return SourceTask(name, queries, corpus, qrels, provenance)


def _only_split(splits: list[str], split: str | None, where: str) -> str:
    if split is not None:
        if split not in splits:
            raise ValueError(f"{where}: no split {split!r} (splits present: {', '.join(splits) or 'none'})")
        return split
    if len(splits) != 1:
        raise ValueError(f"{where}: several splits ({', '.join(splits)}); pass split=")
    return splits[0]


# ---- BEIR folder ---------------------------------------------------------------------------------------

def _jsonl(path: Path) -> Iterator[dict]:
    """Rows of a JSON Lines file; a bad line raises DataError naming file and line (care/data/io.py)."""
    for _, row in read_jsonl_numbered(path):
        yield row


def _tsv_qrels(path: Path, norm: _Normaliser, out: list) -> None:
    """qrels/<split>.tsv: a header naming the query-id and corpus-id columns (score optional)."""
    lines = text_lines(path)
    first = next(lines, None)
    header = first[1].rstrip("\r\n").split("\t") if first else []
    qcol, dcol = _first_present(set(header), QRELS_QUERY), _first_present(set(header), QRELS_DOC)
    if qcol is None or dcol is None:
        raise DataError(path, 1, "query-id" if qcol is None else "corpus-id",
                        f"wrong header {header!r}, expected query-id, corpus-id and score (tab separated)")
    for lineno, line in lines:
        cells = line.rstrip("\r\n").split("\t")
        if len(cells) != len(header):
            raise DataError(path, lineno, header[min(len(cells), len(header) - 1)],
                            f"{len(cells)} fields, expected {len(header)} ({' '.join(header)})")
        row = dict(zip(header, cells))
        norm.qrel(row[qcol], row[dcol], _score(row, path, lineno), out)


def _read_beir(folder: Path, split: str | None, name: str) -> SourceTask:
    splits = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
    if not (folder / "queries.jsonl").is_file() or not splits:
        missing = "queries.jsonl" if not (folder / "queries.jsonl").is_file() else "qrels/<split>.tsv"
        raise FileNotFoundError(f"{folder}: BEIR folder without {missing}; {ACCEPTED}")
    split = _only_split(splits, split, str(folder))
    norm, queries, corpus, qrels = _Normaliser(), [], [], []
    norm.corpus(_jsonl(folder / "corpus.jsonl"), corpus)
    norm.queries(_jsonl(folder / "queries.jsonl"), queries)
    _tsv_qrels(folder / "qrels" / f"{split}.tsv", norm, qrels)
    return checked_task(
        name, queries, corpus, qrels,
        {"description": f"BEIR folder {folder}, split {split}", "layout": "beir",
         "path": str(folder), "split": split, "qrels_file": f"qrels/{split}.tsv",
         "dropped_empty": norm.dropped})


# ---- parquet dataset folder ----------------------------------------------------------------------------

class _Parquet:
    """One parquet dataset folder, its files found as care/data/nano.py finds a Nano dataset's (the README's
    `configs:`, else `<config>/<split>*.parquet`) and read with pyarrow in stored order."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = config_files(folder)
        self.splits = {c: list(s) for c, s in self.files.items()}
        self.readme = (folder / "README.md").is_file()

    def has(self, config: str) -> bool:
        return config in self.splits

    def split_for(self, config: str, split: str) -> str:
        """`split` if the config has it, else its only split (mteb's corpus and queries often carry one)."""
        splits = self.splits[config]
        if split in splits:
            return split
        if len(splits) == 1:
            return splits[0]
        raise ValueError(f"{self.folder}: config {config!r} has no split {split!r} "
                         f"(splits: {', '.join(splits)})")

    def rows(self, config: str, split: str) -> Iterator[dict]:
        yield from read_rows(self.folder, config, split, files=self.files)


def _read_parquet(folder: Path, split: str | None, name: str) -> SourceTask:
    data = _Parquet(folder)
    qrels_config = "qrels" if data.has("qrels") else "default" if data.has("default") else None
    missing = [c for c in ("corpus", "queries") if not data.has(c)]
    missing += [] if qrels_config else ["qrels or default"]
    if missing:
        raise FileNotFoundError(f"{folder}: no config {', '.join(missing)} (configs found: "
                                f"{', '.join(data.splits) or 'none'}); {ACCEPTED}")
    split = _only_split(data.splits[qrels_config], split, f"{folder} config {qrels_config!r}")
    norm, queries, corpus, qrels = _Normaliser(), [], [], []
    norm.corpus(data.rows("corpus", data.split_for("corpus", split)), corpus)
    norm.queries(data.rows("queries", data.split_for("queries", split)), queries)
    has_score = False
    for i, row in enumerate(data.rows(qrels_config, split)):
        qcol, dcol = _first_present(row, QRELS_QUERY), _first_present(row, QRELS_DOC)
        if qcol is None or dcol is None:
            raise DataError(folder / qrels_config, i + 1, "query-id" if qcol is None else "corpus-id",
                            f"missing (columns: {', '.join(row)})")
        has_score |= any(k in row for k in SCORE)
        norm.qrel(row[qcol], row[dcol], _score(row, folder / qrels_config, i + 1), qrels)
    return checked_task(
        name, queries, corpus, qrels,
        {"description": f"parquet dataset folder {folder}, split {split}", "layout": "parquet",
         "files_from": "README configs" if data.readme else "<config>/<split>*.parquet",
         "path": str(folder), "split": split, "qrels_config": qrels_config,
         "qrels_layout": "mteb (with score)" if has_score else "hakari (no score: every qrel 1.0)",
         "dropped_empty": norm.dropped})


def read_task(path, split: str | None = None, name: str | None = None) -> SourceTask:
    """The retrieval task in folder `path` (a BEIR or parquet layout, see the module docstring).
    `split=None` takes the only split present; `name` (the Nano split name) defaults to the folder name."""
    folder = Path(path)
    name = name or folder.resolve().name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist or is not a folder; {ACCEPTED}")
    if (folder / "corpus.jsonl").is_file():
        return _read_beir(folder, split, name)
    if config_files(folder):
        return _read_parquet(folder, split, name)
    raise FileNotFoundError(f"{folder}: neither corpus.jsonl nor parquet configs found; {ACCEPTED}")
