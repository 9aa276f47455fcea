"""Stage 2: near duplicates by MinHash LSH (datasketch's hashing), every candidate verified by exact Jaccard.

Chinese has no spaces, so a text's shingles are its overlapping character n-grams (of the normalised
text).  LSH with b bands of r rows makes a pair of Jaccard s a candidate with probability
P(s) = 1 - (1 - s^r)^b (the S-curve).  datasketch's own choice for threshold 0.8 (9 x 13) catches a pair
at exactly 0.8 only ~40% of the time, so we pick (b, r) ourselves: the largest r (fewest spurious
candidates) whose curve still reaches `target_recall` at the threshold.  Candidates are then checked
against the exact Jaccard of the shingle sets, so every merge is a true >= threshold pair (precision 1.0).

One recipe, used by the dedup stage (`minhash_pairs`, a self-join) and by the build stage's leakage rule
(`similar_pairs(eval_sets, training_sets)`, a join of two lists): `shingles`, datasketch MinHash values
(xxh32 shingle hash HASHFUNC, seed SEED, datasketch's permutations), `choose_bands_rows`, LSH banding,
exact `jaccard`.  Whether a pair becomes a candidate depends only on its two signatures and the banding,
so a join finds exactly the pairs the self-join over both lists finds between them.

Two backends compute the same result.
- "numpy" (the default): all texts at once.  Shingles become integer ids (equal ids <=> equal strings, so
  nothing is approximated), each distinct shingle is hashed once with HASHFUNC, the signature matrix is
  datasketch's own arithmetic (`datasketch.minhash._fmix`, then a * h + b in uint32 with the permutations
  of `MinHash(num_perm, seed)`) over every text in cache-sized blocks, banding groups equal band values with
  a sort, and the exact Jaccard of every candidate is counted on sorted id arrays.
- "datasketch": one MinHash per text from `MinHash.generator`, datasketch's MinHashLSH, Python set Jaccard:
  the reference the numpy backend is tested against (tests/test_minhash_numpy.py) and timed against
  (bench/dedup_bench.py).
Why not datasketch's MinHashLSH in the fast path: profiled (cProfile) on 80K distinct texts of the import
store, its per-text inserts and queries (a bytes key per band, Python sets per bucket and per query) took
~75% of the stage, several times the hashing itself; bench/dedup_bench.py times both backends.  A pair shares a MinHashLSH bucket exactly when the band's hash values
are equal (it keys buckets by the values' bytes), which is what the grouping here tests, so the candidate
pairs are the same.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from datasketch import MinHash, MinHashLSH
from datasketch.minhash import _fmix
from tqdm.auto import tqdm

# The recipe's hash family and seed.  xxh32 instead of datasketch's default SHA-1 hashes the shingles
# ~1.8x faster (measured, 9.5K texts); conf/pipeline/dedup.yaml's minhash.seed is this seed.
HASHFUNC = xxhash.xxh32_intdigest
SEED = 1
BACKENDS = ("numpy", "datasketch")

_EMPTY = np.uint32(0xFFFFFFFF)  # datasketch's affine32 value of a MinHash that saw nothing
_MAX_CODE_POINT = 0x10FFFF
_MAX_PACKED = 3                 # an int64 holds any character trigram exactly (see _shingle_texts)
_BLOCK = 4096                   # shingle occurrences per block of the signature arithmetic (x 128 x 4 bytes
                                # = 2 MiB: stays in cache; 16x more was ~4x slower, measured)
_VERIFY_BLOCK = 1 << 22         # shingle ids compared per block of the exact-Jaccard count


def shingles(text: str, n: int) -> set[str]:
    """Character n-grams; a text shorter than n is one shingle (itself); an empty text has none."""
    if len(text) <= n:
        return {text} if text else set()
    return {text[i:i + n] for i in range(len(text) - n + 1)}


def jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0  # two empty texts are the same text
    return len(a & b) / len(a | b)


def s_curve(s, bands: int, rows: int):
    """Probability that a pair of Jaccard s shares at least one LSH band."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def choose_bands_rows(threshold: float, num_perm: int, target_recall: float) -> tuple[int, int]:
    """The largest rows-per-band r (with b = num_perm // r bands) whose S-curve reaches target_recall
    at the threshold.  r = 1 always qualifies, so this never fails."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if s_curve(threshold, bands, rows) >= target_recall:
            return bands, rows
    raise AssertionError("unreachable: rows=1 gives P >= 1 - (1-threshold)^num_perm")


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


# ---- the numpy backend --------------------------------------------------------------------------------

@dataclass
class _Shingled:
    """Shingle sets as integer ids: text t's occurrences are ids[indptr[t]:indptr[t + 1]] (a shingle may
    repeat within a text; the signature's minimum does not care, the Jaccard count dedupes).  Two ids are
    equal exactly when their shingle strings are, so the Jaccard counted on ids is the exact one."""
    indptr: np.ndarray    # (texts + 1,) int64
    ids: np.ndarray       # (occurrences,) int64 in [0, len(hashes))
    hashes: np.ndarray    # (distinct shingles,) uint32: HASHFUNC of the shingle's UTF-8 bytes

    def __len__(self) -> int:
        return len(self.indptr) - 1


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated np.arange(s, s + c) for each (s, c), without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - before, counts)


def _unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for int arrays by a plain sort: numpy 2.4's np.unique (hash based) took ~10x the
    sort on 1.4M shingle codes (measured)."""
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]


def _factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _shingle_sets(sets: Sequence[Iterable[str]]) -> _Shingled:
    """Given shingle sets (strings): one id per distinct string (a dict), each hashed once."""
    vocab: dict[str, int] = {}
    ids = np.fromiter((vocab.setdefault(s, len(vocab)) for st in sets for s in st), dtype=np.int64)
    sizes = np.fromiter((len(st) for st in sets), dtype=np.int64, count=len(sets))
    hashes = np.fromiter((HASHFUNC(s.encode("utf-8")) for s in vocab), dtype=np.uint32, count=len(vocab))
    return _Shingled(np.concatenate([[0], np.cumsum(sizes)]), ids, hashes)


def _shingle_texts(texts: Sequence[str], n: int) -> _Shingled:
    """`shingles(t, n)` of every text as ids, vectorised.  The texts' code points go into one array and are
    renumbered densely (0..C-1 over the characters present, C pads a text shorter than n); an n-gram is then
    the base-(C + 1) number of its characters, so equal numbers are equal strings, and `_factorize` numbers
    the distinct ones.  Each distinct shingle is sliced from the texts once and hashed with HASHFUNC itself
    (no re-implemented hash).  n > 3 may overflow 64 bits and goes through the strings (`_shingle_sets`)."""
    if not 1 <= n <= _MAX_PACKED:
        return _shingle_sets([shingles(t, n) for t in texts])
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    joined = "".join(texts)
    cps = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    chars = _unique(cps)
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
    where = _ranges(starts, count)
    ids, first = _factorize(codes[where])
    width = np.minimum(np.repeat(lens, count)[first], n)
    hashes = np.fromiter((HASHFUNC(joined[p:p + w].encode("utf-8"))
                          for p, w in zip(where[first].tolist(), width.tolist())), dtype=np.uint32, count=len(first))
    return _Shingled(np.concatenate([[0], np.cumsum(count)]), ids, hashes)


def _signature_matrix(sh: _Shingled, num_perm: int = 128, seed: int = SEED, perms: int | None = None,
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
    for c0, c1 in tqdm(zip(bounds[:-1].tolist(), bounds[1:].tolist()), total=len(bounds) - 1,
                       desc=f"{desc}: hash", disable=not show_progress, unit="block", mininterval=2):
        texts = nonempty[c0:c1]
        lo, hi = sh.indptr[texts[0]], sh.indptr[texts[-1] + 1]
        phv = a * mixed[sh.ids[lo:hi]][None, :]   # uint32 wraps: datasketch's a * h + b mod 2^32
        phv += b
        sig[:, texts] = np.minimum.reduceat(phv, sh.indptr[texts] - lo, axis=1)
    return sig


def _band_key(band: np.ndarray) -> np.ndarray:
    """A 64-bit digest of each column of a band's (rows, texts) values: only a sort key; equal digests are
    checked for equal values (`_band_groups`)."""
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


def _band_groups(band: np.ndarray, n_left: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        order, starts, sizes = _band_groups(sig[band * rows:(band + 1) * rows], n_left)
        if not len(starts):
            continue
        if n_left is None:
            # each member pairs with the members after it in its group
            pos = _ranges(starts, sizes)
            later = np.repeat(starts + sizes, sizes) - pos - 1
            a = np.repeat(order[pos], later)
            b = order[_ranges(pos + 1, later)]
            i, j = np.minimum(a, b), np.maximum(a, b)
        else:
            # left columns come first in each group: each right member pairs with them
            member = order[_ranges(starts, sizes)]
            lefts = np.add.reduceat((member < n_left).astype(np.int64), np.cumsum(sizes) - sizes)
            right = member >= n_left
            group_of = np.repeat(np.arange(len(starts)), sizes)[right]
            i = order[_ranges(starts[group_of], lefts[group_of])]
            j = np.repeat(member[right] - n_left, lefts[group_of])
        # merged band by band: memory stays at the distinct candidates plus one band's pairs, however many
        # bands a pair shares (near-identical texts share them all)
        codes = _unique(np.concatenate([codes, i * n_right + j]))
    return codes // n_right, codes % n_right


def _exact_jaccard(sh: _Shingled, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Exact Jaccard of the id sets of texts i[k] and j[k] (positions in sh): the candidates' texts'
    distinct ids sorted once, then |A & B| by binary search of A's (pair, id) keys among B's.  Equal to
    `jaccard` on the strings: ids are exact and the division is the same float64 division."""
    if not len(i):
        return np.zeros(0, dtype=np.float64)
    texts = _unique(np.concatenate([i, j]))
    counts = sh.indptr[texts + 1] - sh.indptr[texts]
    vocab = max(len(sh.hashes), 1)
    local = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
    key = _unique(local * vocab + sh.ids[_ranges(sh.indptr[texts], counts)])  # (text, id), deduped
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
        ka = np.repeat(pairs, size[a]) * vocab + ids[_ranges(indptr[a], size[a])]
        kb = np.repeat(pairs, size[b]) * vocab + ids[_ranges(indptr[b], size[b])]  # sorted: pair, then id
        at = np.minimum(np.searchsorted(kb, ka), max(len(kb) - 1, 0))
        hit = kb[at] == ka if len(kb) else np.zeros(len(ka), dtype=bool)
        inter = np.bincount(ka[hit] // vocab, minlength=p1 - p0)
        union = size[a] + size[b] - inter
        sims[p0:p1] = np.where(union == 0, 1.0, inter / np.maximum(union, 1))  # two empty sets: 1.0
    return sims


def _pairs_numpy(sh: _Shingled, n_left: int | None, threshold: float, num_perm: int, bands: int, rows: int,
                 seed: int, show_progress: bool, desc: str) -> MinHashResult:
    sig = _signature_matrix(sh, num_perm, seed, bands * rows, show_progress, desc)
    i, j = _candidates(sig, bands, rows, n_left)
    sims = _exact_jaccard(sh, i, j if n_left is None else j + n_left)
    ok = sims >= threshold
    return MinHashResult(i[ok], j[ok], sims[ok], len(i), bands, rows)


# ---- the datasketch backend (the reference) -------------------------------------------------------------

def _pairs_datasketch(left: Sequence[set], right: Sequence[set] | None, threshold: float, num_perm: int,
                      bands: int, rows_per_band: int, seed: int, show_progress: bool, desc: str) -> MinHashResult:
    """One MinHash per set, datasketch's MinHashLSH, Python set Jaccard; pairs sorted as the numpy
    backend sorts them."""
    lsh = MinHashLSH(num_perm=num_perm, params=(bands, rows_per_band))
    kept = []  # the self-join queries with the signatures it indexed
    with lsh.insertion_session() as session:
        for i, m in enumerate(tqdm(signatures(left, num_perm, seed), total=len(left), desc=f"{desc}: hash",
                                   disable=not show_progress, unit="text", mininterval=2)):
            session.insert(i, m, check_duplication=False)
            if right is None:
                kept.append(m)
    probes, other = (kept, left) if right is None else (signatures(right, num_perm, seed), right)
    found, candidates = [], 0
    for p, m in enumerate(tqdm(probes, total=len(other), desc=f"{desc}: verify", disable=not show_progress,
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


# ---- the recipe ---------------------------------------------------------------------------------------

def similar_pairs(left: Sequence[set], right: Sequence[set] | None = None, threshold: float = 0.8,
                  num_perm: int = 128, target_recall: float = 0.95, seed: int = SEED,
                  show_progress: bool = True, desc: str = "minhash", *, backend: str = "numpy") -> MinHashResult:
    """Pairs (i, j) of shingle sets, left[i] and right[j], that LSH proposes and whose exact Jaccard is
    >= threshold, sorted by (i, j).  right=None is the self-join of `left` (each pair once, i < j).  Both
    backends give the same pairs, Jaccard and candidate count; "datasketch" indexes `left` and queries
    `right` one set at a time (put the shorter list left there), "numpy" takes both lists at once."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {BACKENDS}")
    bands, rows_per_band = choose_bands_rows(threshold, num_perm, target_recall)
    if backend == "datasketch":
        return _pairs_datasketch(left, right, threshold, num_perm, bands, rows_per_band, seed, show_progress, desc)
    sets = list(left) if right is None else [*left, *right]   # one vocabulary: ids comparable across lists
    return _pairs_numpy(_shingle_sets(sets), None if right is None else len(left), threshold, num_perm, bands,
                        rows_per_band, seed, show_progress, desc)


def minhash_pairs(normalised: Sequence[str], ngram: int = 3, threshold: float = 0.8, num_perm: int = 128,
                  target_recall: float = 0.95, seed: int = SEED, show_progress: bool = True, *,
                  backend: str = "numpy") -> MinHashResult:
    """The dedup stage's self-join over texts: similar_pairs of their character n-gram shingle sets (the
    numpy backend shingles the texts vectorised, `_shingle_texts`, instead of building Python sets)."""
    if backend == "datasketch":
        return similar_pairs([shingles(t, ngram) for t in normalised], None, threshold, num_perm, target_recall,
                             seed, show_progress, backend=backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {BACKENDS}")
    bands, rows_per_band = choose_bands_rows(threshold, num_perm, target_recall)
    return _pairs_numpy(_shingle_texts(normalised, ngram), None, threshold, num_perm, bands, rows_per_band, seed,
                        show_progress, "minhash")
