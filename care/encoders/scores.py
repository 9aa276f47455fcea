"""Scores of inference embeddings (numpy), FlagEmbedding 1.4.2's definitions: the lexical match of two
sparse bags and the ColBERT mean-of-max.  The differentiable training versions are care/training/head_scores.py."""
from __future__ import annotations

import numpy as np


def lexical_score(a: dict[int, float], b: dict[int, float]) -> float:
    return float(sum(w * b[t] for t, w in a.items() if t in b))


def colbert_score(q: np.ndarray, p: np.ndarray) -> float:
    return float((q @ p.T).max(axis=1).mean()) if len(q) else 0.0
