"""The scorer the task runners call for any care.encoders.Encoder, with the embedding cache in between.

Scoring methods: one per head the encoder gives (its family's `outputs`, care/families.py), its first
head always (Encoder.select_heads), and `hybrid` = weighted mean of the available heads when there are
several (FlagEmbedding's M3 combination, weights from the config).  The heads that rank a whole corpus on
their own (FIRST_STAGE) do so exactly: dense by inner-product search (a flat index), sparse by a sparse
matrix product.  ColBERT and hybrid retrieval rescore the union of those heads' top `rerank_depth`
documents, as FlagEmbedding's M3 evaluation does: exhaustive ColBERT scoring of a corpus is not affordable
on a CPU.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from care.encoders import Embeddings, Encoder
from care.encoders.cache import EmbeddingCache, embed
from care.encoders.scores import colbert_score, lexical_score
from care.retrieval.index import flat_index, sparse_matrix, top_k, unit_rows

#: the heads that rank a whole corpus on their own (exactly); ColBERT and hybrid rescore their top documents
FIRST_STAGE = ("dense", "sparse")


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
        out = {}
        if "dense" in self.methods:  # exact: a flat inner-product index
            scores, indices = flat_index(self.d.dense).search(np.ascontiguousarray(self.q.dense, np.float32), k)
            out["dense"] = (indices, scores)
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
                                             for h in FIRST_STAGE if h in first_stage]))
            pool = pool[pool >= 0]
            s = self.score(method, qi, pool)
            order = np.argsort(-s, kind="stable")[:k]
            idx[qi, :len(order)], val[qi, :len(order)] = pool[order], s[order]
        return idx, val


class EncoderScorer:
    """Evaluation through the care.encoders.Encoder interface, with the embedding cache in between."""

    def __init__(self, encoder: Encoder, cache: EmbeddingCache | None = None, batch_size: int = 64,
                 cached_sides: Sequence[str] = ("query", "document"),
                 heads: Sequence[str] | None = None, hybrid_weights: dict[str, float] | None = None,
                 rerank_depth: int = 100, label: str | None = None, show_progress: bool = True):
        self.encoder, self.cache = encoder, cache or EmbeddingCache(None, enabled=False)
        # the sides the cache may serve: a side whose weights change in training (a live model keeps the
        # fingerprint of its starting folder) must be encoded afresh every time
        self.cached_sides = tuple(cached_sides)
        self.batch_size, self.rerank_depth, self.show_progress = batch_size, rerank_depth, show_progress
        self.heads = encoder.select_heads(heads)  # its first head always
        if not any(h in FIRST_STAGE for h in self.heads):
            raise ValueError(f"{encoder.name}: its heads {list(self.heads)} hold none that ranks a corpus on its "
                             f"own ({' or '.join(FIRST_STAGE)})")
        self.methods = self.heads + (("hybrid",) if len(self.heads) > 1 else ())
        self.hybrid_weights = dict(hybrid_weights or {"dense": 1.0, "sparse": 0.3, "colbert": 1.0})
        self.name, self.label = encoder.name, label or encoder.name
        # two different sides (a query tower and a document tower): STS scores both layouts
        self.asymmetric = encoder.identity("query") != encoder.identity("document")

    @property
    def fingerprint(self) -> str:
        return self.encoder.fingerprint

    @property
    def online_parameters(self) -> int:
        return self.encoder.online_parameters

    @property
    def online_embedding_parameters(self) -> int:
        return self.encoder.online_embedding_parameters

    def embed(self, texts: Sequence[str], side: str, task: str | None = None) -> Embeddings:
        cache = self.cache if side in self.cached_sides else None
        return embed(self.encoder, texts, side, cache, self.batch_size, self.heads, self.show_progress, task)

    def prepare(self, queries: Sequence[str], docs: Sequence[str], doc_side: str = "document",
                cosine: bool = False, task: str | None = None) -> EncodedPair:
        """`doc_side="query"` embeds the documents with the query side too (STS: both sides are queries);
        `cosine` re-normalises dense vectors (STS compares directions, whatever the model's norms)."""
        q, d = self.embed(queries, "query", task), self.embed(docs, doc_side, task)
        if cosine and q.dense is not None:
            q = Embeddings(unit_rows(q.dense), q.sparse, q.colbert)
            d = Embeddings(unit_rows(d.dense), d.sparse, d.colbert)
        return EncodedPair(q, d, self.methods, self.hybrid_weights, self.rerank_depth)

    # efficiency.py's hooks: raw encoding, no cache
    def time_documents(self, texts: Sequence[str]) -> float:
        start = time.perf_counter()
        self.encoder.encode_documents(list(texts), batch_size=self.batch_size, heads=self.heads[:1])
        return time.perf_counter() - start

    def time_query(self, text: str) -> float:
        start = time.perf_counter()
        self.encoder.encode_queries([text], batch_size=1, heads=self.heads[:1])
        return time.perf_counter() - start
