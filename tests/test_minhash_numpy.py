"""The numpy MinHash backend (data_pipeline/dedup/minhash_numpy.py, shingle_ids.py) against the datasketch
reference (minhash_reference.py) and brute force.

- shingle ids: exactly `shingles()` (one id per distinct string, both ways) and HASHFUNC of each string;
- the signature matrix: datasketch's own MinHash.bulk hash values, bit for bit;
- exact Jaccard of id sets: `jaccard()` on the strings, float for float;
- the pairs: the same verified (i, j, Jaccard) and candidate count as the datasketch backend (MinHash
  objects, MinHashLSH, Python sets), self-join and two-list join, on real texts with planted near
  duplicates, also when every band digest collides (the exact grouping fallback).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from datasketch import MinHash

from data_pipeline.dedup import minhash_numpy as numpy_backend
from data_pipeline.dedup.minhash import BACKENDS, minhash_pairs, similar_pairs
from data_pipeline.dedup.minhash_reference import HASHFUNC, SEED, jaccard, shingles
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.dedup.shingle_ids import factorize, shingle_ids_of_sets, shingle_ids_of_texts
from data_pipeline.planted import plant, shared_texts

# texts the real data may lack: empty (twice: a pair of Jaccard 1.0), shorter than n, astral and control
# characters, ASCII, repeats inside a text
EDGE = ["", "", "a", "ab", "病", "糖尿", "𠀀𠀁", "𠀀𠀁𠀂病", "a\x00b", "aaaa", "aaaaa", "hiv检测 123", "ab"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    sample = random.Random(7).sample(shared_texts(), 2500)
    rows, _ = plant(sample, n_exact=0, n_variant=0, n_near=700, ngram=2, near_range=(0.6, 1.0), seed=2)
    norm = Normalizer()
    return EDGE + [norm(r["text"]) for r in rows]


def grams_in_order(text: str, n: int) -> list[str]:
    """The n-grams of a text by position (what shingle_ids_of_texts lists per text), independently of shingles()."""
    if 0 < len(text) < n:
        return [text]
    return [text[i:i + n] for i in range(len(text) - n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shingle_ids_are_exact(texts, n):
    sh = shingle_ids_of_texts(texts, n)
    assert len(sh) == len(texts)
    id_of: dict[str, int] = {}
    string_of: dict[int, str] = {}
    for t, text in enumerate(texts):
        ids = sh.ids[sh.indptr[t]:sh.indptr[t + 1]].tolist()
        grams = grams_in_order(text, n)
        assert len(ids) == len(grams) and set(grams) == shingles(text, n)
        for g, i in zip(grams, ids):
            assert id_of.setdefault(g, i) == i and string_of.setdefault(i, g) == g  # a bijection
    assert sorted(string_of) == list(range(len(sh.hashes)))
    assert all(int(sh.hashes[i]) == HASHFUNC(g.encode("utf-8")) for i, g in string_of.items())


@pytest.mark.parametrize(("n", "num_perm", "seed"), [(1, 128, SEED), (2, 128, SEED), (3, 64, 5), (4, 128, SEED)])
def test_signature_matrix_is_datasketch_bulk(texts, n, num_perm, seed):
    """n = 4 goes through the string path (shingle_ids_of_sets); every path gives MinHash.bulk's values."""
    sets = [shingles(t, n) for t in texts]
    ref = MinHash.bulk([[s.encode("utf-8") for s in st] for st in sets], num_perm=num_perm, seed=seed,
                       hashfunc=HASHFUNC)
    ref = np.stack([m.hashvalues for m in ref], axis=1)
    for sh in (shingle_ids_of_texts(texts, n), shingle_ids_of_sets(sets)):
        sig = numpy_backend.signature_matrix(sh, num_perm, seed)
        assert sig.dtype == ref.dtype and np.array_equal(sig, ref)
    first_rows = numpy_backend.signature_matrix(shingle_ids_of_texts(texts, n), num_perm, seed, perms=10)
    assert np.array_equal(first_rows, ref[:10])


def test_block_sizes_do_not_matter(texts, monkeypatch):
    """Blocks smaller than one text (signatures) and than one pair (Jaccard counts) give the same values."""
    sh = shingle_ids_of_texts(texts[:600], 2)
    i, j = np.triu_indices(100, 1)
    sig, sims = numpy_backend.signature_matrix(sh), numpy_backend.exact_jaccard(sh, i, j)
    monkeypatch.setattr(numpy_backend, "_BLOCK", 7)
    monkeypatch.setattr(numpy_backend, "_VERIFY_BLOCK", 150)
    assert np.array_equal(numpy_backend.signature_matrix(sh), sig)
    assert np.array_equal(numpy_backend.exact_jaccard(sh, i, j), sims)


@pytest.mark.parametrize("high", [1 << 20, 1 << 62])  # packed sort, and the argsort when it cannot pack
def test_factorize_is_unique_inverse(high):
    values = np.random.default_rng(0).integers(0, high, 5000) // 7 * 7
    values[:50] = values[50:100]
    ids, first = factorize(values)
    uniq, inverse = np.unique(values, return_inverse=True)
    assert np.array_equal(ids, inverse.ravel()) and np.array_equal(values[first], uniq)


def test_exact_jaccard_is_set_jaccard(texts):
    small = EDGE + random.Random(3).sample(texts, 120)
    sh = shingle_ids_of_texts(small, 2)
    i, j = np.triu_indices(len(small), 1)
    got = numpy_backend.exact_jaccard(sh, i, j)
    want = [jaccard(shingles(small[a], 2), shingles(small[b], 2)) for a, b in zip(i.tolist(), j.tolist())]
    assert got.tolist() == want                      # the same floats, not approximately
    assert got[(i == 0) & (j == 1)].tolist() == [1.0]   # two empty texts


def as_dict(res) -> dict[tuple[int, int], float]:
    return {(a, b): s for a, b, s in zip(res.rows.tolist(), res.cols.tolist(), res.sims.tolist())}


def assert_same(fast, ref):
    assert fast.candidates == ref.candidates and (fast.bands, fast.rows_per_band) == (ref.bands, ref.rows_per_band)
    for name in ("rows", "cols", "sims"):
        assert np.array_equal(getattr(fast, name), getattr(ref, name)), name


@pytest.mark.parametrize(("ngram", "threshold", "target_recall"), [(2, 0.8, 0.95), (3, 0.6, 0.5)])
def test_self_join_equals_datasketch_backend(texts, ngram, threshold, target_recall):
    kw = {"ngram": ngram, "threshold": threshold, "target_recall": target_recall, "show_progress": False}
    fast, ref = minhash_pairs(texts, **kw), minhash_pairs(texts, **kw, backend="datasketch")
    assert_same(fast, ref)
    assert len(ref.sims) > 150 and ref.candidates > len(ref.sims)   # pairs, and candidates rejected
    assert (fast.rows < fast.cols).all() and (0, 1) in as_dict(fast)  # the two empty texts
    sets = [shingles(t, ngram) for t in texts]
    assert_same(similar_pairs(sets, None, threshold, target_recall=target_recall, show_progress=False), ref)


def test_two_list_join_equals_datasketch_backend_and_self_join(texts):
    sets = [shingles(t, 2) for t in texts]
    cut = 900
    left, right = sets[:cut], sets[cut:]
    fast = similar_pairs(left, right, 0.8, show_progress=False)
    ref = similar_pairs(left, right, 0.8, show_progress=False, backend="datasketch")
    assert_same(fast, ref)
    assert len(ref.sims) > 20
    both = as_dict(similar_pairs(sets, None, 0.8, show_progress=False))
    assert as_dict(fast) == {(a, b - cut): s for (a, b), s in both.items() if a < cut <= b}
    # the list order does not matter to the pairs found
    swapped = similar_pairs(right, left, 0.8, show_progress=False)
    assert as_dict(swapped) == {(b, a): s for (a, b), s in as_dict(fast).items()}


def test_band_digest_collisions_fall_back_to_exact_grouping(texts, monkeypatch):
    """Every band digest equal: each band is then grouped by its values, and nothing changes."""
    sets = [shingles(t, 2) for t in texts[:1500]]
    want_self = similar_pairs(sets, None, 0.8, show_progress=False)
    want_join = similar_pairs(sets[:500], sets[500:], 0.8, show_progress=False)
    monkeypatch.setattr(numpy_backend, "_band_key", lambda band: np.zeros(band.shape[1], dtype=np.uint64))
    assert_same(similar_pairs(sets, None, 0.8, show_progress=False), want_self)
    assert_same(similar_pairs(sets[:500], sets[500:], 0.8, show_progress=False), want_join)
    assert len(want_self.sims) > 50


def test_degenerate_inputs():
    for backend in BACKENDS:
        none = minhash_pairs([], 2, show_progress=False, backend=backend)
        assert none.candidates == 0 and len(none.rows) == len(none.cols) == len(none.sims) == 0
        assert similar_pairs([{"ab"}], [], show_progress=False, backend=backend).candidates == 0
        assert similar_pairs([], [{"ab"}], show_progress=False, backend=backend).candidates == 0
        assert similar_pairs([{"ab"}, {"ab"}], [], show_progress=False, backend=backend).candidates == 0
        assert similar_pairs([], [{"ab"}, {"ab"}], show_progress=False, backend=backend).candidates == 0
        empties = minhash_pairs(["", "", "", "x"], 2, show_progress=False, backend=backend)
        assert as_dict(empties) == {(0, 1): 1.0, (0, 2): 1.0, (1, 2): 1.0}
    with pytest.raises(ValueError, match="backend"):
        minhash_pairs(["ab"], backend="faiss")
