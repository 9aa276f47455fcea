"""Scores of inference embeddings (numpy), FlagEmbedding 1.4.2's definitions: the lexical match of two
sparse bags and the ColBERT mean-of-max.  The differentiable training versions live with the model
(care.models.m3)."""
from __future__ import annotations

import numpy as np

from care.encoders.base import Embeddings


def lexical_score(a: dict[int, float], b: dict[int, float]) -> float:
    return float(sum(w * b[t] for t, w in a.items() if t in b))


def colbert_score(q: np.ndarray, p: np.ndarray) -> float:
    return float((q @ p.T).max(axis=1).mean()) if len(q) else 0.0


def score_matrix(queries: Embeddings, docs: Embeddings, head: str) -> np.ndarray:
    """[n_queries, n_docs] scores of one head."""
    if head == "dense":
        return queries.dense @ docs.dense.T
    if head == "sparse":
        return np.array([[lexical_score(a, b) for b in docs.sparse] for a in queries.sparse], dtype=np.float64)
    if head == "colbert":
        return np.array([[colbert_score(a, b) for b in docs.colbert] for a in queries.colbert], dtype=np.float64)
    raise ValueError(f"unknown head '{head}' (choose dense, sparse or colbert)")
