"""The files of a Nano dataset, in HAKARI-bench's layout and column names (docs/nano.md s.10-11), so
`datasets.load_dataset(folder, "queries", split=...)` and care/data/nano.py read it like NanoCMTEB:

    corpus/<split>.parquet  queries/<split>.parquet     _id: string, text: string
    qrels/<split>.parquet                               query-id: string, corpus-id: string (positives)
    bm25/ <dense>/ reranking_hybrid/ <split>.parquet    query-id: string, corpus-ids: list<string>
    mteb_qrels/<split>.parquet                          query-id, corpus-id, score: int32 (mteb's loader)
    reranking_hybrid_metadata.json  metadata/<split>.json  README.md

mteb's retrieval loader needs a `score` column in qrels and finds candidates in a config named
`top_ranked` (docs/nano.md s.10), so the README also declares the subset `mteb`: configs `mteb-corpus`,
`mteb-queries` and `mteb-top_ranked` point at the same files as `corpus`, `queries` and `reranking_hybrid`;
only `mteb-qrels` has files of its own.  Every file is written atomically.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from care.data.io import atomic_open
from care.paths import scrub

MTEB_QRELS = "mteb_qrels"
LABELS = {"bm25": "BM25", "reranking_hybrid": "Hybrid"}  # the dense config is labelled "Dense"


def _write_table(path: Path, columns: dict[str, list], types: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({name: pa.array(values, type=types[name]) for name, values in columns.items()})
    with atomic_open(path, "wb") as fh:
        pq.write_table(table, fh)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_split(out: Path, split: str, queries: dict[str, str], corpus: dict[str, str],
                qrels: dict[str, list[str]], lists: dict[str, dict[str, list[str]]]) -> dict[str, str]:
    """One split's parquet files; returns {relative path: sha256} (the metadata records them: pitfall 14 of
    docs/nano.md's sources, version drift).  Candidate rows follow the query table's order."""
    import pyarrow as pa

    s, ls = pa.string(), pa.list_(pa.string())
    digests = {}

    def put(config: str, columns: dict, types: dict) -> None:
        rel = f"{config}/{split}.parquet"
        digests[rel] = _write_table(out / rel, columns, types)

    put("corpus", {"_id": list(corpus), "text": list(corpus.values())}, {"_id": s, "text": s})
    put("queries", {"_id": list(queries), "text": list(queries.values())}, {"_id": s, "text": s})
    pairs = [(q, d) for q in queries for d in qrels.get(q, [])]
    put("qrels", {"query-id": [q for q, _ in pairs], "corpus-id": [d for _, d in pairs]},
        {"query-id": s, "corpus-id": s})
    put(MTEB_QRELS, {"query-id": [q for q, _ in pairs], "corpus-id": [d for _, d in pairs],
                     "score": [1] * len(pairs)}, {"query-id": s, "corpus-id": s, "score": pa.int32()})
    for config, by_query in lists.items():
        put(config, {"query-id": list(queries), "corpus-ids": [by_query[q] for q in queries]},
            {"query-id": s, "corpus-ids": ls})
    return digests


# ---- the README (dataset card) ---------------------------------------------------------------------------

def _front_matter(split_names: list[str], list_configs: list[str]) -> str:
    def config(name: str, folder: str, default: bool = False) -> list[str]:
        lines = [f"- config_name: {name}"] + (["  default: true"] if default else []) + ["  data_files:"]
        for split in split_names:
            lines += [f"  - split: {split}", f"    path: {folder}/{split}.parquet"]
        return lines

    lines = ["---", "configs:"]
    lines += config("queries", "queries", default=True) + config("corpus", "corpus") + config("qrels", "qrels")
    for name in list_configs:
        lines += config(name, name)
    lines += config("mteb-corpus", "corpus") + config("mteb-queries", "queries") + config("mteb-qrels", MTEB_QRELS)
    lines += config("mteb-top_ranked", "reranking_hybrid")
    return "\n".join(lines + ["---", ""])


def length_stats(texts) -> tuple[float, float, float]:
    """avg / p50 / p75 of len(text) (numpy's linear interpolation, as HAKARI's card: docs/nano.md s.11)."""
    n = np.array([len(str(t)) for t in texts], dtype=float)
    return float(n.mean()), float(np.percentile(n, 50)), float(np.percentile(n, 75))


def statistics_table(rows: dict[str, dict]) -> list[str]:
    """The card's Split Statistics table; rows: {split: {"queries", "corpus", "qrels", "query_chars",
    "doc_chars"}} with the two length triples from `length_stats`."""
    head = ("| Nano split | Queries | Corpus | Qrels | Query chars avg | p50 | p75 | Doc chars avg | p50 | p75 |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for split, r in rows.items():
        lengths = " | ".join(f"{x:.1f}" for x in (*r["query_chars"], *r["doc_chars"]))
        lines.append(f"| {split} | {r['queries']:,} | {r['corpus']:,} | {r['qrels']:,} | {lengths} |")
    return lines


def quality_table(rows: dict[str, dict], dense: str) -> list[str]:
    """The card's Candidate Quality table (docs/nano.md s.11): rows {split: {"tokenizer", "quality":
    {config: {"ndcg_at_10", "recall_at_100"}}, "candidates": "100-101", "safeguards": int}} and a Mean row
    (unweighted over splits, safeguards summed).  Recall@100 is the macro per-query one (rank 101 excluded)."""
    configs = ["bm25", dense, "reranking_hybrid"]
    label = {**LABELS, dense: "Dense"}
    head = (["Nano split", "BM25 tokenizer"] + [f"{label[c]} nDCG@10" for c in configs]
            + [f"{label[c]} Recall@100" for c in configs] + ["Hybrid candidates", "Safeguard positives"])

    def cells(metric_rows: list[dict]) -> list[str]:
        return [f"{100 * np.mean([r[c][m] for r in metric_rows]):.2f}"
                for m in ("ndcg_at_10", "recall_at_100") for c in configs]

    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    mean = ["Mean", "-"] + cells([r["quality"] for r in rows.values()])
    mean += ["-", str(sum(r["safeguards"] for r in rows.values()))]
    lines.append("| " + " | ".join(mean) + " |")
    for split, r in rows.items():
        lines.append("| " + " | ".join([split, r["tokenizer"]] + cells([r["quality"]])
                                       + [r["candidates"], str(r["safeguards"])]) + " |")
    return lines


def write_card(out: Path, title: str, intro: list[str], split_names: list[str], dense: str,
               statistics: dict[str, dict], quality: dict[str, dict], safeguards: int, limited: int) -> None:
    lines = [_front_matter(split_names, ["bm25", dense, "reranking_hybrid"]), f"# {title}", "", *intro, "",
             "## Split Statistics", "", *statistics_table(statistics), "",
             "## Candidate Quality", "",
             ("nDCG@10 and Recall@100 of each stored list read as a ranking against the qrels (binary gains, macro "
              "over queries; Recall@100 counts `ranking[:100]`, so the rank-101 safeguard never counts; the micro "
              "coverage, safeguard included, is `relevant_coverage` in reranking_hybrid_metadata.json)."), "",
             *quality_table(quality, dense), "",
             "## Hybrid Safeguard Summary", "",
             "| Item | Value |", "|---|---:|", f"| Safeguard positives | {safeguards} |",
             f"| Rows limited by corpus size | {limited} |", "| Metadata file | reranking_hybrid_metadata.json |", ""]
    with atomic_open(out / "README.md") as fh:
        fh.write(scrub("\n".join(lines)))  # a source named by its folder: relative (care.paths.scrub)
