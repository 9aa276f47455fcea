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

This module is the entry point: the band choice and the two calls above.  The work is done by one of two
backends that compute the same result:
- minhash_reference.py: the recipe's definitions (`shingles`, `jaccard`, HASHFUNC, SEED, `MinHashResult`)
  and the "datasketch" backend, one MinHash per text and datasketch's MinHashLSH: the reference;
- minhash_numpy.py (with shingle_ids.py): the "numpy" backend, the default, all texts at once, tested
  against the reference pair for pair (tests/test_minhash_numpy.py) and timed against it
  (bench/dedup_bench.py).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from data_pipeline.dedup.minhash_numpy import numpy_pairs
from data_pipeline.dedup.minhash_reference import SEED, MinHashResult, reference_pairs, shingles
from data_pipeline.dedup.shingle_ids import shingle_ids_of_sets, shingle_ids_of_texts

BACKENDS = ("numpy", "datasketch")


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
        return reference_pairs(left, right, threshold, num_perm, bands, rows_per_band, seed, show_progress, desc)
    sets = list(left) if right is None else [*left, *right]   # one vocabulary: ids comparable across lists
    return numpy_pairs(shingle_ids_of_sets(sets), None if right is None else len(left), threshold, num_perm, bands,
                       rows_per_band, seed, show_progress, desc)


def minhash_pairs(normalised: Sequence[str], ngram: int = 3, threshold: float = 0.8, num_perm: int = 128,
                  target_recall: float = 0.95, seed: int = SEED, show_progress: bool = True, *,
                  backend: str = "numpy") -> MinHashResult:
    """The dedup stage's self-join over texts: similar_pairs of their character n-gram shingle sets (the
    numpy backend shingles the texts vectorised, `shingle_ids_of_texts`, instead of building Python sets)."""
    if backend == "datasketch":
        return similar_pairs([shingles(t, ngram) for t in normalised], None, threshold, num_perm, target_recall,
                             seed, show_progress, backend=backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {BACKENDS}")
    bands, rows_per_band = choose_bands_rows(threshold, num_perm, target_recall)
    return numpy_pairs(shingle_ids_of_texts(normalised, ngram), None, threshold, num_perm, bands, rows_per_band,
                       seed, show_progress, "minhash")
