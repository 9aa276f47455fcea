"""Regression: text keys ending in a NUL byte must survive the round trip through a cache chunk
(numpy's "S16" strips trailing NULs, which made ~1 text in 256 a permanent cache miss)."""
from __future__ import annotations

import numpy as np

from care.encoders import Embeddings
from care.encoders.cache import EmbeddingCache, text_key


def test_keys_with_trailing_nul_are_found_again(tmp_path):
    texts = [f"头痛第{i}天" for i in range(3000)]
    nul_texts = [t for t in texts if text_key(t).endswith(b"\x00")]
    assert nul_texts, "no text with a NUL-terminated key in the sample"
    sample = nul_texts[:3] + texts[:5]
    calls = []

    def encode(batch):
        calls.append(list(batch))
        return Embeddings(dense=np.arange(len(batch) * 4, dtype=np.float32).reshape(len(batch), 4))

    cache = EmbeddingCache(tmp_path)
    first = cache.get("fp", "document", ["dense"], sample, encode)
    # a different list (forces the per-text lookup across chunks, not the whole-list shortcut)
    second = cache.get("fp", "document", ["dense"], sample[::-1], encode)
    assert len(calls) == 1, f"re-encoded {calls[1:]}"
    np.testing.assert_array_equal(second.dense, first.dense[::-1])
