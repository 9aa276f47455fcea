"""The lexical baseline: BM25 (bm25s) over jieba word segmentation, with two tokenizers.

It offers the task runners the same two calls an encoder's scorer does (`prepare(queries, docs)` ->
`search(depth)` and `score("bm25", query, docs)`), so every task runs it unchanged.  Statistics (idf,
average length) come from the documents each task scores: the retrieval corpus, the pooled candidates of
a reranking set, every sentence of an STS set.  Chinese has no spaces, so the text is segmented with jieba.

Two tokenizers, chosen by name (`TOKENIZERS`):
- `words` (the default, used for every benchmark table of this project): jieba precise mode, lower-cased,
  tokens with no letter or digit (punctuation, spaces) dropped; scored with bm25s' Lucene formula.
- `wordseg`: HAKARI-bench's Chinese tokenizer, used to build Nano candidate lists (docs/nano.md s.5):
  `jieba.cut` per 4,000-character chunk, every non-empty token kept as it is (punctuation and whitespace
  included, no lower-casing).  The Nano lists pair it with `method="robertson"`.

Query tokens missing from the index vocabulary are dropped (bm25s' `get_tokens_ids` does this), so a query
made only of unknown tokens, or of none, scores 0 for every document.  A token repeated in the query adds
its term score once per occurrence: bm25s sums over the query's token list, not over its distinct tokens.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence

import bm25s
import jieba
import numpy as np

jieba.setLogLevel(logging.WARNING)
logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index build at DEBUG

WORDSEG_CHUNK_CHARS = 4000  # HAKARI segments long texts in chunks of this many characters (docs/nano.md s.5)
METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")  # bm25s' scoring variants
DEFAULT_METHOD, DEFAULT_TOKENIZER = "lucene", "words"


def tokenize(text: str) -> list[str]:
    """The project's tokenizer: jieba words, lower-cased, with punctuation and whitespace dropped."""
    return [t.lower() for t in jieba.lcut(text) if any(c.isalnum() for c in t)]


def wordseg(text: str) -> list[str]:
    """HAKARI's `wordseg@zh`: default `jieba.cut` (accurate mode, HMM on) over 4,000-character chunks.

    Every non-empty token is kept unchanged, so BM25 sees punctuation and whitespace and is case
    sensitive; the chunking changes where words can form, hence it is part of the recipe
    (docs/nano.md s.5).
    """
    tokens: list[str] = []
    for start in range(0, len(text), WORDSEG_CHUNK_CHARS):
        tokens.extend(s for s in map(str, jieba.cut(text[start:start + WORDSEG_CHUNK_CHARS])) if s)
    return tokens


TOKENIZERS: dict[str, Callable[[str], list[str]]] = {"words": tokenize, "wordseg": wordseg}


def _tokenizer(name: str) -> Callable[[str], list[str]]:
    if name not in TOKENIZERS:
        raise ValueError(f"unknown BM25 tokenizer {name!r}: choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]


class BM25Prepared:
    def __init__(self, queries: Sequence[str], docs: Sequence[str], k1: float, b: float,
                 method: str = DEFAULT_METHOD, tokenizer: Callable[[str], list[str]] = tokenize):
        self.tokenizer = tokenizer
        self.queries = [tokenizer(q) for q in queries]
        self.index = bm25s.BM25(k1=k1, b=b, method=method)
        self.index.index([tokenizer(d) for d in docs], show_progress=False)
        self.n_docs = len(docs)
        self._last: tuple[int, np.ndarray] | None = None  # callers ask for one query's docs in a row

    def search(self, depth: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        k = min(depth, self.n_docs)
        if not self.queries:  # bm25s cannot unpack an empty batch
            return {"bm25": (np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32))}
        found = self.index.retrieve(self.queries, k=k, show_progress=False, n_threads=1)
        return {"bm25": (np.asarray(found.documents, dtype=np.int64), np.asarray(found.scores, dtype=np.float32))}

    def scores(self, tokens: list[str]) -> np.ndarray:
        """Every document's score for one tokenized query (0 everywhere when no token is in the vocabulary).

        `get_scores` would index `tokens[0]` and fail on an empty query; going through the ids directly
        gives the same numbers otherwise.
        """
        return self.index.get_scores_from_ids(self.index.get_tokens_ids(tokens))

    def score(self, method: str, qi: int, docs) -> np.ndarray:
        if method != "bm25":
            raise ValueError(f"BM25 has only the 'bm25' scoring method, not {method!r}")
        if self._last is None or self._last[0] != qi:
            self._last = (qi, self.scores(self.queries[qi]))
        return self._last[1][np.asarray(docs, dtype=np.int64)]


class BM25Scorer:
    methods = ("bm25",)
    online_parameters = online_embedding_parameters = 0

    def __init__(self, k1: float = 1.5, b: float = 0.75, method: str = DEFAULT_METHOD,
                 tokenizer: str = DEFAULT_TOKENIZER, name: str = "bm25", label: str = "BM25 (bm25s + jieba)"):
        if method not in METHODS:
            raise ValueError(f"unknown bm25s method {method!r}: choose one of {', '.join(METHODS)}")
        self.tokenize = _tokenizer(tokenizer)
        self.k1, self.b, self.method, self.tokenizer, self.name, self.label = k1, b, method, tokenizer, name, label
        self._timed: BM25Prepared | None = None

    @property
    def fingerprint(self) -> str:
        settings = {"bm25s": bm25s.__version__, "jieba": jieba.__version__, "k1": self.k1, "b": self.b}
        # method and tokenizer enter only when not the defaults, so results recorded before they existed
        # keep a matching fingerprint
        if (self.method, self.tokenizer) != (DEFAULT_METHOD, DEFAULT_TOKENIZER):
            settings |= {"method": self.method, "tokenizer": self.tokenizer}
        return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    def _prepare(self, queries: Sequence[str], docs: Sequence[str]) -> BM25Prepared:
        return BM25Prepared(queries, docs, self.k1, self.b, method=self.method, tokenizer=self.tokenize)

    def prepare(self, queries: Sequence[str], docs: Sequence[str], doc_side: str = "document",
                cosine: bool = False, task: str | None = None) -> BM25Prepared:
        return self._prepare(queries, docs)

    # efficiency.py's hooks: indexing speed, and one query's segmentation + top-10 search on that index
    def time_documents(self, texts: Sequence[str]) -> float:
        start = time.perf_counter()
        self._timed = self._prepare([], texts)
        return time.perf_counter() - start

    def time_query(self, text: str) -> float:
        if self._timed is None:
            raise RuntimeError("call time_documents first: a BM25 query needs an index to search")
        start = time.perf_counter()
        self._timed.index.retrieve([self.tokenize(text)], k=min(10, self._timed.n_docs), show_progress=False,
                                   n_threads=1)
        return time.perf_counter() - start
