"""One split of the Nano stage (stage.py): its BM25 and dense candidate lists over the selected queries and
corpus, their reciprocal rank fusion with the safeguard and its audit (candidates.py), the split's files
(layout.py) and its metadata and candidate-quality table (docs/nano.md s.5-9).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from care.data.io import write_json
from care.paths import portable
from data_pipeline.nano import candidates, layout
from data_pipeline.nano.select import Selection
from data_pipeline.nano.sources import SourceTask


def bm25_lists(sel: Selection, opts: dict) -> dict[str, list[str]]:
    """BM25 top-k of each query over the split's corpus: HAKARI's tokens and formula (docs/nano.md s.5);
    positives are not forced in."""
    from care.retrieval.bm25 import BM25Scorer

    b = opts["bm25"]
    scorer = BM25Scorer(k1=b["k1"], b=b["b"], method=b["method"], tokenizer=b["tokenizer"])
    doc_ids = list(sel.corpus)
    idx, _ = scorer.prepare(list(sel.queries.values()), list(sel.corpus.values())).search(b["top_k"])["bm25"]
    return {q: [doc_ids[i] for i in row if i >= 0] for q, row in zip(sel.queries, idx)}


def dense_lists(sel: Selection, encoder, cache, opts: dict, split: str) -> dict[str, list[str]]:
    """Cosine top-k of each query (docs/nano.md s.6), embeddings through the cache: the corpus in shards of
    `shard_size` texts, each one cache chunk, so the progress bar's estimate is honest and a stopped build
    loses at most one shard."""
    from care.encoders.cache import embed
    from care.retrieval.index import top_k, unit_rows

    d = opts["dense"]
    texts, doc_ids = list(sel.corpus.values()), list(sel.corpus)
    shards = [texts[i:i + d["shard_size"]] for i in range(0, len(texts), d["shard_size"])]
    parts = []
    for shard in tqdm(shards, desc=f"nano/{split}: encode corpus", unit="shard"):
        parts.append(embed(encoder, shard, "document", cache, d["batch_size"], show_progress=False,
                           task="retrieval").dense)
    docs = unit_rows(np.concatenate(parts))
    queries = unit_rows(embed(encoder, list(sel.queries.values()), "query", cache, d["batch_size"],
                              show_progress=False, task="retrieval").dense)
    idx, _ = top_k(queries @ docs.T, d["top_k"])
    return {q: [doc_ids[i] for i in row] for q, row in zip(sel.queries, idx)}


def build_split(task: SourceTask, sel: Selection, encoder, cache, opts: dict, dense: str, out: Path) -> dict:
    """Split `task.name` (its selection `sel`) written into the dataset folder `out`, its hybrid list
    audited; returns what the dataset's files need of it: `meta` (reranking_hybrid_metadata.json), `card`
    and `quality_row` (README.md), `metadata` (metadata/<split>.json)."""
    start = time.perf_counter()
    lists = {"bm25": bm25_lists(sel, opts)}
    t_bm25 = time.perf_counter()
    lists[dense] = dense_lists(sel, encoder, cache, opts, task.name)
    t_dense = time.perf_counter()
    h = opts["hybrid"]
    hybrid, hybrid_meta = candidates.hybrid_lists(list(sel.queries), lists["bm25"], lists[dense], sel.qrels,
                                                  sel.corpus, task.name, seed=opts["seed"], rrf_k=h["rrf_k"],
                                                  top_k=h["top_k"])
    candidates.audit(task.name, list(sel.queries), sel.corpus, sel.qrels, hybrid, top_k=h["top_k"])
    lists["reranking_hybrid"] = hybrid
    digests = layout.write_split(out, task.name, sel.queries, sel.corpus, sel.qrels, lists)
    quality = {c: candidates.candidate_quality(lists[c], sel.qrels) for c in lists}
    b = opts["bm25"]
    tokenizer = {"resolved_tokenizer": b["tokenizer"], "resolved_tokenizer_name": b["language"],
                 "auto_detected_language": None, "language_source": "configured (no detection: known zh)"}
    meta = {"corpus_count": len(sel.corpus), "query_count": len(sel.queries),
            "qrel_count": sum(len(v) for v in sel.qrels.values()),
            "bm25": {**candidates.list_counts(lists["bm25"]), **tokenizer},
            dense: candidates.list_counts(lists[dense]), "reranking_hybrid": hybrid_meta}
    split_meta = {**sel.metadata, "source": portable(task.provenance), "files_sha256": digests,  # no machine path
                  "candidate_quality": {c: {k: v for k, v in q.items() if k != "per_query"} for c, q in quality.items()},
                  "seconds": {"bm25": round(t_bm25 - start, 2), "dense": round(t_dense - t_bm25, 2),
                              "total": round(time.perf_counter() - start, 2)}}
    write_json(out / "metadata" / f"{task.name}.json", split_meta)
    card = {"queries": len(sel.queries), "corpus": len(sel.corpus), "qrels": meta["qrel_count"],
            "query_chars": layout.length_stats(sel.queries.values()),
            "doc_chars": layout.length_stats(sel.corpus.values())}
    counts = hybrid_meta
    quality_row = {"tokenizer": f"{b['tokenizer']}@{b['language']}", "quality": quality,
                   "candidates": f"{counts['candidate_count_min']}-{counts['candidate_count_max']}",
                   "safeguards": counts["safeguard_positive_count"]}
    return {"meta": meta, "card": card, "quality_row": quality_row, "metadata": split_meta}
