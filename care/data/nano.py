"""Read a Nano dataset folder (docs/nano.md s.10): HAKARI-bench's layout, which NanoCMTEB and this project's
own Nano builder (data_pipeline/nano) share.

    <folder>/README.md                    YAML `configs:` naming each config's file per split (optional)
    <folder>/corpus/<split>.parquet       _id, text
    <folder>/queries/<split>.parquet      _id, text
    <folder>/qrels/<split>.parquet        query-id, corpus-id (positives; a list-valued corpus-id allowed)
    <folder>/<candidates>/<split>.parquet query-id, corpus-ids   (bm25, the dense list, reranking_hybrid)
    <folder>/reranking_hybrid_metadata.json   per split: the safeguard additions, among others

A hub download keeps the hub's file names (`<config>/<split>-00000-of-00001.parquet`); both are found.
Files are read with pyarrow, following the README's `data_files` when it has them (what
`datasets.load_dataset(folder, config, split=...)` follows too), so evaluation writes no datasets cache.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from care.data.io import DataError

CORE = ("corpus", "queries", "qrels")
HYBRID = "reranking_hybrid"
METADATA = "reranking_hybrid_metadata.json"
HYBRID_TOP_K = 100  # docs/nano.md s.8: a 101st candidate is the safeguard positive
MTEB_SUBSET = "mteb-"  # configs that re-present the others for mteb's loader


class NanoDataWarning(UserWarning):
    """Rows of a Nano split that the reader left out (the message names the file and the count)."""


@dataclass
class NanoSplit:
    """One split of a Nano dataset.  qrels: {query id: {positive doc id: 1}} (binary, as HAKARI scores);
    candidates: {config: {query id: [doc ids, best first]}}; safeguards: {query id: doc id at rank 101};
    counts: what was read and what was left out (load_split)."""

    name: str
    queries: dict[str, str]
    corpus: dict[str, str]
    qrels: dict[str, dict[str, int]]
    candidates: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    safeguards: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def _front_matter(readme: Path) -> dict:
    text = readme.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        raise DataError(readme, 1, "configs", "YAML front matter opened with --- but never closed")
    try:
        return yaml.safe_load(text[3:end]) or {}
    except yaml.YAMLError as e:
        raise DataError(readme, None, "configs", f"bad YAML front matter: {e}") from None


def _data_files(entry, readme: Path, config: str) -> dict[str, list[str]]:
    """A config's `data_files` in any of the forms the hub's YAML allows -> {split: [glob patterns]}."""
    def patterns(p) -> list[str]:
        return p if isinstance(p, list) else [p]

    if isinstance(entry, dict) and "split" not in entry:  # {split: path(s)}
        return {split: patterns(p) for split, p in entry.items()}
    if isinstance(entry, list) and entry and all(isinstance(e, dict) for e in entry):
        if bad := next((e for e in entry if "split" not in e or "path" not in e), None):
            raise DataError(readme, None, "configs", f"config {config!r}: data_files entry {bad!r} lacks split/path")
        return {e["split"]: patterns(e["path"]) for e in entry}
    if isinstance(entry, dict):
        return {entry["split"]: patterns(entry["path"])}
    return {"train": patterns(entry)}  # a bare path or list of paths: datasets calls that split "train"


def config_files(folder: str | Path) -> dict[str, dict[str, list[Path]]]:
    """{config: {split: [parquet files]}} of a parquet dataset folder: the README's `configs:` when present,
    else the `<config>/<split>.parquet` and `<config>/<split>-*.parquet` files found (a split name is word
    characters, datasets' rule, so the first '-' ends it)."""
    folder = Path(folder)
    readme = folder / "README.md"
    configs = _front_matter(readme).get("configs") if readme.is_file() else None
    out: dict[str, dict[str, list[Path]]] = {}
    if configs:
        for c in configs:
            name = c.get("config_name", "default")
            for split, globs in _data_files(c.get("data_files") or [], readme, name).items():
                out.setdefault(name, {})[split] = sorted(p for g in globs for p in folder.glob(g))
        return out
    for f in sorted(folder.glob("*/*.parquet")):
        if not f.parent.name.startswith("."):
            out.setdefault(f.parent.name, {}).setdefault(f.stem.split("-", 1)[0], []).append(f)
    return out


def resolve(path_or_hub: str | Path) -> Path:
    """A local Nano folder, or a hub dataset id downloaded once (only when the hub is reachable)."""
    path = Path(path_or_hub).expanduser()
    if path.is_dir():
        return path.resolve()
    name = str(path_or_hub)
    if os.environ.get("HF_HUB_OFFLINE") == "1" or name.count("/") != 1 or path.exists():
        raise FileNotFoundError(f"Nano dataset {name}: no such folder (a hub id like hakari-bench/NanoCMTEB is "
                                "downloaded only when the hub is reachable: unset HF_HUB_OFFLINE, or download it "
                                "to a folder with `hf download --repo-type dataset ID --local-dir DIR` and pass that)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, repo_type="dataset"))


def splits(folder: str | Path) -> list[str]:
    """The split names of the `queries` config (every config carries the same ones, docs/nano.md s.10)."""
    files = config_files(folder)
    missing = [c for c in CORE if c not in files]
    if missing:
        raise FileNotFoundError(f"{folder} is not a Nano dataset: no {', '.join(missing)} config "
                                f"(found: {', '.join(sorted(files)) or 'nothing'}; layout: care/data/nano.py)")
    return list(files["queries"])


def read_rows(folder: str | Path, config: str, split: str, columns: list[str] | None = None,
              files: dict | None = None) -> list[dict]:
    """The rows of one config's split, in stored order (only `columns`, each required, when given).
    `files`: config_files(folder), when the caller already has it."""
    import pyarrow.parquet as pq

    paths = (files or config_files(folder)).get(config, {}).get(split)
    if not paths:
        raise FileNotFoundError(f"{folder}: config {config!r} has no file for split {split!r}")
    import pyarrow as pa

    rows = []
    for f in paths:
        try:
            table = pq.read_table(f)
        except (FileNotFoundError, PermissionError):
            raise
        except (pa.ArrowException, OSError, ValueError) as e:  # a corrupt (or not a) parquet file: name it
            problem = " ".join(str(e).split()) or type(e).__name__
            raise DataError(f, None, None, f"not a readable parquet file ({type(e).__name__}: {problem})") from None
        absent = [c for c in columns or () if c not in table.column_names]
        if absent:
            raise DataError(f, None, absent[0], f"config {config!r} lacks column(s) {absent} "
                            f"(it has {table.column_names})")
        try:
            rows += (table.select(columns) if columns else table).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as e:  # a page that does not decode
            raise DataError(f, None, None, f"not a readable parquet file ({type(e).__name__}: {e})") from None
    return rows


def _texts(folder: Path, config: str, split: str, files: dict) -> tuple[dict[str, str], set[str]]:
    """{id: text} of a config's split, and the ids whose text is blank (dropped, as sentence-transformers'
    Nano loaders drop them)."""
    out, blank = {}, set()
    for i, r in enumerate(read_rows(folder, config, split, ["_id", "text"], files=files)):
        if r["_id"] is None or r["text"] is None:
            raise DataError(folder / config, i + 1, "_id" if r["_id"] is None else "text", "empty value")
        if str(r["text"]).strip():
            out[str(r["_id"])] = str(r["text"])
        else:
            blank.add(str(r["_id"]))
    return out, blank - set(out)


def _file_names(folder: Path, files: dict, config: str, split: str) -> str:
    paths = files.get(config, {}).get(split) or [folder / config]
    return ", ".join(str(p) for p in paths)


def load_split(folder: str | Path, split: str) -> NanoSplit:
    """Every config of one split: texts, positive qrels, each candidate list, the safeguards.  An id in the
    qrels or a candidate list that is not in the corpus is an error naming the config and query.  A qrel
    whose query is not in the queries (or was dropped for a blank text) cannot be scored: it is left out,
    counted in `counts` (qrels_unknown_query: positives, qrels_unknown_query_ids: distinct query ids) and
    said in a NanoDataWarning naming the qrels file and the count."""
    folder = Path(folder)
    files = config_files(folder)
    if split not in splits(folder):
        raise ValueError(f"{folder}: no split {split!r} (splits: {', '.join(splits(folder))})")
    (queries, blank_queries), (corpus, blank_docs) = (_texts(folder, c, split, files) for c in ("queries", "corpus"))
    qrels: dict[str, dict[str, int]] = {}
    for r in read_rows(folder, "qrels", split, ["query-id", "corpus-id"], files=files):
        docs = r["corpus-id"] if isinstance(r["corpus-id"], list) else [r["corpus-id"]]
        for d in docs:
            if str(d) not in corpus:
                why = "whose text is blank (dropped)" if str(d) in blank_docs else "that is not in the corpus"
                raise DataError(_file_names(folder, files, "qrels", split), None, "corpus-id",
                                f"split {split}: query {r['query-id']} has positive {d} {why}")
            qrels.setdefault(str(r["query-id"]), {})[str(d)] = 1
    unknown = [q for q in qrels if q not in queries]
    counts = {"queries": len(queries), "corpus": len(corpus),
              "qrels": sum(len(j) for q, j in qrels.items() if q in queries),
              "blank_queries_dropped": len(blank_queries), "blank_docs_dropped": len(blank_docs),
              "qrels_unknown_query": sum(len(qrels[q]) for q in unknown),
              "qrels_unknown_query_ids": len(unknown)}
    if unknown:
        blank = sum(q in blank_queries for q in unknown)
        warnings.warn(f"{_file_names(folder, files, 'qrels', split)}: {counts['qrels_unknown_query']} qrels of "
                      f"{len(unknown)} query ids that are not in the queries of split {split} are left out "
                      f"(e.g. {unknown[0]}" + (f"; {blank} of those ids have a blank query text" if blank else "")
                      + ")", NanoDataWarning, stacklevel=2)
    data = NanoSplit(split, queries, corpus, {q: j for q, j in qrels.items() if q in queries}, counts=counts)
    for config, by_split in files.items():
        if config in CORE or config.startswith(MTEB_SUBSET) or split not in by_split:
            continue  # texts and qrels, or an mteb view of them (data_pipeline/nano/layout.py)
        try:
            rows = read_rows(folder, config, split, ["query-id", "corpus-ids"], files=files)
        except DataError:
            continue  # not a candidate config (e.g. an mteb view): its own reader takes it
        lists = {}
        for r in rows:
            ids = [str(d) for d in r["corpus-ids"]]
            if bad := next((d for d in ids if d not in corpus), None):
                raise DataError(folder / config, None, "corpus-ids", f"split {split}: query {r['query-id']} "
                                f"lists candidate {bad}, which is not in the corpus")
            lists[str(r["query-id"])] = ids
        data.candidates[config] = lists
    data.safeguards = _safeguards(folder, split, data.candidates.get(HYBRID, {}))
    return data


def _safeguards(folder: Path, split: str, hybrid: dict[str, list[str]]) -> dict[str, str]:
    """{query id: safeguard doc}: the metadata's `additions` when the folder has them, else every 101st
    candidate (HAKARI's rule: a row is the RRF top 100 plus, when none of it is a positive, one positive)."""
    meta = folder / METADATA
    if meta.is_file():
        block = json.loads(meta.read_text(encoding="utf-8")).get("splits", {}).get(split, {}).get(HYBRID, {})
        if "additions" in block:
            return {a["query_id"]: a["corpus_id"] for a in block["additions"]}
    return {q: ids[HYBRID_TOP_K] for q, ids in hybrid.items() if len(ids) > HYBRID_TOP_K}
