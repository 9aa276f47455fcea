"""The embedding cache: each text encoded once, bad chunks survived; the scorer on top (NaN never cached)."""
from __future__ import annotations

import numpy as np
import pytest
from _evaluation_helpers import FakeM3

from care.data.tasks import load_task
from care.encoders.cache import EmbeddingCache, list_hash, text_key
from care.evaluation.tasks import run_reranking
from care.retrieval.scorer import EncoderScorer

# ---- the embedding cache ---------------------------------------------------------------------------------

def test_cache_encodes_each_text_once_and_survives_bad_chunks(tmp_path, caplog):
    enc = FakeM3()
    cache = EmbeddingCache(tmp_path)
    heads = enc.heads

    def get(texts):
        return cache.get(enc.fingerprint, "document", heads, texts, lambda t: enc.encode_documents(t, heads=heads))

    texts = ["头痛", "发烧怎么办", "头痛", "糖尿病饮食"]
    first = get(texts)
    assert enc.encoded == 3  # the repeated text is encoded once
    direct = FakeM3().encode(texts, "document", 32, heads, False)
    np.testing.assert_array_equal(first.dense, direct.dense)
    for a, b in zip(first.sparse, direct.sparse):  # weights are stored as float32, as models give them
        assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), rtol=1e-6)
    for a, b in zip(first.colbert, direct.colbert):
        np.testing.assert_array_equal(a, b)

    again = get(["糖尿病饮食", "头痛"])  # a subset in another order: served from the chunk
    assert enc.encoded == 3
    np.testing.assert_array_equal(again.dense, direct.dense[[3, 0]])
    mixed = get(["新的文本", "发烧怎么办"])  # only the new text is encoded
    assert enc.encoded == 4 and len(list((tmp_path).rglob("*.npz"))) == 2
    np.testing.assert_array_equal(mixed.dense[1], direct.dense[1])
    assert cache.get(enc.fingerprint, "query", heads, ["头痛"], lambda t: enc.encode_queries(t, heads=heads))
    assert enc.encoded == 5  # the query side is a separate key

    # an encoder failing half way leaves no chunk behind
    chunks = set(tmp_path.rglob("*.npz"))
    with pytest.raises(RuntimeError):
        cache.get(enc.fingerprint, "document", heads, ["失败"], lambda t: (_ for _ in ()).throw(RuntimeError("boom")))
    assert set(tmp_path.rglob("*.npz")) == chunks and not list(tmp_path.rglob("*.tmp"))
    # a truncated chunk is ignored (with a warning) and its texts re-encoded
    victim = tmp_path / enc.fingerprint / "doc-dense+sparse+colbert" / f"{list_hash([text_key(t) for t in texts[:2] + texts[3:]])}.npz"
    victim.write_bytes(victim.read_bytes()[:40])
    before = enc.encoded
    fresh = EmbeddingCache(tmp_path)
    with caplog.at_level("WARNING"):
        out = fresh.get(enc.fingerprint, "document", heads, texts, lambda t: enc.encode_documents(t, heads=heads))
    assert "unreadable" in caplog.text and enc.encoded > before
    np.testing.assert_array_equal(out.dense, direct.dense)


def test_scorer_uses_cache_and_nan_stops_with_the_text(samples, tmp_path):
    data = load_task("reranking", samples["reranking"])
    enc = FakeM3()
    scorer = EncoderScorer(enc, EmbeddingCache(tmp_path), show_progress=False)
    first = run_reranking(data, scorer, ["map_cut_10"])
    n = enc.encoded
    assert run_reranking(data, scorer, ["map_cut_10"]) == first and enc.encoded == n

    bad_text = data.docs[next(iter(data.docs))]
    bad = EncoderScorer(FakeM3(nan_for=bad_text), EmbeddingCache(tmp_path / "nan"), show_progress=False)
    with pytest.raises(FloatingPointError, match="NaN") as err:
        run_reranking(data, bad, ["map_cut_10"])
    assert bad_text[:20] in str(err.value)
    assert not list((tmp_path / "nan").rglob("doc-*/*.npz"))  # NaN never reaches the cache
