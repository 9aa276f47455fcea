"""The MinHash recipe in plain Python, and the reference backend built on datasketch.

What the recipe is (minhash.py says why): a text's shingles are its character n-grams (`shingles`), each
hashed with xxh32 (HASHFUNC) into datasketch MinHash values with seed SEED and datasketch's permutations
(`signatures`), LSH banding, and every candidate checked by the exact Jaccard of the shingle sets
(`jaccard`).  These definitions are the ones every caller and both backends share.

The reference backend (`reference_pairs`, `backend="datasketch"`): one MinHash per text, datasketch's
MinHashLSH, Python set Jaccard.  It is the plain, obviously-right form: the fast backend
(minhash_numpy.py) must give exactly its pairs, Jaccard values and candidate count
(tests/test_minhash_numpy.py checks it), and bench/dedup_bench.py times one against the other.  No config
selects it for a stage run.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from datasketch import MinHash, MinHashLSH

from care.progress import progress

# The recipe's hash family and seed.  xxh32 instead of datasketch's default SHA-1 hashes the shingles
# ~1.8x faster (measured, 9.5K texts); conf/dedup/default.yaml's minhash.seed is this seed.
HASHFUNC = xxhash.xxh32_intdigest
SEED = 1


def shingles(text: str, n: int) -> set[str]:
    """Character n-grams; a text shorter than n is one shingle (itself); an empty text has none."""
    if len(text) <= n:
        return {text} if text else set()
    return {text[i:i + n] for i in range(len(text) - n + 1)}


def jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0  # two empty texts are the same text
    return len(a & b) / len(a | b)


@dataclass
class MinHashResult:
    rows: np.ndarray      # verified pairs: positions in the left list (in the input: i < j, self-join)
    cols: np.ndarray      # and in the right list
    sims: np.ndarray      # their exact Jaccard
    candidates: int       # pairs LSH proposed
    bands: int
    rows_per_band: int


def signatures(sets: Iterable[Iterable[str]], num_perm: int = 128, seed: int = SEED) -> Iterator[MinHash]:
    """The recipe's MinHash of each shingle set, lazily.  MinHash.generator reuses one hashing state for
    all sets (4-8x faster than one MinHash each)."""
    encoded = ([s.encode("utf-8") for s in shingle_set] for shingle_set in sets)
    return MinHash.generator(encoded, num_perm=num_perm, seed=seed, hashfunc=HASHFUNC)


def reference_pairs(left: Sequence[set], right: Sequence[set] | None, threshold: float, num_perm: int,
                    bands: int, rows_per_band: int, seed: int, show_progress: bool, desc: str) -> MinHashResult:
    """One MinHash per set, datasketch's MinHashLSH, Python set Jaccard; pairs sorted as the numpy
    backend sorts them.  right=None is the self-join of `left` (each pair once, i < j); otherwise `left`
    is indexed and `right` queried one set at a time."""
    lsh = MinHashLSH(num_perm=num_perm, params=(bands, rows_per_band))
    kept = []  # the self-join queries with the signatures it indexed
    with lsh.insertion_session() as session:
        for i, m in enumerate(progress(signatures(left, num_perm, seed), total=len(left), desc=f"{desc}: hash",
                                       enabled=show_progress, unit="text", mininterval=2)):
            session.insert(i, m, check_duplication=False)
            if right is None:
                kept.append(m)
    probes, other = (kept, left) if right is None else (signatures(right, num_perm, seed), right)
    found, candidates = [], 0
    for p, m in enumerate(progress(probes, total=len(other), desc=f"{desc}: verify", enabled=show_progress,
                                   unit="text", mininterval=2)):
        for q in lsh.query(m):
            if right is None and q <= p:
                continue  # each pair once
            i, j = (p, q) if right is None else (q, p)
            candidates += 1
            s = jaccard(left[i], other[j])
            if s >= threshold:
                found.append((i, j, s))
    found.sort()
    return MinHashResult(np.array([f[0] for f in found], dtype=np.int64),
                         np.array([f[1] for f in found], dtype=np.int64),
                         np.array([f[2] for f in found], dtype=np.float64), candidates, bands, rows_per_band)
