"""The embedding cache's digests: a chunk whose keys are intact but whose vectors (or ColBERT / sparse
payloads) are damaged is reported, ignored and encoded again, and the chunk is rewritten on disk; a chunk
written before digests is verified once by its zip CRC-32 and given digests; a truncated one is ignored."""
from __future__ import annotations

import zipfile

import numpy as np
import pytest
from _evaluation_helpers import FakeM3

from care.encoders.cache import EmbeddingCache, list_hash, text_key
from care.encoders.cache_chunks import DIGESTS, _mismatch

TEXTS = ["头痛", "发烧怎么办", "头痛", "糖尿病饮食", "咳嗽有痰怎么办"]
HEADS = FakeM3.heads


def get(cache, enc, texts):
    return cache.get(enc.fingerprint, "document", HEADS, texts, lambda t: enc.encode_documents(t, heads=HEADS))


def chunk_of(root, enc, texts):
    return EmbeddingCache(root).chunk_path(enc.fingerprint, "document", HEADS, texts)


def arrays(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def flip_bytes(path, member):
    """Flip the last bytes of one array's data inside the file (its zip CRC no longer matches), keys untouched."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"{member}.npy")
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    end = info.header_offset + 30 + name_len + extra_len + info.compress_size
    for i in range(end - 4, end - 1):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


def rewrite_changed(path, member):
    """A well-formed zip (CRCs right) whose array differs from what its digest records."""
    a = arrays(path)
    a[member] = a[member].copy()
    a[member].reshape(-1)[-1] += 1
    with open(path, "wb") as fh:
        np.savez(fh, **a)


def assert_same(out, clean):
    np.testing.assert_array_equal(out.dense, clean.dense)
    for x, y in zip(out.colbert, clean.colbert):
        np.testing.assert_array_equal(x, y)
    assert out.sparse == clean.sparse


def assert_sound(path):
    a = arrays(path)
    assert DIGESTS in a and _mismatch({k: v for k, v in a.items() if k != DIGESTS}, a[DIGESTS], complete=True) is None


@pytest.mark.parametrize("member", ["dense", "colbert", "sparse_values"])
@pytest.mark.parametrize("damage", [flip_bytes, rewrite_changed], ids=["bytes", "digest"])
def test_damaged_vectors_under_intact_keys_are_reported_re_encoded_and_repaired(tmp_path, caplog, damage, member):
    enc = FakeM3()
    clean = get(EmbeddingCache(tmp_path / "clean"), FakeM3(), TEXTS)
    get(EmbeddingCache(tmp_path), enc, TEXTS)
    path = chunk_of(tmp_path, enc, TEXTS)
    before = arrays(path)
    damage(path, member)
    with np.load(path) as z:  # the keys still read (and match the texts)
        assert [bytes(k) for k in z["keys"]] == list(dict.fromkeys(text_key(t) for t in TEXTS))

    cache, n = EmbeddingCache(tmp_path), enc.encoded
    with caplog.at_level("WARNING"):
        out = get(cache, enc, TEXTS)  # once raised "became unreadable during the run"
    assert enc.encoded - n == len(set(TEXTS))  # every text of the damaged chunk encoded again
    assert_same(out, clean)
    warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warnings) == 1 and (member in warnings[0] or "CRC" in warnings[0]), caplog.text
    assert cache.damaged == [] and not list(tmp_path.rglob("*.damaged"))  # repaired in place, not moved aside
    after = arrays(path)
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    assert_sound(path)
    n = enc.encoded
    assert_same(get(EmbeddingCache(tmp_path), enc, TEXTS), clean) and enc.encoded == n


def test_a_damaged_chunk_serving_part_of_a_request_is_moved_aside(tmp_path, caplog):
    enc = FakeM3()
    cache = EmbeddingCache(tmp_path)
    get(cache, enc, TEXTS)
    path = chunk_of(tmp_path, enc, TEXTS)
    flip_bytes(path, "dense")
    fresh, n = EmbeddingCache(tmp_path), enc.encoded
    with caplog.at_level("WARNING"):
        out = get(fresh, enc, ["糖尿病饮食", "新的文本"])  # the chunk's other texts are not in the request
    assert enc.encoded - n == 2 and str(path) in caplog.text
    np.testing.assert_array_equal(out.dense, FakeM3().encode(["糖尿病饮食", "新的文本"], "document", 8, HEADS, False).dense)
    assert not path.exists() and path.with_name(path.name + ".damaged").exists()
    n = enc.encoded  # its other texts are encoded again on demand; what was stored just now is not
    out = get(EmbeddingCache(tmp_path), enc, TEXTS)
    assert enc.encoded - n == len(set(TEXTS)) - 1
    np.testing.assert_array_equal(out.dense, FakeM3().encode(TEXTS, "document", 8, HEADS, False).dense)


def test_lookup_and_chunk_state_ignore_a_damaged_chunk(tmp_path, caplog):
    enc = FakeM3()
    get(EmbeddingCache(tmp_path), enc, TEXTS)
    path = chunk_of(tmp_path, enc, TEXTS)
    cache = EmbeddingCache(tmp_path)
    assert cache.chunk_state(enc.fingerprint, "document", HEADS, TEXTS) == "ok"
    rewrite_changed(path, "dense")
    cache = EmbeddingCache(tmp_path)
    with caplog.at_level("WARNING"):
        assert cache.chunk_state(enc.fingerprint, "document", HEADS, TEXTS) == "damaged"
        assert not cache.has_chunk(enc.fingerprint, "document", HEADS, TEXTS)
        found, vectors = cache.lookup(enc.fingerprint, "document", HEADS, TEXTS)
    assert not found.any() and len(vectors) == 0
    assert caplog.text.count(str(path)) == 1 and "'dense' does not match" in caplog.text  # warned once


def test_a_chunk_written_before_digests_is_verified_once_and_given_digests(tmp_path, caplog):
    enc = FakeM3()
    clean = get(EmbeddingCache(tmp_path), enc, TEXTS)
    path = chunk_of(tmp_path, enc, TEXTS)
    legacy = {k: v for k, v in arrays(path).items() if k != DIGESTS}
    with open(path, "wb") as fh:
        np.savez(fh, **legacy)
    n = enc.encoded
    assert_same(get(EmbeddingCache(tmp_path), enc, TEXTS), clean) and enc.encoded == n  # trusted: CRC-32 passed
    upgraded = arrays(path)
    assert DIGESTS in upgraded and all(np.array_equal(upgraded[k], legacy[k]) for k in legacy)
    assert_sound(path)

    # an old chunk that fails its zip CRC-32 is damaged like any other: re-encoded, rewritten with digests
    with open(path, "wb") as fh:
        np.savez(fh, **legacy)
    flip_bytes(path, "dense")
    with caplog.at_level("WARNING"):
        out = get(EmbeddingCache(tmp_path), enc, TEXTS)
    assert enc.encoded - n == len(set(TEXTS)) and "CRC" in caplog.text and str(path) in caplog.text
    assert_same(out, clean)
    assert_sound(path)


def test_a_truncated_chunk_is_still_reported_and_ignored(tmp_path, caplog):
    enc = FakeM3()
    clean = get(EmbeddingCache(tmp_path), enc, TEXTS)
    path = chunk_of(tmp_path, enc, TEXTS)
    path.write_bytes(path.read_bytes()[:100])
    cache, n = EmbeddingCache(tmp_path), enc.encoded
    with caplog.at_level("WARNING"):
        assert cache.chunk_state(enc.fingerprint, "document", HEADS, TEXTS) == "damaged"
        out = get(cache, enc, TEXTS)
    assert "unreadable" in caplog.text and caplog.text.count(str(path)) == 1
    assert enc.encoded - n == len(set(TEXTS))
    assert_same(out, clean)
    assert path.name == f"{list_hash(list(dict.fromkeys(text_key(t) for t in TEXTS)))}.npz"
    assert_sound(path)  # rewritten whole under its name: keys unreadable, so the request's own list names it
