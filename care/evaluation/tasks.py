"""Task runners: retrieval, reranking and STS, in the layouts C-MTEB and CMedTEB share.

    retrieval  a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv; graded qrels allowed), or
               any folder a data_pipeline source reader reads into query -> judged-candidate lists (e.g.
               a cMedQA2 release folder with `reader: cmedqa_release`)
    reranking  JSON Lines {"query", "positive": [...], "negative": [...]}  (C-MTEB's columns).  Graded
               sets may add "positive_grades": [int >= 1, ...] beside "positive" (the gain nDCG gives each
               positive; negatives have gain 0); MAP, MRR and Hit stay binary (positive vs negative).
    sts        JSON Lines {"sentence1", "sentence2", "score"}

Files are read by the project's source readers (data_pipeline.sources: one reader per format, errors
name file, line and field).  A runner talks to a *scorer*: `scorer.prepare(queries, docs)` returns an
object with `search(depth) -> {method: (indices, scores)}` (every query against every doc) and
`score(method, query_index, doc_indices) -> scores`.  `EncoderScorer` (here) serves any
care.encoders.Encoder; `BM25Scorer` (bm25.py) the lexical baseline.

Scoring methods of an encoder: `dense` always (exact inner-product search with FAISS IndexFlatIP over
the whole corpus, faiss-gpu when present); `sparse` and `colbert` when the encoder has those heads,
and `hybrid` = weighted mean of the available heads (FlagEmbedding's M3 combination, weights from the
config).  Sparse retrieval is exact over the whole corpus (a sparse matrix product); ColBERT and
hybrid retrieval rescore the union of the dense and sparse top `rerank_depth` documents, as
FlagEmbedding's M3 evaluation does: exhaustive ColBERT scoring of a corpus is not affordable on a CPU.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from scipy import sparse as sp

from care.encoders import Embeddings, Encoder
from care.evaluation.cache import EmbeddingCache
from care.evaluation.metrics import (
    accuracy_at_n,
    average,
    evaluate_per_query,
    run_from_topk,
    sts_correlations,
)
from care.models.m3 import colbert_score, lexical_score
from data_pipeline.io import DataError
from data_pipeline.records import Pair, QueryCandidates, Text
from data_pipeline.sources import read_source

TYPES = ("retrieval", "reranking", "sts")
DEFAULT_READER = {"retrieval": "beir", "reranking": "cmteb_reranking", "sts": "sts_jsonl"}


# ---- task data ---------------------------------------------------------------------------------------

@dataclass
class TaskData:
    """A loaded task.  Retrieval and reranking: queries {id: text}, docs {id: text}, qrels
    {query id: {doc id: grade}} (for reranking the qrels keys are exactly each query's candidates).
    STS: pairs [(text1, text2)] and gold scores."""

    type: str
    path: str
    queries: dict[str, str] = field(default_factory=dict)
    docs: dict[str, str] = field(default_factory=dict)
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    gold: list[float] = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def _grade(label, path: str, qid: str) -> int:
    if label is None or float(label) != int(label):
        raise DataError(path, None, "score", f"query {qid}: relevance {label!r} is not an integer grade")
    return int(label)


def load_task(kind: str, path: str | Path, split: str = "test", reader: str | None = None,
              reader_options: dict | None = None) -> TaskData:
    """Read a task file or folder with the source reader for its layout."""
    if kind not in TYPES:
        raise ValueError(f"unknown task type {kind!r} (choose one of {', '.join(TYPES)})")
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"task {kind} file {path} does not exist")
    reader = reader or DEFAULT_READER[kind]
    folder = path.parent if path.is_file() else path
    opts = {"reader": reader, "path": folder.name, **(reader_options or {})}
    if reader in ("cmteb_reranking", "sts_jsonl"):  # a JSON Lines file, or a folder of <split>.jsonl
        opts["files"] = {split: path.name if path.is_file() else f"{split}.jsonl"}
    elif reader in ("beir", "cmedqa_release"):
        opts.setdefault("splits", [split])
    records, report = read_source(folder.name, opts, folder.parent)
    texts = {r.id: r for r in records if isinstance(r, Text)}
    data = TaskData(kind, str(path), counts={"reader": reader, "read": report.as_dict()})

    if kind == "sts":
        for p in records:
            if isinstance(p, Pair) and p.split == split:
                data.pairs.append((texts[p.text1_id].text, texts[p.text2_id].text))
                data.gold.append(float(p.label))
        if len(data.pairs) < 2:
            raise DataError(path, None, "sentence1", f"split {split!r} has {len(data.pairs)} pairs; STS needs >= 2")
        data.counts["pairs"] = len(data.pairs)
        return data

    for qc in records:
        if isinstance(qc, QueryCandidates) and qc.split == split:
            judged = data.qrels.setdefault(qc.query_id, {})
            for doc, label in qc.candidates:
                judged[doc] = _grade(label, str(path), qc.query_id)
            data.queries[qc.query_id] = texts[qc.query_id].text
    if not data.queries:
        raise DataError(path, None, None, f"no judged query in split {split!r}")
    if kind == "retrieval":  # the corpus: every text that is not a query (BEIR documents, cMedQA answers)
        query_roles = {texts[q].role for q in data.queries}
        data.docs = {t.id: t.text for t in texts.values() if t.role not in query_roles}
    else:
        # A list with no positive or no negative cannot tell models apart (mteb skips them as well).
        one_sided = [q for q, judged in data.qrels.items() if len({g > 0 for g in judged.values()}) < 2]
        for q in one_sided:
            del data.qrels[q], data.queries[q]
        data.counts["skipped_one_sided_lists"] = len(one_sided)
        data.docs = {d: texts[d].text for judged in data.qrels.values() for d in judged}
        if not data.qrels:
            raise DataError(path, None, "positive", "no query has both a positive and a negative candidate")
    data.counts.update(queries=len(data.queries), docs=len(data.docs),
                       judgements=sum(len(j) for j in data.qrels.values()))
    return data


# ---- scoring with an Encoder ---------------------------------------------------------------------------

def flat_index(vectors: np.ndarray):
    """Exact inner-product search; on every GPU when faiss-gpu is installed, the same calls either way."""
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # quiet about which CPU build it picked
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    if faiss.get_num_gpus() > 0:
        index = faiss.index_cpu_to_all_gpus(index)
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return index


def sparse_matrix(weights: list[dict[int, float]], width: int) -> sp.csr_matrix:
    indptr = np.cumsum([0] + [len(w) for w in weights])
    indices = np.fromiter((t for w in weights for t in w), dtype=np.int64, count=indptr[-1])
    values = np.fromiter((v for w in weights for v in w.values()), dtype=np.float64, count=indptr[-1])
    return sp.csr_matrix((values, indices, indptr), shape=(len(weights), width))


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top k of a dense score block, best first."""
    k = min(k, scores.shape[1])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    part_scores = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-part_scores, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(part_scores, order, axis=1)


class EncodedPair:
    """Queries and documents embedded by one encoder; scores by head, and the hybrid of the heads."""

    def __init__(self, q: Embeddings, d: Embeddings, methods: tuple[str, ...], weights: dict[str, float],
                 rerank_depth: int):
        self.q, self.d, self.methods = q, d, methods
        self.weights = {h: float(weights.get(h, 0.0)) for h in methods if h != "hybrid"}
        self.rerank_depth = rerank_depth
        if q.sparse is not None:
            width = 1 + max([t for w in q.sparse + d.sparse for t in w] or [0])
            self.q_sparse, self.d_sparse = sparse_matrix(q.sparse, width), sparse_matrix(d.sparse, width)

    def score(self, method: str, qi: int, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        if method == "dense":
            return self.d.dense[docs] @ self.q.dense[qi]
        if method == "sparse":
            return np.array([lexical_score(self.q.sparse[qi], self.d.sparse[j]) for j in docs.tolist()])
        if method == "colbert":
            return np.array([colbert_score(self.q.colbert[qi], self.d.colbert[j]) for j in docs.tolist()])
        if method == "hybrid":
            total = sum(self.weights.values())
            return sum(w * self.score(h, qi, docs) for h, w in self.weights.items() if w) / total
        raise ValueError(f"unknown scoring method {method!r}")

    def search(self, depth: int, block: int = 256) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        k = min(depth, len(self.d))
        scores, indices = flat_index(self.d.dense).search(np.ascontiguousarray(self.q.dense, np.float32), k)
        out = {"dense": (indices, scores)}
        if "sparse" in self.methods:  # exact: a sparse product, one block of queries at a time
            parts = [top_k((self.q_sparse[s:s + block] @ self.d_sparse.T).toarray(), k)
                     for s in range(0, len(self.q), block)]
            out["sparse"] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        for method in ("colbert", "hybrid"):
            if method in self.methods:
                out[method] = self._rescore(method, out, k)
        return out

    def _rescore(self, method: str, first_stage: dict, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.full((len(self.q), k), -1, dtype=np.int64)
        val = np.full((len(self.q), k), -np.inf, dtype=np.float32)
        for qi in range(len(self.q)):
            pool = np.unique(np.concatenate([first_stage[h][0][qi, :self.rerank_depth]
                                             for h in ("dense", "sparse") if h in first_stage]))
            pool = pool[pool >= 0]
            s = self.score(method, qi, pool)
            order = np.argsort(-s, kind="stable")[:k]
            idx[qi, :len(order)], val[qi, :len(order)] = pool[order], s[order]
        return idx, val


class EncoderScorer:
    """Evaluation through the care.encoders.Encoder interface, with the embedding cache in between."""

    def __init__(self, encoder: Encoder, cache: EmbeddingCache | None = None, batch_size: int = 64,
                 heads: Sequence[str] | None = None, hybrid_weights: dict[str, float] | None = None,
                 rerank_depth: int = 100, label: str | None = None, show_progress: bool = True):
        self.encoder, self.cache = encoder, cache or EmbeddingCache(enabled=False)
        self.batch_size, self.rerank_depth, self.show_progress = batch_size, rerank_depth, show_progress
        wanted = encoder.heads if heads is None else heads
        self.heads = tuple(h for h in encoder.heads if h in wanted)
        if "dense" not in self.heads:
            raise ValueError(f"{encoder.name}: dense scoring is always evaluated; heads={list(wanted)}")
        self.methods = self.heads + (("hybrid",) if len(self.heads) > 1 else ())
        self.hybrid_weights = dict(hybrid_weights or {"dense": 1.0, "sparse": 0.3, "colbert": 1.0})
        self.name, self.label = encoder.name, label or encoder.name

    @property
    def fingerprint(self) -> str:
        return self.encoder.fingerprint

    @property
    def online_parameters(self) -> int:
        return self.encoder.online_parameters

    def embed(self, texts: Sequence[str], side: str) -> Embeddings:
        def encode(todo: list[str]) -> Embeddings:
            fn = self.encoder.encode_queries if side == "query" else self.encoder.encode_documents
            emb = fn(todo, batch_size=self.batch_size, heads=self.heads, show_progress=self.show_progress)
            check_finite(emb, todo, f"{self.name} {side} embedding")
            return emb

        return self.cache.get(self.fingerprint, side, self.heads, list(texts), encode)

    def prepare(self, queries: Sequence[str], docs: Sequence[str], doc_side: str = "doc",
                cosine: bool = False) -> EncodedPair:
        """`doc_side="query"` embeds the documents with the query tower too (STS: both sides are queries);
        `cosine` re-normalises dense vectors (STS compares directions, whatever the model's norms)."""
        q, d = self.embed(queries, "query"), self.embed(docs, doc_side)
        if cosine:
            q = Embeddings(_unit(q.dense), q.sparse, q.colbert)
            d = Embeddings(_unit(d.dense), d.sparse, d.colbert)
        return EncodedPair(q, d, self.methods, self.hybrid_weights, self.rerank_depth)

    # efficiency.py's hooks: raw encoding, no cache
    def time_documents(self, texts: Sequence[str]) -> float:
        start = time.perf_counter()
        self.encoder.encode_documents(list(texts), batch_size=self.batch_size, heads=("dense",))
        return time.perf_counter() - start

    def time_query(self, text: str) -> float:
        start = time.perf_counter()
        self.encoder.encode_queries([text], batch_size=1, heads=("dense",))
        return time.perf_counter() - start


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def check_finite(emb: Embeddings, texts: Sequence[str], what: str) -> None:
    """A NaN embedding must stop the run (and never reach the cache), naming the text that produced it."""
    rows = [~np.isfinite(emb.dense).all(axis=1)]
    if emb.sparse is not None:
        rows.append(np.array([not np.isfinite(list(w.values())).all() for w in emb.sparse], dtype=bool))
    if emb.colbert is not None:
        rows.append(np.array([not np.isfinite(c).all() for c in emb.colbert], dtype=bool))
    bad = np.flatnonzero(np.any(rows, axis=0))
    if len(bad):
        i = int(bad[0])
        raise FloatingPointError(f"{what}: NaN/inf for {len(bad)} of {len(texts)} texts, first #{i}: {texts[i][:60]!r}")


# ---- runners -------------------------------------------------------------------------------------------

def _finite(scores: np.ndarray, data: TaskData, item: str) -> np.ndarray:
    if not np.isfinite(scores).all():
        raise FloatingPointError(f"{data.path}: the model gave a NaN/inf score for {item}")
    return scores


def _trec(run, data: TaskData, metrics: Sequence[str], method: str, items: dict | None) -> dict[str, float]:
    """Averaged trec metrics; with `items`, each query's values too (what significance.py resamples)."""
    per_query = evaluate_per_query(run, data.qrels, metrics)
    if items is not None:
        items[method] = {"per_query": per_query}
    return average(per_query, metrics)


def run_retrieval(data: TaskData, scorer, metrics: Sequence[str], depth: int = 1024, seed: int = 0,
                  items: dict | None = None) -> dict[str, dict[str, float]]:
    """Every query against the whole corpus; trec metrics on the top `depth`, Acc@N (`acc_N`) by sampling
    N - 1 random negatives per (query, positive) pair (care.evaluation.metrics.accuracy_at_n).
    `items`, a dict, receives each method's per-query values (Acc@N has none: it is a rate over trials)."""
    qids, dids = list(data.queries), list(data.docs)
    prepared = scorer.prepare([data.queries[q] for q in qids], [data.docs[d] for d in dids])
    trec = [m for m in metrics if not m.startswith("acc_")]
    position = {d: i for i, d in enumerate(dids)}
    relevant = [[position[d] for d, g in data.qrels[q].items() if g >= 1] for q in qids]
    results = {}
    for method, (idx, scores) in prepared.search(depth).items():
        for row, qid in enumerate(qids):
            keep = idx[row] >= 0
            _finite(scores[row][keep], data, f"query {data.queries[qid]!r} ({method})")
        results[method] = _trec(run_from_topk(qids, dids, idx, scores), data, trec, method, items) if trec else {}
        for m in metrics:
            if m.startswith("acc_"):
                results[method][m] = accuracy_at_n(partial(prepared.score, method), relevant, int(m[4:]),
                                                   corpus_size=len(dids), seed=seed)
    return results


def run_reranking(data: TaskData, scorer, metrics: Sequence[str], items: dict | None = None) -> dict[str, dict[str, float]]:
    """Score each query's own candidates; trec metrics over that list (MAP@10 divides by all positives).
    `items`, a dict, receives each method's per-query values."""
    qids, dids = list(data.queries), list(data.docs)
    position = {d: i for i, d in enumerate(dids)}
    prepared = scorer.prepare([data.queries[q] for q in qids], [data.docs[d] for d in dids])
    results = {}
    for method in scorer.methods:
        run = {}
        for qi, qid in enumerate(qids):
            cands = list(data.qrels[qid])
            s = _finite(prepared.score(method, qi, [position[d] for d in cands]), data,
                        f"a candidate of query {data.queries[qid]!r} ({method})")
            run[qid] = dict(zip(cands, s.tolist()))
        results[method] = _trec(run, data, metrics, method, items)
    return results


def run_sts(data: TaskData, scorer, metrics: Sequence[str] = ("pearson", "spearman"),
            items: dict | None = None) -> dict[str, dict[str, float]]:
    """Similarity of each pair vs the gold score.  Both sides are embedded as queries and compared by
    cosine; a pair's score is the mean of both directions (ColBERT and BM25 are not symmetric).
    `items`, a dict, receives each method's predicted similarities and the gold scores."""
    texts = list(dict.fromkeys(t for pair in data.pairs for t in pair))
    position = {t: i for i, t in enumerate(texts)}
    prepared = scorer.prepare(texts, texts, doc_side="query", cosine=True)
    results = {}
    for method in scorer.methods:
        predicted = np.array([(prepared.score(method, position[a], [position[b]])[0]
                               + prepared.score(method, position[b], [position[a]])[0]) / 2
                              for a, b in data.pairs])
        bad = np.flatnonzero(~np.isfinite(predicted))
        if len(bad):
            a, b = data.pairs[bad[0]]
            _finite(predicted, data, f"pair #{bad[0] + 1} ({a!r}, {b!r})")
        corr = sts_correlations(predicted, data.gold)
        results[method] = {m: corr[m] for m in metrics}
        if items is not None:
            items[method] = {"predicted": predicted.tolist(), "gold": list(data.gold)}
    return results


RUNNERS = {"retrieval": run_retrieval, "reranking": run_reranking, "sts": run_sts}
