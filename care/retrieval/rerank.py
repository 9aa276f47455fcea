"""A cross-encoder behind the task runners' scorer protocol (care.evaluation.tasks): reranking scores each
query's own candidates with the cross-encoder (care.encoders.cross_encoder); retrieval is retrieve-then-rerank,
a first-stage scorer's top `k` (an EncoderScorer: any encoder) reordered by the cross-encoder, ties kept in
the first stage's order.  Its one method is "rerank".  STS does not apply (a pair's relevance logit is no
similarity): `tasks` leaves it out and evaluate.py reports the cell n/a.

Efficiency (care.evaluation.efficiency) counts both stages: a query's latency is the first stage's query
encoding plus the cross-encoding of `k` (query, document) pairs; the documents' cost is the first stage's (a
cross-encoder has no offline side); the online parameters are both models'.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import numpy as np

from care.encoders.cross_encoder import CrossEncoder
from care.progress import progress

RERANK = "rerank"


class RerankedPair:
    def __init__(self, scorer: RerankerScorer, queries: Sequence[str], docs: Sequence[str], task: str | None):
        self.scorer, self.queries, self.docs, self.task = scorer, list(queries), list(docs), task

    def score(self, method: str, qi: int, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64).tolist()
        return self.scorer.cross.score_pairs([self.queries[qi]] * len(docs), [self.docs[j] for j in docs],
                                             self.scorer.batch_size).astype(np.float64)

    def search(self, depth: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The first stage's top min(k, depth) of every query, reordered by the cross-encoder's scores."""
        s = self.scorer
        if s.retriever is None:
            raise ValueError(f"{s.name}: a cross-encoder retrieves only behind a first stage (rerank.retriever)")
        k = min(s.k, depth, len(self.docs))
        first, _ = s.retriever.prepare(self.queries, self.docs, task=self.task).search(k)[s.retriever_method]
        pools = [row[row >= 0][:k] for row in first]
        flat = self.score_pools(pools)
        idx = np.full((len(self.queries), k), -1, dtype=np.int64)
        val = np.full((len(self.queries), k), -np.inf, dtype=np.float64)
        for qi, (pool, scores) in enumerate(zip(pools, flat)):
            order = np.argsort(-scores, kind="stable")  # ties: the first stage's order
            idx[qi, :len(pool)], val[qi, :len(pool)] = pool[order], scores[order]
        return {RERANK: (idx, val)}

    def score_pools(self, pools: list[np.ndarray]) -> list[np.ndarray]:
        """Every (query, pooled document) pair in one call, so batches mix queries (fewer, fuller batches)."""
        queries = [self.queries[qi] for qi, pool in enumerate(pools) for _ in pool]
        docs = [self.docs[j] for pool in pools for j in pool.tolist()]
        with progress(total=len(queries), desc=f"rerank {self.task or ''} top {self.scorer.k}", unit="pair", leave=False,
                      enabled=self.scorer.show_progress) as bar:
            scores = self.scorer.cross.score_pairs(queries, docs, self.scorer.batch_size, progress=bar).astype(np.float64)
        return np.split(scores, np.cumsum([len(p) for p in pools])[:-1])


class RerankerScorer:
    """`retriever`: the first stage's scorer (None: reranking tasks only, as validation asks);
    `retriever_method`: which of its methods ranks the first stage."""

    methods = (RERANK,)
    asymmetric = False
    tasks = ("retrieval", "reranking", "candidates")

    def __init__(self, cross: CrossEncoder, retriever=None, k: int = 100, retriever_method: str = "dense",
                 batch_size: int = 32, label: str | None = None, show_progress: bool = True):
        self.cross, self.retriever, self.k, self.retriever_method = cross, retriever, int(k), retriever_method
        self.batch_size, self.show_progress = int(batch_size), show_progress
        self.name, self.label = cross.name, label or cross.name
        self._timing_docs: list[str] = []

    @property
    def fingerprint(self) -> str:
        first = f"{self.retriever.fingerprint}:{self.retriever_method}:{self.k}" if self.retriever else "none"
        return hashlib.sha256(f"{self.cross.fingerprint}|{first}".encode()).hexdigest()[:16]

    @property
    def online_parameters(self) -> int:
        return self.cross.online_parameters + (self.retriever.online_parameters if self.retriever else 0)

    @property
    def online_embedding_parameters(self) -> int:
        return self.cross.online_embedding_parameters + (
            self.retriever.online_embedding_parameters if self.retriever else 0)

    def prepare(self, queries: Sequence[str], docs: Sequence[str], doc_side: str = "document",
                cosine: bool = False, task: str | None = None) -> RerankedPair:
        if doc_side != "document" or cosine:
            raise ValueError(f"{self.name}: a cross-encoder scores relevance, not similarity (no STS)")
        return RerankedPair(self, queries, docs, task)

    # efficiency.py's hooks: both stages
    def time_documents(self, texts: Sequence[str]) -> float:
        if self.retriever is None:
            raise ValueError(f"{self.name}: efficiency is measured behind a first stage (rerank.retriever)")
        self._timing_docs = list(texts)[: self.k]  # the k documents each timed query reranks
        return self.retriever.time_documents(texts)

    def time_query(self, text: str) -> float:
        first = self.retriever.time_query(text)
        start = time.perf_counter()
        self.cross.score_pairs([text] * len(self._timing_docs), self._timing_docs, self.batch_size)
        return first + time.perf_counter() - start
