"""The lexical baseline: BM25 (bm25s, Lucene's formula) over jieba word segmentation.

It offers the task runners the same two calls an encoder's scorer does (`prepare(queries, docs)` ->
`search(depth)` and `score("bm25", query, docs)`), so every task runs it unchanged.  Statistics (idf,
average length) come from the documents each task scores: the retrieval corpus, the pooled candidates of
a reranking set, every sentence of an STS set.  Chinese has no spaces, so the text is segmented with
jieba (precise mode) and lower-cased; tokens with no letter or digit (punctuation, spaces) are dropped.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence

import bm25s
import jieba
import numpy as np

jieba.setLogLevel(logging.WARNING)
logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index build at DEBUG


def tokenize(text: str) -> list[str]:
    return [t.lower() for t in jieba.lcut(text) if any(c.isalnum() for c in t)]


class BM25Prepared:
    def __init__(self, queries: Sequence[str], docs: Sequence[str], k1: float, b: float):
        self.queries = [tokenize(q) for q in queries]
        self.index = bm25s.BM25(k1=k1, b=b)
        self.index.index([tokenize(d) for d in docs], show_progress=False)
        self.n_docs = len(docs)
        self._last: tuple[int, np.ndarray] | None = None  # callers ask for one query's docs in a row

    def search(self, depth: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        k = min(depth, self.n_docs)
        found = self.index.retrieve(self.queries, k=k, show_progress=False, n_threads=1)
        return {"bm25": (np.asarray(found.documents, dtype=np.int64), np.asarray(found.scores, dtype=np.float32))}

    def score(self, method: str, qi: int, docs) -> np.ndarray:
        if method != "bm25":
            raise ValueError(f"BM25 has only the 'bm25' scoring method, not {method!r}")
        if self._last is None or self._last[0] != qi:
            self._last = (qi, self.index.get_scores(self.queries[qi]))
        return self._last[1][np.asarray(docs, dtype=np.int64)]


class BM25Scorer:
    methods = ("bm25",)
    online_parameters = online_embedding_parameters = 0

    def __init__(self, k1: float = 1.5, b: float = 0.75, name: str = "bm25", label: str = "BM25 (bm25s + jieba)"):
        self.k1, self.b, self.name, self.label = k1, b, name, label
        self._timed: BM25Prepared | None = None

    @property
    def fingerprint(self) -> str:
        blob = json.dumps({"bm25s": bm25s.__version__, "jieba": jieba.__version__, "k1": self.k1, "b": self.b})
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def prepare(self, queries: Sequence[str], docs: Sequence[str], doc_side: str = "document",
                cosine: bool = False, task: str | None = None) -> BM25Prepared:
        return BM25Prepared(queries, docs, self.k1, self.b)

    # efficiency.py's hooks: indexing speed, and one query's segmentation + top-10 search on that index
    def time_documents(self, texts: Sequence[str]) -> float:
        start = time.perf_counter()
        self._timed = BM25Prepared([], texts, self.k1, self.b)
        return time.perf_counter() - start

    def time_query(self, text: str) -> float:
        if self._timed is None:
            raise RuntimeError("call time_documents first: a BM25 query needs an index to search")
        start = time.perf_counter()
        self._timed.index.retrieve([tokenize(text)], k=min(10, self._timed.n_docs), show_progress=False, n_threads=1)
        return time.perf_counter() - start
