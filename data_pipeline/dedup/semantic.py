"""Stage 3: semantic duplicates, i.e. pairs whose embeddings have cosine >= the encoder's threshold.

Embeddings come from any care.encoders.Encoder through the project's on-disk embedding cache (keyed by
the encoder's fingerprint and each text's hash), so a re-run, or a run on a grown corpus, only encodes
new texts, and mining or evaluation reuse what dedup encoded.
The search never builds the N x N similarity matrix: queries go to a FAISS flat inner-product index
(vectors L2-normalised, so inner product = cosine) a block at a time.  On CPU each block is a
`range_search`; GPU FAISS has no range search, so there each block is a top-k search, repeated with
twice the k for rows whose k-th neighbour is still above the threshold.  Both give every pair.
With dedup.semantic.engine=sharded (`sharded`: data_pipeline/distributed/search.py's Settings) the same range
searches, block by block, run as tasks over (block x database shard) on CPUs, merged into the pairs one index
gives, bit for bit; the nearest-neighbour histogram's top-2 search likewise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from care.progress import progress
from care.retrieval.index import build_index, flat_index, unit_rows, uses_gpu

# GPU FAISS's flat index answers at most this many neighbours per query.
GPU_MAX_K = 2048


@dataclass
class CosinePairs:
    rows: np.ndarray   # i < j, positions in the input
    cols: np.ndarray
    sims: np.ndarray   # cosine
    method: str        # range | topk
    saturated: int     # rows whose neighbours above the threshold exceeded GPU_MAX_K (topk on GPU only)


def _topk_above(index, xq, qid, threshold, k, max_k):
    """Neighbours of the queries `xq` (ids `qid`) with score >= threshold, by top-k search; rows whose
    k-th score is still >= threshold are searched again with 2k."""
    D, I = index.search(xq, k)
    full = D[:, -1] >= threshold
    if k >= max_k:
        saturated, full = int(full.sum()), np.zeros_like(full)
    else:
        saturated = 0
    q = np.repeat(qid[~full], k)
    d, i = D[~full].ravel(), I[~full].ravel()
    parts = [(q, i, d)]
    if full.any():
        *more, sat = _topk_above(index, xq[full], qid[full], threshold, min(2 * k, max_k), max_k)
        parts.append(tuple(more))
        saturated += sat
    return (*(np.concatenate(p) for p in zip(*parts)), saturated)


def cosine_pairs(vectors: np.ndarray, threshold: float, search: str = "auto", topk: int = 64,
                 block: int = 4096, use_gpu: bool | None = None, show_progress: bool = True,
                 index: dict | None = None, sharded=None) -> CosinePairs:
    """Every pair (i < j) with cosine >= threshold, without an N x N matrix.  `index`: build_index's
    options (default flat, exact; dedup.semantic.index), e.g. {kind: hnsw} for corpora of millions.
    `sharded`: the range searches as tasks (module docstring)."""
    x = unit_rows(vectors)
    n = len(x)
    on_gpu = uses_gpu(use_gpu) and sharded is None
    if sharded is not None and search == "topk":
        raise ValueError("dedup.semantic.engine=sharded runs FAISS's range search on CPUs: set "
                         "dedup.semantic.search=range or auto (topk is the GPU path)")
    options, index = index, (None if sharded is not None else build_index(x, use_gpu=use_gpu, **(index or {})))
    method = ("topk" if on_gpu else "range") if search == "auto" else search
    if method == "range" and on_gpu:
        raise ValueError("GPU FAISS has no range_search: use dedup.semantic.search=topk or auto")
    if method not in ("range", "topk"):
        raise ValueError(f"dedup.semantic.search must be auto, range or topk, not {search!r}")
    max_k = min(n, GPU_MAX_K) if on_gpu else n
    # FAISS's inner-product range search returns scores strictly above the radius; step one float below.
    radius = float(np.nextafter(np.float32(threshold), np.float32(-np.inf)))
    rows, cols, sims, saturated = [], [], [], 0
    found = _sharded_range(x, radius, block, sharded, options) if sharded is not None else None
    for s in progress(range(0, n, block), desc=f"semantic: {method} search", enabled=show_progress, unit="block"):
        xq, qid = x[s:s + block], np.arange(s, min(s + block, n))
        if found is not None:
            _, _, lims, d, i = next(found)
            q = np.repeat(qid, np.diff(lims).astype(np.int64))
        elif method == "range":
            lims, d, i = index.range_search(xq, radius)
            q = np.repeat(qid, np.diff(lims).astype(np.int64))
        else:
            q, i, d, sat = _topk_above(index, xq, qid, threshold, min(topk, n), max_k)
            saturated += sat
        keep = (i > q) & (d >= threshold)  # each pair once; drops the self match and -1 padding
        rows.append(q[keep]), cols.append(i[keep]), sims.append(d[keep])
    if found is not None:
        found.close()  # removes the search's work folder
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt))
    return CosinePairs(cat(rows, np.int64), cat(cols, np.int64), cat(sims, np.float64), method, saturated)


def _sharded_range(x: np.ndarray, radius: float, block: int, sharded, index: dict | None):
    """The range search of every block of `block` rows, as tasks: (q0, q1, lims, scores, ids) per block."""
    from data_pipeline.distributed.search import range_blocks

    calls = [(s, min(s + block, len(x))) for s in range(0, len(x), block)]
    return range_blocks(x, x, radius, sharded, calls, index=index)[0]


def nearest_neighbour_cosine(vectors: np.ndarray, block: int = 4096, use_gpu: bool | None = None,
                             show_progress: bool = True, sharded=None) -> np.ndarray:
    """For every text, the cosine of its most similar other text (for the histogram and calibration).
    `sharded`: the top-2 searches as tasks (module docstring)."""
    x = unit_rows(vectors)
    n = len(x)
    if n < 2:
        return np.zeros(0, np.float32)
    if sharded is not None:
        from data_pipeline.distributed.search import knn

        top2 = knn(x, x, 2, sharded, calls=[(s, min(s + block, n)) for s in range(0, n, block)])[:2]
    else:
        index = flat_index(x, use_gpu)
    out = np.empty(n, np.float32)
    for s in progress(range(0, n, block), desc="semantic: nearest neighbours", enabled=show_progress, unit="block"):
        D, I = (top2[0][s:s + block], top2[1][s:s + block]) if sharded is not None else index.search(x[s:s + block], 2)
        own = I[:, 0] == np.arange(s, s + len(I))  # with exact copies the top hit may be another row
        out[s:s + len(I)] = np.where(own, D[:, 1], D[:, 0])
    return out
