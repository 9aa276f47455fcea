"""Inner-product search with FAISS: the flat (exact) index every stage uses by default, the approximate IVF
and HNSW indexes a stage can choose instead (`build_index`), and small ranking helpers."""
from __future__ import annotations

import faiss
import numpy as np
from scipy import sparse as sp


def uses_gpu(use_gpu: bool | None = None) -> bool:
    """Whether flat_index puts its index on GPUs: when FAISS sees any and the caller does not say no."""
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    return bool(gpus and use_gpu is not False)


def flat_index(vectors: np.ndarray, use_gpu: bool | None = None):
    """A flat (exact) inner-product index over `vectors`; on every GPU when faiss-gpu is installed, the
    same calls either way."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    if uses_gpu(use_gpu):
        index = faiss.index_cpu_to_all_gpus(index)
    return index


INDEX_KINDS = ("flat", "ivf", "hnsw")


def build_index(vectors: np.ndarray, kind: str = "flat", use_gpu: bool | None = None, nlist: int | None = None,
                nprobe: int = 32, hnsw_m: int = 32, ef_search: int = 256, seed: int = 0):
    """An inner-product index over `vectors`: `flat` (exact; the default everywhere), or FAISS's two
    approximate families for corpora where exact search stops being affordable (docs/scale.md):
    `ivf` (IndexIVFFlat: `nlist` k-means cells, default 4 sqrt(N), `nprobe` searched) and `hnsw`
    (IndexHNSWFlat: `hnsw_m` links a node, `ef_search` candidates a query).  Every kind answers `search`
    and `range_search` with the same calls, so a stage swaps one for another by config alone; recall
    against flat is measured by `make bench-scale`."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"index kind must be one of {', '.join(INDEX_KINDS)}, not {kind!r}")
    if kind == "flat":
        return flat_index(vectors, use_gpu)
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = x.shape
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = ef_search
        index.add(x)
        return index
    cells, rows = ivf_cells(n, nlist, seed)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, cells, faiss.METRIC_INNER_PRODUCT)
    index.train(x if rows is None else x[rows])
    index.add(x)
    index.nprobe = min(nprobe, cells)
    if uses_gpu(use_gpu):
        index = faiss.index_cpu_to_all_gpus(index)
    return index


def ivf_cells(n: int, nlist: int | None = None, seed: int = 0) -> tuple[int, np.ndarray | None]:
    """An IVF index's cells over n vectors (default 4 sqrt(N); FAISS wants >= 39 points a cell) and the seeded
    rows they are trained on (None: every row): build_index's rule, and the sharded search's
    (data_pipeline/distributed/search.py), which trains them once for every shard."""
    cells = int(nlist or max(1, min(n // 39, round(4 * np.sqrt(n)))))
    if n <= 256 * cells:
        return cells, None
    return cells, np.random.default_rng(seed).choice(n, size=256 * cells, replace=False)


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """A float32 copy with every row L2-normalised (inner product = cosine)."""
    x = np.ascontiguousarray(vectors, dtype=np.float32).copy()
    faiss.normalize_L2(x)
    return x


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top k of a dense score block, best first."""
    k = min(k, scores.shape[1])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    part_scores = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-part_scores, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(part_scores, order, axis=1)


def sparse_matrix(weights: list[dict[int, float]], width: int) -> sp.csr_matrix:
    """Sparse token-weight bags as a [texts, width] CSR matrix."""
    indptr = np.cumsum([0] + [len(w) for w in weights])
    indices = np.fromiter((t for w in weights for t in w), dtype=np.int64, count=indptr[-1])
    values = np.fromiter((v for w in weights for v in w.values()), dtype=np.float64, count=indptr[-1])
    return sp.csr_matrix((values, indices, indptr), shape=(len(weights), width))
