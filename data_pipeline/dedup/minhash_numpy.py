"""The fast MinHash backend (`backend="numpy"`, the default): every text at once, in numpy.

It computes what the reference backend (minhash_reference.py: one MinHash per text, datasketch's
MinHashLSH, Python set Jaccard) computes, bit for bit: the same pairs, Jaccard values and candidate count
(tests/test_minhash_numpy.py).  The steps:
- shingles as integer ids, each distinct shingle hashed once (shingle_ids.py);
- the signature matrix with datasketch's own arithmetic (`datasketch.minhash._fmix`, then a * h + b in
  uint32 with the permutations of `MinHash(num_perm, seed)`), over every text in cache-sized blocks;
- LSH banding: texts with equal band values grouped by a sort;
- the exact Jaccard of every candidate, counted on sorted id arrays.
The datatrove engine's steps (data_pipeline/distributed/dedup_steps.py) call the same functions
(`signature_matrix`, `band_groups`, `group_pairs`, `exact_jaccard`) on a task's share of the texts.

Why not datasketch's MinHashLSH here: profiled (cProfile) on 80K distinct texts of the import store, its
per-text inserts and queries (a bytes key per band, Python sets per bucket and per query) took ~75% of the
stage, several times the hashing itself; bench/dedup_bench.py times both backends.  A pair shares a
MinHashLSH bucket exactly when the band's hash values are equal (it keys buckets by the values' bytes),
which is what the grouping here tests, so the candidate pairs are the same.
"""
from __future__ import annotations

import numpy as np
from datasketch import MinHash
from datasketch.minhash import _fmix

from care.progress import progress
from data_pipeline.dedup.minhash_reference import HASHFUNC, SEED, MinHashResult
from data_pipeline.dedup.shingle_ids import ShingleIds, concat_ranges, sorted_unique

_EMPTY = np.uint32(0xFFFFFFFF)  # datasketch's affine32 value of a MinHash that saw nothing
_BLOCK = 4096                   # shingle occurrences per block of the signature arithmetic (x 128 x 4 bytes
                                # = 2 MiB: stays in cache; 16x more was ~4x slower, measured)
_VERIFY_BLOCK = 1 << 22         # shingle ids compared per block of the exact-Jaccard count


def numpy_pairs(sh: ShingleIds, n_left: int | None, threshold: float, num_perm: int, bands: int, rows: int,
                seed: int, show_progress: bool, desc: str) -> MinHashResult:
    """Verified pairs of the texts in `sh`: n_left=None is the self-join (i < j); else the first n_left
    texts are the left list and the rest the right one, and right positions count from 0."""
    sig = signature_matrix(sh, num_perm, seed, bands * rows, show_progress, desc)
    i, j = _candidates(sig, bands, rows, n_left)
    sims = exact_jaccard(sh, i, j if n_left is None else j + n_left)
    ok = sims >= threshold
    return MinHashResult(i[ok], j[ok], sims[ok], len(i), bands, rows)


def signature_matrix(sh: ShingleIds, num_perm: int = 128, seed: int = SEED, perms: int | None = None,
                      show_progress: bool = False, desc: str = "minhash") -> np.ndarray:
    """(perms, texts) uint32: row k is datasketch's hashvalues[k] of every text, the values
    `signatures(...)` (MinHash.generator) gives, computed with datasketch's own pre-mix and permutations
    (scheme affine32) over all texts at once.  perms=None gives all num_perm rows; LSH needs only the
    first bands x rows.  Transposed (one row per permutation) because np.minimum.reduceat over short
    segments of a contiguous row is the fast direction (~2.5x the other, measured)."""
    perms = num_perm if perms is None else perms
    ref = MinHash(num_perm=num_perm, seed=seed, hashfunc=HASHFUNC)
    if ref.scheme != "affine32" or ref.hashvalues.dtype != np.uint32:
        raise RuntimeError(f"datasketch scheme {ref.scheme!r}: this module reproduces 'affine32' only")
    a = ref.permutations[0][:perms, None]
    b = ref.permutations[1][:perms, None]
    mixed = _fmix(sh.hashes.astype(np.uint32, copy=False), 32)
    sig = np.full((perms, len(sh)), _EMPTY, dtype=np.uint32)
    nonempty = np.flatnonzero(np.diff(sh.indptr) > 0)   # an empty set keeps the empty value
    if not len(nonempty):
        return sig
    # blocks of whole texts, about _BLOCK occurrences each (a longer text is a block of its own)
    ends = sh.indptr[nonempty + 1]
    cuts = np.unique(np.searchsorted(ends, np.arange(_BLOCK, int(ends[-1]), _BLOCK), side="right"))
    bounds = np.concatenate([[0], cuts[(cuts > 0) & (cuts < len(nonempty))], [len(nonempty)]])
    for c0, c1 in progress(zip(bounds[:-1].tolist(), bounds[1:].tolist()), total=len(bounds) - 1,
                           desc=f"{desc}: hash", enabled=show_progress, unit="block", mininterval=2):
        texts = nonempty[c0:c1]
        lo, hi = sh.indptr[texts[0]], sh.indptr[texts[-1] + 1]
        phv = a * mixed[sh.ids[lo:hi]][None, :]   # uint32 wraps: datasketch's a * h + b mod 2^32
        phv += b
        sig[:, texts] = np.minimum.reduceat(phv, sh.indptr[texts] - lo, axis=1)
    return sig


def _band_key(band: np.ndarray) -> np.ndarray:
    """A 64-bit digest of each column of a band's (rows, texts) values: only a sort key; equal digests are
    checked for equal values (`band_groups`)."""
    key = np.zeros(band.shape[1], dtype=np.uint64)
    for row in band:
        key ^= row
        key *= np.uint64(0x9E3779B97F4A7C15)
        key ^= key >> np.uint64(31)
    return key


def _sorted_groups(key: np.ndarray, side: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """An order of the columns by key, and whether each neighbour has its predecessor's key.  With `side`
    (0 left, 1 right) the side is the key's lowest bit, so left columns come first among equal keys."""
    if side is not None:
        key = (key << np.uint64(1)) | side
    order = np.argsort(key)   # not stable: the default sort is ~6x faster on 80K keys (measured)
    ordered = key[order] if side is None else key[order] >> np.uint64(1)
    return order, ordered[1:] == ordered[:-1]


def band_groups(band: np.ndarray, n_left: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Texts whose band values are all equal, as (order, starts, sizes): group g is
    order[starts[g]:starts[g] + sizes[g]], groups of two or more only; with n_left, a group's left columns
    (< n_left) come before its right ones.  Sorting by `_band_key` then comparing neighbours' values is
    exact: a digest collision shows as neighbours with one digest and different values, and then the band
    is grouped by its values themselves."""
    side = None if n_left is None else (np.arange(band.shape[1]) >= n_left).astype(np.uint64)
    order, same = _sorted_groups(_band_key(band), side)
    after = np.flatnonzero(same)   # neighbours with one digest (few): their values must be equal too
    if len(after) and (band[:, order[after]] != band[:, order[after + 1]]).any():
        # a digest collision: exact grouping (slower: sorts the rows' bytes)
        exact = np.unique(np.ascontiguousarray(band.T), axis=0, return_inverse=True)[1].ravel()
        order, same = _sorted_groups(exact.astype(np.uint64), side)
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    sizes = np.diff(np.concatenate([starts, [len(order)]]))
    keep = sizes > 1
    return order, starts[keep], sizes[keep]


def group_pairs(order: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair within each group of `band_groups` (each member with the members after it), as columns;
    also the datatrove engine's bucket step (data_pipeline/distributed/dedup_steps.py)."""
    pos = concat_ranges(starts, sizes)
    later = np.repeat(starts + sizes, sizes) - pos - 1
    return np.repeat(order[pos], later), order[concat_ranges(pos + 1, later)]


def _candidates(sig: np.ndarray, bands: int, rows: int, n_left: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Pairs sharing at least one band, each once, sorted.  n_left=None: a self-join over all columns of
    sig (i < j); else columns [0, n_left) are the left list and the rest the right: (left, right) pairs
    only, right positions counted from 0."""
    n = sig.shape[1]
    n_right = n if n_left is None else n - n_left
    if n_right == 0 or n_left == 0:  # no texts, or a join with an empty side: no pairs
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    codes = np.zeros(0, dtype=np.int64)   # candidate pairs as i * n_right + j
    for band in range(bands):
        order, starts, sizes = band_groups(sig[band * rows:(band + 1) * rows], n_left)
        if not len(starts):
            continue
        if n_left is None:
            a, b = group_pairs(order, starts, sizes)
            i, j = np.minimum(a, b), np.maximum(a, b)
        else:
            # left columns come first in each group: each right member pairs with them
            member = order[concat_ranges(starts, sizes)]
            lefts = np.add.reduceat((member < n_left).astype(np.int64), np.cumsum(sizes) - sizes)
            right = member >= n_left
            group_of = np.repeat(np.arange(len(starts)), sizes)[right]
            i = order[concat_ranges(starts[group_of], lefts[group_of])]
            j = np.repeat(member[right] - n_left, lefts[group_of])
        # merged band by band: memory stays at the distinct candidates plus one band's pairs, however many
        # bands a pair shares (near-identical texts share them all)
        codes = sorted_unique(np.concatenate([codes, i * n_right + j]))
    return codes // n_right, codes % n_right


def exact_jaccard(sh: ShingleIds, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Exact Jaccard of the id sets of texts i[k] and j[k] (positions in sh): the candidates' texts'
    distinct ids sorted once, then |A & B| by binary search of A's (pair, id) keys among B's.  Equal to
    `jaccard` on the strings: ids are exact and the division is the same float64 division."""
    if not len(i):
        return np.zeros(0, dtype=np.float64)
    texts = sorted_unique(np.concatenate([i, j]))
    counts = sh.indptr[texts + 1] - sh.indptr[texts]
    vocab = max(len(sh.hashes), 1)
    local = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
    key = sorted_unique(local * vocab + sh.ids[concat_ranges(sh.indptr[texts], counts)])  # (text, id), deduped
    ids = key % vocab
    size = np.bincount(key // vocab, minlength=len(texts))
    indptr = np.concatenate([[0], np.cumsum(size)])
    at = np.zeros(len(sh), dtype=np.int64)
    at[texts] = np.arange(len(texts))
    li, lj = at[i], at[j]
    sims = np.empty(len(i), dtype=np.float64)
    work = np.cumsum(size[li] + size[lj])
    bounds = np.unique(np.concatenate([[0], np.searchsorted(work, np.arange(_VERIFY_BLOCK, int(work[-1]),
                                                                            _VERIFY_BLOCK)), [len(i)]]))
    for p0, p1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        a, b = li[p0:p1], lj[p0:p1]
        pairs = np.arange(p1 - p0, dtype=np.int64)
        ka = np.repeat(pairs, size[a]) * vocab + ids[concat_ranges(indptr[a], size[a])]
        kb = np.repeat(pairs, size[b]) * vocab + ids[concat_ranges(indptr[b], size[b])]  # sorted: pair, then id
        at = np.minimum(np.searchsorted(kb, ka), max(len(kb) - 1, 0))
        hit = kb[at] == ka if len(kb) else np.zeros(len(ka), dtype=bool)
        inter = np.bincount(ka[hit] // vocab, minlength=p1 - p0)
        union = size[a] + size[b] - inter
        sims[p0:p1] = np.where(union == 0, 1.0, inter / np.maximum(union, 1))  # two empty sets: 1.0
    return sims
