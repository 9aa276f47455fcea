"""Shingle sets as integer ids, built for all texts at once: the input of the numpy MinHash backend.

The numpy backend (minhash_numpy.py) never builds a Python set per text.  Every distinct shingle gets an
integer id and is hashed once with the recipe's HASHFUNC (minhash_reference.py); a text is then the run of
its shingles' ids (`ShingleIds`).  Equal ids mean equal strings, so nothing is approximated: the signature
and the exact Jaccard computed on ids are the ones the reference computes on strings
(tests/test_minhash_numpy.py checks both, id for string).

Also here: the sort-based array helpers both numpy modules use (`concat_ranges`, `sorted_unique`,
`factorize`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from data_pipeline.dedup.minhash_reference import HASHFUNC, shingles

_MAX_CODE_POINT = 0x10FFFF
_MAX_PACKED = 3                 # an int64 holds any character trigram exactly (see shingle_ids_of_texts)


@dataclass
class ShingleIds:
    """Shingle sets as integer ids: text t's occurrences are ids[indptr[t]:indptr[t + 1]] (a shingle may
    repeat within a text; the signature's minimum does not care, the Jaccard count dedupes).  Two ids are
    equal exactly when their shingle strings are, so the Jaccard counted on ids is the exact one."""
    indptr: np.ndarray    # (texts + 1,) int64
    ids: np.ndarray       # (occurrences,) int64 in [0, len(hashes))
    hashes: np.ndarray    # (distinct shingles,) uint32: HASHFUNC of the shingle's UTF-8 bytes

    def __len__(self) -> int:
        return len(self.indptr) - 1


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated np.arange(s, s + c) for each (s, c), without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - before, counts)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for int arrays by a plain sort: numpy 2.4's np.unique (hash based) took ~10x the
    sort on 1.4M shingle codes (measured)."""
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]


def factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each value's index among the distinct values, one position of each distinct value), for int64
    values >= 0.  Where value and position fit one int64 together they are sorted as one number: numpy
    sorts int64 arrays ~10x faster than it argsorts them (measured, 1.4M shingle codes)."""
    n = len(values)
    ids = np.empty(n, dtype=np.int64)
    if n == 0:
        return ids, ids.copy()
    shift = max(n - 1, 1).bit_length()
    if int(values.max()).bit_length() + shift <= 63:
        packed = np.sort((values << shift) | np.arange(n, dtype=np.int64))
        order, ordered = packed & ((1 << shift) - 1), packed >> shift
    else:
        order = np.argsort(values)
        ordered = values[order]
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    ids[order] = np.cumsum(new) - 1
    return ids, order[new]


def shingle_ids_of_sets(sets: Sequence[Iterable[str]]) -> ShingleIds:
    """Given shingle sets (strings): one id per distinct string (a dict), each hashed once."""
    vocab: dict[str, int] = {}
    ids = np.fromiter((vocab.setdefault(s, len(vocab)) for st in sets for s in st), dtype=np.int64)
    sizes = np.fromiter((len(st) for st in sets), dtype=np.int64, count=len(sets))
    hashes = np.fromiter((HASHFUNC(s.encode("utf-8")) for s in vocab), dtype=np.uint32, count=len(vocab))
    return ShingleIds(np.concatenate([[0], np.cumsum(sizes)]), ids, hashes)


def shingle_ids_of_texts(texts: Sequence[str], n: int) -> ShingleIds:
    """`shingles(t, n)` of every text as ids, vectorised.  The texts' code points go into one array and are
    renumbered densely (0..C-1 over the characters present, C pads a text shorter than n); an n-gram is then
    the base-(C + 1) number of its characters, so equal numbers are equal strings, and `factorize` numbers
    the distinct ones.  Each distinct shingle is sliced from the texts once and hashed with HASHFUNC itself
    (no re-implemented hash).  n > 3 may overflow 64 bits and goes through the strings
    (`shingle_ids_of_sets`)."""
    if not 1 <= n <= _MAX_PACKED:
        return shingle_ids_of_sets([shingles(t, n) for t in texts])
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    joined = "".join(texts)
    cps = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    chars = sorted_unique(cps)
    dense = np.zeros(_MAX_CODE_POINT + 1, dtype=np.int64)
    dense[chars] = np.arange(len(chars))
    base = len(chars) + 1       # (C + 1)^3 <= (0x110000 + 1)^3 < 2^63
    pad = len(chars)
    total = len(cps)
    padded = np.concatenate([dense[cps], np.full(n - 1, pad, dtype=np.int64)])
    codes = padded[:total].copy()
    for k in range(1, n):
        codes *= base
        codes += padded[k:k + total]
    starts = np.cumsum(lens) - lens
    short = np.flatnonzero((lens > 0) & (lens < n))
    if len(short):  # their one shingle is the whole text: pad it instead of running into the next text
        code = np.zeros(len(short), dtype=np.int64)
        for k in range(n):
            code = code * base + np.where(k < lens[short], padded[starts[short] + k], pad)
        codes[starts[short]] = code
    # occurrences per text: its n-grams; a text shorter than n is one shingle, an empty one none
    count = np.where(lens >= n, lens - n + 1, (lens > 0).astype(np.int64))
    where = concat_ranges(starts, count)
    ids, first = factorize(codes[where])
    width = np.minimum(np.repeat(lens, count)[first], n)
    hashes = np.fromiter((HASHFUNC(joined[p:p + w].encode("utf-8"))
                          for p, w in zip(where[first].tolist(), width.tolist())), dtype=np.uint32, count=len(first))
    return ShingleIds(np.concatenate([[0], np.cumsum(count)]), ids, hashes)
