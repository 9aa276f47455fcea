"""The approximate indexes a stage can choose (care.retrieval.index.build_index) answer the same calls as
the flat one, find nearly what exact search finds, and the cache's lookup returns stored vectors only."""
from __future__ import annotations

import numpy as np
import pytest

from care.encoders.base import Embeddings
from care.encoders.cache import EmbeddingCache
from care.retrieval.index import INDEX_KINDS, build_index, flat_index


@pytest.fixture(scope="module")
def clustered():
    """Unit vectors around 40 centres (the shape text embeddings have), and queries near them."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, 48)).astype(np.float32)
    x = centres[rng.integers(0, 40, 6000)] + 0.35 * rng.standard_normal((6000, 48)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, x[rng.choice(6000, 200, replace=False)]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_indexes_agree_with_exact_search(clustered, kind):
    x, q = clustered
    truth_scores, truth = flat_index(x).search(q, 50)
    scores, found = build_index(x, kind, nprobe=16).search(q, 50)
    recall = np.mean([len(set(a) & set(b)) / 50 for a, b in zip(found, truth)])
    assert recall > 0.9, recall
    assert np.all(scores[:, 0] <= truth_scores[:, 0] + 1e-5)  # never better than exact
    lims, d, _ = build_index(x, kind).range_search(q[:5], 0.9)  # the dedup stage's call
    assert len(lims) == 6 and np.all(d > 0.9)


def test_flat_is_exact_and_an_unknown_kind_is_named(clustered):
    x, q = clustered
    s, _ = build_index(x, "flat").search(q[:3], 5)
    np.testing.assert_allclose(s, np.sort(q[:3] @ x.T, axis=1)[:, ::-1][:, :5], rtol=1e-5)
    assert set(INDEX_KINDS) == {"flat", "ivf", "hnsw"}
    with pytest.raises(ValueError, match="flat, ivf, hnsw"):
        build_index(x, "lsh")


def test_cache_lookup_returns_only_what_is_stored(tmp_path):
    cache = EmbeddingCache(tmp_path)
    texts = ["头痛", "发烧", "咳嗽"]
    vectors = np.arange(6, dtype=np.float32).reshape(3, 2)
    cache.get("fp", "document", ("dense",), texts[:2], lambda todo: Embeddings(dense=vectors[:len(todo)]))
    found, dense = cache.lookup("fp", "document", ("dense",), ["咳嗽", "发烧", "头痛", "发烧"])
    assert found.tolist() == [False, True, True, True]
    np.testing.assert_array_equal(dense, vectors[[1, 0, 1]])
    none, empty = cache.lookup("other", "document", ("dense",), texts)
    assert not none.any() and len(empty) == 0
