"""FAISS search past one machine: the top-k search of stage "mine" and the range search of semantic dedup as
cells of (query block x database shard) that any executor runs, merged into what one index returns
(`mine.engine=sharded`, `dedup.semantic.engine=sharded`; docs/scale.md, "Search past one machine").

Exact (index kind `flat`): the merged ids and scores are bitwise those of one IndexFlatIP searched as the native
stage searches it (care/retrieval/index.py; tests/test_sharded_search.py on real me5 vectors).  Three facts of
FAISS's flat search make the cells what they are (measured on FAISS 1.15.1; docs/scale.md):
  * A call scores its queries with BLAS (sgemm) when its query rows x dimension reach
    `distance_compute_blas_threshold` (128,000), else pair by pair.  With BLAS, in tiles of
    `distance_compute_blas_query_bs` (4,096) query rows by `distance_compute_blas_database_bs` (1,024)
    database rows, and one pair's score depends on where it sits in its tile and on the BLAS thread count
    (docs/scale.md: shards cut every 1,000 rows changed the bits of 4.4% of the scores on real me5 vectors, one
    thread instead of two 4.7%).  So a shard starts at a multiple of the database tile, a query block at a
    multiple of the query tile of its native call, every cell makes the native call's BLAS-or-pairs choice and
    runs with the submitting process's FAISS thread count (`Geometry`, set in each task by `faiss_as`): every
    score is computed by the very sgemm the one index runs.
  * A call with fewer queries than threads scores database slices per thread: such a call is one cell over
    the whole database (a handful of queries needs no sharding).
  * Within a list FAISS orders equal scores by descending id, and the merge orders by (score desc, id desc).
    Which of several equal scores at the k-th place one index keeps is an artefact of its heap (k < 100) or
    reservoir (k >= 100), which depends on every score of the row in id order (so faiss.ResultHeap and
    IndexShards, merging per-shard lists, keep other ids there: docs/scale.md).  So a cell returns k + 1 per
    query, and a query whose k-th score ties one left out of the list is done again: its full score row (the
    same tiles) goes, in id order, through FAISS's own selection (`faiss_select`), which keeps what one index
    keeps.
A range search needs no merge beyond concatenation: a query's pairs come shard after shard, in id order as from
one index.

Approximate (index kind `ivf` or `hnsw`, for sizes where flat search cannot serve): an IVF's cells are trained
once on a seeded sample of the whole database (build_index's rule) and shared by every shard's index; an HNSW
graph is built per shard.  Each cell's candidates are re-scored exactly (FAISS's per-pair kernel over the
shard's own vectors, `exact_scores`) before the merge, so the merged lists are ordered by true cosine; recall
against flat: `python -m bench.sharded_search`.

The work folder of one search (`<work root>/<digest of vectors and plan>/`, resumed when a run is relaunched,
removed when the search is read back):
    plan.json                     the Plan
    queries.npy, database.npy     float32 rows (one file when the queries are the database)
    trained.faiss                 the shared IVF cells (approximate)
    shards/SSSSS.faiss            shard S's approximate index
    cells/BBBBB-SSSSS.npz         knn: scores, ids (k + 1 per query); range: lims, scores, ids
    merged/BBBBB.npz              block B's merged result
    logs/                         the executor's (datatrove's completions, per-task logs)
"""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np
import xxhash

from care.data.io import atomic_open
from care.progress import progress

NEUTRAL = float(np.finfo(np.float32).min)  # FAISS's score of an empty slot (id -1) of an inner-product list
_PAIRWISE = 2**31 - 1                      # a BLAS threshold no call reaches: FAISS's per-pair kernel
ENGINES = ("native", "sharded")


# ---- FAISS's blocking ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """How FAISS blocks an exact search, read in the submitting process and set in every task (`faiss_as`),
    so a task on another machine scores each pair as this process would."""
    tile: int            # query rows one sgemm scores (faiss.cvar.distance_compute_blas_query_bs)
    block: int           # database rows one sgemm scores (distance_compute_blas_database_bs)
    blas_threshold: int  # a call of n queries in d dimensions uses BLAS when n * d reaches this
    threads: int         # FAISS's (and its BLAS's) thread count

    @classmethod
    def here(cls, threads: int | None = None) -> Geometry:
        cv = faiss.cvar
        return cls(int(cv.distance_compute_blas_query_bs), int(cv.distance_compute_blas_database_bs),
                   int(cv.distance_compute_blas_threshold), int(threads or faiss.omp_get_max_threads()))

    def blas(self, rows: int, dim: int) -> bool:
        return rows * dim >= self.blas_threshold


@contextlib.contextmanager
def faiss_as(g: Geometry, blas: bool | None = None):
    """FAISS blocking and threads as `g` says and, when `blas` is given, BLAS (True) or the per-pair kernel
    (False) whatever a call's size; restored afterwards."""
    cv = faiss.cvar
    saved = (cv.distance_compute_blas_query_bs, cv.distance_compute_blas_database_bs,
             cv.distance_compute_blas_threshold, faiss.omp_get_max_threads())
    cv.distance_compute_blas_query_bs, cv.distance_compute_blas_database_bs = g.tile, g.block
    cv.distance_compute_blas_threshold = g.blas_threshold if blas is None else (0 if blas else _PAIRWISE)
    faiss.omp_set_num_threads(g.threads)
    try:
        yield
    finally:
        cv.distance_compute_blas_query_bs, cv.distance_compute_blas_database_bs = saved[0], saved[1]
        cv.distance_compute_blas_threshold = saved[2]
        faiss.omp_set_num_threads(saved[3])


def faiss_select(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k of one query's full score row (float32, position = id) as IndexFlatIP selects them: the row
    becomes a one-dimensional flat index searched with the query 1.0, so every score is itself (x 1.0 is exact)
    and FAISS's own heap or reservoir sees the scores in id order, as in a search of the whole database.  One
    thread: with more, FAISS would split a one-query search over database slices."""
    saved = (faiss.cvar.distance_compute_blas_threshold, faiss.omp_get_max_threads())
    faiss.cvar.distance_compute_blas_threshold, _ = _PAIRWISE, faiss.omp_set_num_threads(1)
    try:
        index = faiss.IndexFlatIP(1)
        index.add(np.ascontiguousarray(row, dtype=np.float32).reshape(-1, 1))
        D, I = index.search(np.ones((1, 1), np.float32), k)
    finally:
        faiss.cvar.distance_compute_blas_threshold = saved[0]
        faiss.omp_set_num_threads(saved[1])
    return D[0], I[0]


def _round_up(n: int, unit: int) -> int:
    return max(unit, -(-int(n) // unit) * unit)


# ---- the plan ---------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """One search cut into cells.  `calls` are the query rows of each call the native stage makes (mining: one
    call of every query; semantic dedup: one per dedup.semantic.block), `blocks` the query rows a cell scores
    ([q0, q1, call]), `shards` the database rows ([s0, s1])."""
    mode: str              # knn | range
    dim: int
    n_queries: int
    n_database: int
    k: int                 # knn: neighbours per query
    radius: float          # range: scores strictly above it (FAISS's inner-product range search)
    calls: list
    blocks: list
    shards: list
    geometry: dict
    index: dict            # build_index's options (care/retrieval/index.py); kind flat = exact
    self_search: bool      # the queries are the database's rows: one vectors file
    exact_ties: bool = True  # knn: settle a tie at the k-th place as one index does (else: highest ids kept)

    @property
    def g(self) -> Geometry:
        return Geometry(**self.geometry)

    @property
    def exact(self) -> bool:
        return self.index.get("kind", "flat") == "flat"

    def call_rows(self, b: int) -> int:
        c0, c1 = self.calls[self.blocks[b][2]]
        return c1 - c0

    def whole(self, b: int) -> bool:
        """Block b is one cell over the whole database: its native call has fewer queries than threads, which
        FAISS scores by database slices per thread (exact search only)."""
        return self.mode == "knn" and self.exact and self.call_rows(b) < self.g.threads

    def cells(self) -> list[tuple[int, int, int]]:
        """(block, s0, s1) of every cell, block by block."""
        out = []
        for b in range(len(self.blocks)):
            out += [(b, 0, self.n_database)] if self.whole(b) else [(b, s0, s1) for s0, s1 in self.shards]
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def make_plan(mode: str, n_queries: int, n_database: int, dim: int, *, k: int = 0, radius: float = 0.0,
              calls: list | None = None, shard_rows: int = 262144, query_rows: int = 16384,
              threads: int | None = None, index: dict | None = None, self_search: bool = False,
              exact_ties: bool = True) -> Plan:
    """Cells of a search: database shards of `shard_rows` and query blocks of `query_rows` rounded up to FAISS's
    tiles (a call's last partial block joins the one before it, so no block is smaller than the tile a call
    would give it); a range search's blocks are its calls."""
    if mode not in ("knn", "range"):
        raise ValueError(f"search mode must be knn or range, not {mode!r}")
    g = Geometry.here(threads)
    calls = [list(map(int, c)) for c in (calls or [(0, n_queries)])]
    rows = _round_up(shard_rows, g.block)
    shards = [[s, min(s + rows, n_database)] for s in range(0, n_database, rows)]
    step = _round_up(query_rows, g.tile)
    blocks = []
    for c, (c0, c1) in enumerate(calls):
        starts = list(range(c0, c1, step)) if mode == "knn" else [c0]
        if len(starts) > 1 and c1 - starts[-1] < step:
            starts.pop()
        blocks += [[a, b, c] for a, b in zip(starts, [*starts[1:], c1])]
    return Plan(mode, int(dim), int(n_queries), int(n_database), int(k), float(radius), calls, blocks, shards,
                asdict(g), dict(index or {"kind": "flat"}), bool(self_search), bool(exact_ties))


# ---- one cell ---------------------------------------------------------------------------------------------

def exact_cell(plan: Plan, b: int, xq: np.ndarray, xb: np.ndarray, s0: int) -> dict:
    """Block b's queries `xq` against the database rows `xb` (ids from s0) by one IndexFlatIP, as the native
    call would score them.  knn: k + 1 per query (k for a whole-database cell: that is the native call)."""
    g, blas = plan.g, plan.g.blas(plan.call_rows(b), plan.dim)
    with faiss_as(g, blas):
        index = faiss.IndexFlatIP(plan.dim)
        index.add(np.ascontiguousarray(xb, dtype=np.float32))
        xq = np.ascontiguousarray(xq, dtype=np.float32)
        if plan.mode == "range":
            lims, D, I = index.range_search(xq, plan.radius)
            return {"lims": lims.astype(np.int64), "scores": D, "ids": I + s0}
        D, I = index.search(xq, plan.k if plan.whole(b) else plan.k + 1)
    return {"scores": D, "ids": np.where(I >= 0, I + s0, -1)}


def exact_scores(xq: np.ndarray, xb: np.ndarray, q_of: np.ndarray, local: np.ndarray) -> np.ndarray:
    """The score of each (query q_of[n], database row local[n]) pair by FAISS's per-pair kernel (the one a flat
    index uses for a call below its BLAS threshold): the re-rank of approximate candidates."""
    out = np.empty(len(q_of), np.float32)
    if len(q_of):
        xq, xb = np.ascontiguousarray(xq, np.float32), np.ascontiguousarray(xb, np.float32)
        q_of, local = np.ascontiguousarray(q_of, np.int64), np.ascontiguousarray(local, np.int64)
        faiss.pairwise_indexed_inner_product(xq.shape[1], len(q_of), faiss.swig_ptr(xq), faiss.swig_ptr(q_of),
                                             faiss.swig_ptr(xb), faiss.swig_ptr(local), faiss.swig_ptr(out))
    return out


def train_ivf(plan: Plan, database: np.ndarray):
    """The IVF cells every shard shares, trained once on build_index's seeded sample of the whole database."""
    from care.retrieval.index import ivf_cells

    d = plan.dim
    cells, rows = ivf_cells(plan.n_database, plan.index.get("nlist"), plan.index.get("seed", 0))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, cells, faiss.METRIC_INNER_PRODUCT)
    with faiss_as(plan.g):
        index.train(np.ascontiguousarray(database if rows is None else database[rows], dtype=np.float32))
    return index


def shard_index(plan: Plan, xb: np.ndarray, s0: int, trained=None):
    """Shard rows `xb` (ids from s0) in the plan's approximate index: the shared IVF's cells, or an HNSW graph."""
    opts = plan.index
    with faiss_as(plan.g):
        if opts["kind"] == "ivf":
            index = faiss.clone_index(trained)
            index.add_with_ids(np.ascontiguousarray(xb, np.float32), np.arange(s0, s0 + len(xb), dtype=np.int64))
        else:
            index = faiss.IndexHNSWFlat(plan.dim, int(opts.get("hnsw_m", 32)), faiss.METRIC_INNER_PRODUCT)
            index.add(np.ascontiguousarray(xb, np.float32))
    return index


def approximate_cell(plan: Plan, xq: np.ndarray, xb: np.ndarray, s0: int, index) -> dict:
    """Block queries against one shard's approximate index; the candidates re-scored exactly (`exact_scores`)
    and ordered as the exact merge orders them (knn: k per query; range: in id order)."""
    opts = plan.index
    if opts["kind"] == "ivf":
        index.nprobe = min(int(opts.get("nprobe", 32)), index.nlist)
    else:
        index.hnsw.efSearch = int(opts.get("ef_search", 256))
    xq = np.ascontiguousarray(xq, np.float32)
    with faiss_as(plan.g):
        if plan.mode == "range":
            lims, _, I = index.range_search(xq, plan.radius)
        else:
            _, I = index.search(xq, min(plan.k, len(xb)))
    local = (I if opts["kind"] == "hnsw" else I - s0).astype(np.int64)
    if plan.mode == "range":
        q_of = np.repeat(np.arange(len(xq)), np.diff(lims))
        scores = exact_scores(xq, xb, q_of, local)
        keep = scores > plan.radius
        order = np.lexsort((local[keep], q_of[keep]))
        counts = np.bincount(q_of[keep], minlength=len(xq))
        return {"lims": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                "scores": scores[keep][order], "ids": local[keep][order] + s0}
    found = local >= 0
    q_of = np.repeat(np.arange(len(xq)), local.shape[1]).reshape(local.shape)
    scores = np.full(local.shape, NEUTRAL, np.float32)
    scores[found] = exact_scores(xq, xb, q_of[found], local[found])
    return _sorted_top({"scores": scores, "ids": np.where(found, local + s0, -1)}, local.shape[1])


# ---- the merge --------------------------------------------------------------------------------------------

def _order_keys(D: np.ndarray, I: np.ndarray) -> np.ndarray:
    """One int64 per entry that sorts as (score, id) ascending, an empty slot (id -1) below all: the score's
    float32 bits as an int32 of the same order (-0.0 counted as 0.0) above the id's 32 bits.  One sort of these
    is several times faster than a lexsort of the two keys."""
    bits = (np.asarray(D, np.float32) + np.float32(0.0)).view(np.int32)
    ordered = (bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))).astype(np.int64)
    key = (ordered << 32) | (np.asarray(I, np.int64) & 0xFFFFFFFF)
    key[np.asarray(I) < 0] = np.iinfo(np.int64).min
    return key


def _sorted_top(part: dict, k: int) -> dict:
    """Each row's entries by (score desc, id desc), empty slots (id -1) last, cut to k."""
    D, I = part["scores"], part["ids"]
    if I.size and int(I.max()) >= 1 << 32:
        raise ValueError("the sharded search numbers database rows in 32 bits: more than 4,294,967,295 rows")
    key = ~_order_keys(D, I)   # ascending = (score desc, id desc); keys are distinct (the ids are)
    if k < key.shape[1]:
        best = np.argpartition(key, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(best, np.argsort(np.take_along_axis(key, best, 1), axis=1), 1)
    else:
        order = np.argsort(key, axis=1)
    return {"scores": np.take_along_axis(D, order, 1), "ids": np.take_along_axis(I, order, 1)}


def merge_knn(parts: list[dict], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores, ids, tied) of one block from its cells' lists: each query's k best by (score desc, id desc)
    with empty slots (NEUTRAL, -1) as FAISS pads them; `tied` marks the queries whose k-th score equals one
    left out of the list (only `faiss_select` over the full row can say which of those one index keeps)."""
    D = np.concatenate([p["scores"] for p in parts], axis=1)
    I = np.concatenate([p["ids"] for p in parts], axis=1)
    width = max(k + 1, 1)
    if D.shape[1] < width:
        pad = width - D.shape[1]
        D = np.pad(D, ((0, 0), (0, pad)), constant_values=NEUTRAL)
        I = np.pad(I, ((0, 0), (0, pad)), constant_values=-1)
    top = _sorted_top({"scores": D, "ids": I}, width)
    S, J = top["scores"], top["ids"]
    tied = (J[:, k] >= 0) & (S[:, k] == S[:, k - 1]) if k >= 1 else np.zeros(len(S), bool)
    S, J = S[:, :k], J[:, :k]
    S[J < 0] = NEUTRAL
    return S, J, tied


def full_rows(plan: Plan, b: int, xq: np.ndarray, database: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The full score rows (every database row, in id order) of block b's queries `rows`, all in one query tile,
    each score from the sgemm one index computes it in: that tile (the whole block when the tile has fewer rows
    than threads, which FAISS would score by database slices) against each database tile of each shard, every
    pair kept (a range search below every score)."""
    out = np.empty((len(rows), plan.n_database), np.float32)
    g, blas = plan.g, plan.g.blas(plan.call_rows(b), plan.dim)
    a = int(rows[0]) // g.tile * g.tile
    z = min(a + g.tile, len(xq))
    if z - a < g.threads:
        a, z = 0, len(xq)
    xt = np.ascontiguousarray(xq[a:z], np.float32)
    for s0, s1 in plan.shards:
        for j0 in range(s0, s1, g.block):
            j1 = min(j0 + g.block, s1)
            with faiss_as(g, blas):
                index = faiss.IndexFlatIP(plan.dim)
                index.add(np.ascontiguousarray(database[j0:j1], np.float32))
                lims, D, I = index.range_search(xt, NEUTRAL)
            for n, r in enumerate((rows - a).tolist()):
                out[n, j0 + I[lims[r]:lims[r + 1]]] = D[lims[r]:lims[r + 1]]
    return out


def merge_block(plan: Plan, b: int, parts: list[dict], xq: np.ndarray | None = None,
                database: np.ndarray | None = None) -> dict:
    """Block b's result from its cells, in cell order (shard after shard): knn {scores, ids, ties}, range
    {lims, scores, ids}.  A knn query with a tie at the k-th place is settled by `faiss_select` over its full
    score row (`xq`, `database`: the block's queries and the database, needed only then), one query tile's
    tied rows at a time (a row is the database's size)."""
    if plan.mode == "range":
        return merge_range(parts)
    if len(parts) == 1 and plan.whole(b):
        return {"scores": parts[0]["scores"], "ids": parts[0]["ids"], "ties": 0}
    S, J, tied = merge_knn(parts, plan.k)
    rows = np.flatnonzero(tied)
    if len(rows) and plan.exact and plan.exact_ties:
        tile_of = rows // plan.g.tile
        for t in np.unique(tile_of).tolist():
            mine = rows[tile_of == t]
            for r, full in zip(mine.tolist(), full_rows(plan, b, xq, database, mine)):
                S[r], J[r] = faiss_select(full, plan.k)
    return {"scores": S, "ids": J, "ties": len(rows)}


def merge_range(parts: list[dict]) -> dict:
    """One block's range results from its shards' (lims, scores, ids): each query's pairs shard after shard."""
    counts = np.stack([np.diff(p["lims"]) for p in parts], axis=1)
    lims = np.concatenate([[0], np.cumsum(counts.sum(axis=1))]).astype(np.int64)
    before = np.cumsum(counts, axis=1) - counts   # a query's pairs from earlier shards
    D = np.empty(int(lims[-1]), np.float32)
    I = np.empty(int(lims[-1]), np.int64)
    for s, p in enumerate(parts):
        c = counts[:, s]
        within = np.arange(len(p["ids"])) - np.repeat(p["lims"][:-1], c)
        at = np.repeat(lims[:-1] + before[:, s], c) + within
        D[at], I[at] = p["scores"], p["ids"]
    return {"lims": lims, "scores": D, "ids": I}


# ---- a search in a work folder ----------------------------------------------------------------------------

def digest(*arrays: np.ndarray, text: str = "") -> str:
    """xxh3-128 of the arrays' bytes and a text: names a search's work folder."""
    h = xxhash.xxh3_128()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        for s in range(0, len(a), 1 << 16):
            h.update(a[s:s + (1 << 16)].tobytes())
    h.update(text.encode())
    return h.hexdigest()[:24]


def _save(path: Path, **arrays) -> None:
    with atomic_open(path, "wb") as fh:
        np.savez(fh, **arrays)


def _load(path: Path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


class Job:
    """One search's work folder (module docstring): what every task reads and writes."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._plan = None

    @classmethod
    def create(cls, root: str | Path, plan: Plan, queries: np.ndarray, database: np.ndarray) -> Job:
        """The folder of this search under `root` (the same vectors and plan find the same folder, so a
        relaunch resumes it), written when new."""
        folder = Path(root) / digest(database, *([] if plan.self_search else [queries]), text=plan.to_json())
        job = cls(folder)
        if not (folder / "plan.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            for name, x in [("database", database), *([] if plan.self_search else [("queries", queries)])]:
                with atomic_open(folder / f"{name}.npy", "wb") as fh:
                    np.save(fh, np.ascontiguousarray(x, np.float32))
            if plan.index.get("kind") == "ivf":
                index = train_ivf(plan, database)
                with atomic_open(folder / "trained.faiss", "wb") as fh:
                    fh.write(faiss.serialize_index(index).tobytes())
            with atomic_open(folder / "plan.json", "w") as fh:
                fh.write(plan.to_json())
        return job

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = Plan(**json.loads((self.folder / "plan.json").read_text("utf-8")))
        return self._plan

    def database(self) -> np.ndarray:
        return np.load(self.folder / "database.npy", mmap_mode="r")

    def queries(self) -> np.ndarray:
        return self.database() if self.plan.self_search else np.load(self.folder / "queries.npy", mmap_mode="r")

    def block_queries(self, b: int) -> np.ndarray:
        q0, q1, _ = self.plan.blocks[b]
        return np.asarray(self.queries()[q0:q1])

    def cell_path(self, b: int, s0: int) -> Path:
        return self.folder / "cells" / f"{b:05d}-{s0 // self.plan.g.block:07d}.npz"

    def merged_path(self, b: int) -> Path:
        return self.folder / "merged" / f"{b:05d}.npz"

    def shard_path(self, s: int) -> Path:
        return self.folder / "shards" / f"{s:05d}.faiss"

    # the three kinds of task: shard indexes (approximate), cells, merges; each skips what is already there

    def build_shard(self, s: int) -> None:
        plan, path = self.plan, self.shard_path(s)
        if path.exists():
            return
        s0, s1 = plan.shards[s]
        trained = (faiss.deserialize_index(np.fromfile(self.folder / "trained.faiss", np.uint8))
                   if plan.index["kind"] == "ivf" else None)
        index = shard_index(plan, np.asarray(self.database()[s0:s1]), s0, trained)
        with atomic_open(path, "wb") as fh:
            fh.write(faiss.serialize_index(index).tobytes())

    def run_cell(self, cell: tuple[int, int, int]) -> None:
        b, s0, s1 = cell
        plan, path = self.plan, self.cell_path(b, s0)
        if path.exists():
            return
        xq, xb = self.block_queries(b), np.asarray(self.database()[s0:s1])
        if plan.exact:
            result = exact_cell(plan, b, xq, xb, s0)
        else:
            s = [list(x) for x in plan.shards].index([s0, s1])
            index = faiss.deserialize_index(np.fromfile(self.shard_path(s), np.uint8))
            result = approximate_cell(plan, xq, xb, s0, index)
        _save(path, **result)

    def merge(self, b: int) -> None:
        plan, path = self.plan, self.merged_path(b)
        if path.exists():
            return
        parts = [_load(self.cell_path(b, s0)) for bb, s0, _ in plan.cells() if bb == b]
        result = merge_block(plan, b, parts, self.block_queries(b), self.database())
        _save(path, **{k: np.asarray(v) for k, v in result.items()})

    def results(self) -> Iterator[tuple[int, dict]]:
        """(block, merged result) in query order."""
        for b in range(len(self.plan.blocks)):
            yield b, _load(self.merged_path(b))


def run_inline(job: Job, show_progress: bool = False) -> None:
    """Every task of the job in this process, in order: what the tests compare with one index, and the
    executor-free way to run a search."""
    plan = job.plan
    if not plan.exact:
        for s in range(len(plan.shards)):
            job.build_shard(s)
    for cell in progress(plan.cells(), desc="search cells", enabled=show_progress, unit="cell"):
        job.run_cell(cell)
    for b in range(len(plan.blocks)):
        job.merge(b)


def pool_safe(executor):
    """The executor section with a local pool started by forkserver whatever `local.start_method` says: a worker
    forked from a process whose FAISS (OpenMP) or ONNX Runtime thread pools have run inherits them in a state
    that hangs it (seen: cells spinning for 26 minutes after the parent's tie pass; a 0.9-second search never
    ending).  forkserver, like spawn, imports the main module again in the pool: a script without a main guard
    hangs there (`python -m data_pipeline` has one)."""
    from omegaconf import DictConfig, OmegaConf

    from data_pipeline.distributed.executors import executor_kind

    if executor is None or executor_kind(executor) != "local":
        return executor
    out = OmegaConf.to_container(executor, resolve=True) if isinstance(executor, DictConfig) else dict(executor)
    out["local"] = {**(out.get("local") or {}), "start_method": "forkserver"}
    return out


def _steps(job: Job, executor_cfg, tasks: int) -> list:
    """The job's datatrove steps (search_steps.py) on the configured executor: shard indexes (approximate
    only), cells, merges, each as up to `tasks` tasks."""
    from data_pipeline.distributed.executors import make_executor
    from data_pipeline.distributed.search_steps import BuildShards, MergeBlocks, SearchCells

    plan, logs = job.plan, job.folder / "logs"
    steps = []
    if not plan.exact:
        n = min(tasks, len(plan.shards))
        steps.append(("search: shard indexes", make_executor(executor_cfg, [BuildShards(str(job.folder), Job)],
                                                              logs / f"shards-{n}", n, "search_shards")))
    n = min(tasks, len(plan.cells()))
    steps.append(("search: cells", make_executor(executor_cfg, [SearchCells(str(job.folder), Job)],
                                                  logs / f"cells-{n}", n, "search_cells")))
    n = min(tasks, len(plan.blocks))
    steps.append(("search: merge", make_executor(executor_cfg, [MergeBlocks(str(job.folder), Job)],
                                                  logs / f"merge-{n}", n, "search_merge")))
    return steps


@dataclass
class Settings:
    """The sharded engine's options (conf/mine/default.yaml, conf/dedup/default.yaml `semantic`) and the
    executor section its tasks run on (executors.py's keys; None: every task here, one after the other)."""
    executor: object = None
    tasks: int = 4
    shard_rows: int = 262144
    query_rows: int = 16384
    encode_shard: int = 8192
    threads: int | None = None
    exact_ties: bool = True
    work_dir: str | None = None

    @classmethod
    def from_config(cls, executor, tasks, sharded: dict | None, cache_root: str | Path) -> Settings:
        """From a stage's `tasks` and `sharded` keys; the work folder defaults to <cache_root>/sharded_search."""
        s = dict(sharded or {})
        if int(tasks) < 1:
            raise ValueError(f"tasks={tasks}: the sharded engine needs at least one task")
        return cls(executor=executor, tasks=int(tasks), shard_rows=int(s.get("shard_rows", 262144)),
                   query_rows=int(s.get("query_rows", 16384)), encode_shard=int(s.get("encode_shard", 8192)),
                   threads=s.get("threads"), exact_ties=bool(s.get("exact_ties", True)),
                   work_dir=str(s.get("work_dir") or Path(cache_root) / "sharded_search"))


def _run(kind: str, queries: np.ndarray, database: np.ndarray, settings: Settings, **plan_args) -> tuple[Job, dict]:
    self_search = queries is database
    plan = make_plan(kind, len(queries), len(database), database.shape[1], shard_rows=settings.shard_rows,
                     query_rows=settings.query_rows, threads=settings.threads, self_search=self_search,
                     exact_ties=settings.exact_ties, **plan_args)
    if settings.work_dir is None:
        raise ValueError("the sharded search needs a work folder (sharded.work_dir)")
    t0 = time.perf_counter()
    job = Job.create(settings.work_dir, plan, queries, database)
    if settings.executor is None:
        run_inline(job)
    else:
        from data_pipeline.distributed.executors import run_steps

        executor = pool_safe(settings.executor)
        run_steps(executor, _steps(job, executor, settings.tasks))   # raises on a failed task
    info = {"engine": "sharded", "index": plan.index.get("kind", "flat"), "cells": len(plan.cells()),
            "query_blocks": len(plan.blocks), "shards": len(plan.shards), "threads": plan.g.threads,
            "tasks": settings.tasks if settings.executor is not None else 1,
            "executor": str(settings.executor.get("executor", "local")) if settings.executor is not None else None,
            "seconds": round(time.perf_counter() - t0, 3)}
    return job, info


def knn(queries: np.ndarray, database: np.ndarray, k: int, settings: Settings, calls: list | None = None,
        index: dict | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(scores, ids, info): each query's k nearest database rows by inner product, as one index searched in
    `calls` (default: one call of every query) returns them (module docstring); `info` for stats.json."""
    n = len(queries)
    if n == 0 or len(database) == 0 or k == 0:
        return np.full((n, k), NEUTRAL, np.float32), np.full((n, k), -1, np.int64), {"engine": "sharded", "cells": 0}
    job, info = _run("knn", queries, database, settings, k=k, calls=calls, index=index)
    D, I, ties = np.empty((n, k), np.float32), np.empty((n, k), np.int64), 0
    for b, r in job.results():
        q0, q1, _ = job.plan.blocks[b]
        D[q0:q1], I[q0:q1], ties = r["scores"], r["ids"], ties + int(r["ties"])
    shutil.rmtree(job.folder, ignore_errors=True)
    return D, I, {**info, "tied_at_k": ties}


def range_blocks(queries: np.ndarray, database: np.ndarray, radius: float, settings: Settings, calls: list,
                 index: dict | None = None) -> tuple[Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]], dict]:
    """(blocks, info): every call's range search (scores strictly above `radius`) as one index's
    `range_search(queries[q0:q1], radius)` returns it, yielded as (q0, q1, lims, scores, ids) in call order;
    the work folder goes when the generator is read to its end or closed."""
    job, info = _run("range", queries, database, radius=radius, calls=calls, index=index, settings=settings)

    def blocks():
        try:
            for b, r in job.results():
                q0, q1, _ = job.plan.blocks[b]
                yield q0, q1, r["lims"], r["scores"], r["ids"]
        finally:  # read to the end or closed: the results are all on disk, nothing to resume
            shutil.rmtree(job.folder, ignore_errors=True)
    return blocks(), info


# ---- the stages' configuration ----------------------------------------------------------------------------

SEARCH_KEYS = ("engine", "executor", "tasks", "workers", "local", "slurm", "ray", "sharded")


def search_identity(section: dict) -> dict:
    """A stage section (mine, dedup.semantic) without the keys that say how its search runs, for the stage's
    fingerprint: an exact (flat) search finds the same either way, so a folder either engine wrote is up to date
    for the other and fingerprints written before the engine existed still hold.  A sharded approximate search
    keeps its engine and shard size, which change what it finds (one IVF's or HNSW's lists per shard)."""
    out = {k: v for k, v in section.items() if k not in SEARCH_KEYS}
    if section.get("engine", "native") == "sharded" and (section.get("index") or {}).get("kind", "flat") != "flat":
        out["engine"] = {"sharded": {"shard_rows": (section.get("sharded") or {}).get("shard_rows")}}
    return out


def stage_settings(section, executor, cache_root, where: str) -> Settings | None:
    """The sharded engine's Settings for a stage section (`where`: its config path, for errors), None when its
    engine is native.  `executor`: the section holding the executor keys (executors.py)."""
    engine = section.get("engine", "native")
    if engine not in ENGINES:
        raise ValueError(f"{where}.engine={engine!r}: choose from {list(ENGINES)}")
    if engine == "native":
        return None
    return Settings.from_config(executor, section.get("tasks", 4), section.get("sharded"), cache_root)
