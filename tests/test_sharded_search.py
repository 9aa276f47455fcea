"""The sharded search (data_pipeline/distributed/search.py): cells of (query block x database shard) merged into
one flat index's result, ids and scores bit for bit, on real multilingual-e5-small vectors; ties at the k-th
place, shards smaller than k, calls FAISS scores pair by pair and calls smaller than the thread count; the range
search; the approximate indexes' exact re-rank.

The reference is FAISS's own IndexFlatIP searched as the native stages search it (one call of every query for
mining, one per block for dedup), under the same Geometry (FAISS's tiles and thread count) as the cells: the
tiles are made small here (64 query rows x 32 database rows) so 420 real vectors span many tiles, shards and
blocks, as a million vectors would with FAISS's defaults.
"""
from __future__ import annotations

import json

import faiss
import numpy as np
import pytest

from data_pipeline.distributed import search as S

# One thread: spinning OpenMP threads crawl on a busy machine; the test of calls smaller than the thread
# count runs with two.
G = S.Geometry(tile=64, block=32, blas_threshold=128000, threads=1)
COPIES = (7, 39, 71, 135, 263, 391)   # rows equal to row 7, all at offset 7 of a 32-row tile: exact ties


@pytest.fixture(scope="module")
def vectors(shared) -> np.ndarray:
    """420 real KUAKE-QTR dev queries and titles through me5's query side (the mining side), unit rows; rows
    COPIES are one vector, so every query scores them alike (the same place in their database tiles)."""
    from care.config import load_config
    from care.encoders import build_encoder
    from care.encoders.builders import me5 as build_me5
    from care.retrieval.index import unit_rows

    build_me5.build()   # the offline model folder, reused when up to date
    rows = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    texts = list(dict.fromkeys(t for r in rows for t in (r["query"], r["title"])))[:420]
    encoder = build_encoder(load_config("data_pipeline", ["model=me5_small"]).model)
    x = unit_rows(encoder.encode_queries(texts, batch_size=32, show_progress=False).dense)
    x[list(COPIES)] = x[COPIES[0]]
    return x


def flat_knn(x: np.ndarray, k: int, calls, g: S.Geometry = G) -> tuple[np.ndarray, np.ndarray]:
    with S.faiss_as(g):
        index = faiss.IndexFlatIP(x.shape[1])
        index.add(x)
        parts = [index.search(x[c0:c1], k) for c0, c1 in calls]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def settings(tmp_path, **kw) -> S.Settings:
    return S.Settings(executor=None, shard_rows=kw.pop("shard_rows", 96), query_rows=kw.pop("query_rows", 128),
                      threads=kw.pop("threads", G.threads), work_dir=str(tmp_path / "work"), **kw)


@pytest.fixture(autouse=True)
def small_tiles():
    """FAISS's tiles as G says, in this process (the cells set them too), restored afterwards."""
    with S.faiss_as(G):
        yield


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# ---- the cut --------------------------------------------------------------------------------------------

def test_plan_cuts_at_faiss_tiles():
    plan = S.make_plan("knn", 420, 420, 384, k=5, shard_rows=70, query_rows=100, threads=2,
                       calls=[(0, 300), (300, 301), (301, 420)])
    assert plan.shards == [[0, 96], [96, 192], [192, 288], [288, 384], [384, 420]]   # 70 -> 96 = 3 tiles
    # query blocks of 128 (2 tiles) within each call; a call's last partial block joins the one before
    assert plan.blocks == [[0, 128, 0], [128, 300, 0], [300, 301, 1], [301, 420, 2]]
    whole = [c for c in plan.cells() if c[0] == 2]
    assert whole == [(2, 0, 420)]   # a call of 1 query < 2 threads: one cell, as FAISS splits it by thread
    assert len(plan.cells()) == 3 * 5 + 1


# ---- top-k: one flat index's ids and scores --------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 10, 99, 100, 150, 450])
def test_knn_equals_one_flat_index(vectors, tmp_path, k):
    """k 1 (FAISS's top-1), 2-99 (heap), 100+ (reservoir); 150 > the 96-row shards; 450 > every row (padding)."""
    calls = [(0, 420)]
    D0, I0 = flat_knn(vectors, k, calls)
    D, I, info = S.knn(vectors, vectors, k, settings(tmp_path), calls=calls)
    assert info["cells"] == 3 * 5 and info["shards"] == 5   # blocks [0, 128), [128, 256), [256, 420)
    assert np.array_equal(I, I0)
    assert np.array_equal(bits(D), bits(D0))
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())   # work folder removed


def test_ties_at_k_settled_as_one_index(vectors, tmp_path):
    """The planted copies tie at the k-th place for some queries: one index keeps whichever copies its heap
    kept (here mostly the lowest ids); the merge alone keeps the highest ids (scores still equal), the tie pass
    what one index keeps.  (k >= 100, FAISS's reservoir: test_knn_equals_one_flat_index[150].)"""
    k, calls = 20, [(0, 420)]
    D0, I0 = flat_knn(vectors, k, calls)
    D, I, info = S.knn(vectors, vectors, k, settings(tmp_path), calls=calls)
    assert info["tied_at_k"] > 0 and np.array_equal(I, I0) and np.array_equal(bits(D), bits(D0))
    D1, I1, _ = S.knn(vectors, vectors, k, settings(tmp_path, exact_ties=False), calls=calls)
    assert np.array_equal(bits(D1), bits(D0))
    assert not np.array_equal(I1, I0)


def test_calls_scored_pair_by_pair_and_smaller_than_threads(vectors, tmp_path):
    """Calls of 200 rows (200 x 384 < FAISS's BLAS threshold: pair by pair), of 1 row (< 2 threads: FAISS
    splits the database by thread) and of 219 rows, as the nearest-neighbour histogram's blocks make them."""
    calls = [(0, 200), (200, 201), (201, 420)]
    two = S.Geometry(G.tile, G.block, G.blas_threshold, threads=2)
    for k in (2, 120):
        D0, I0 = flat_knn(vectors, k, calls, two)
        D, I, info = S.knn(vectors, vectors, k, settings(tmp_path, threads=2), calls=calls)
        assert np.array_equal(I, I0) and np.array_equal(bits(D), bits(D0))
        assert info["cells"] == 2 * 5 + 1


def test_shards_cut_off_the_tiles_change_scores(vectors):
    """Why the plan cuts at FAISS's tiles: shards of 100 rows (not a multiple of 32) score some pairs in other
    sgemm positions, and their last bits differ from one index's."""
    k = 20
    D0, _ = flat_knn(vectors, k, [(0, 420)])
    plan = S.make_plan("knn", 420, 420, 384, k=k, threads=G.threads, self_search=True)
    plan.shards = [[0, 100], [100, 200], [200, 300], [300, 420]]
    parts = [S.exact_cell(plan, 0, vectors, vectors[s0:s1], s0) for s0, s1 in plan.shards]
    D, _, _ = S.merge_knn(parts, k)
    assert not np.array_equal(bits(D), bits(D0))


def test_a_relaunch_keeps_finished_cells(vectors, tmp_path):
    """Task 0 of 2 of the cells step ran, then the search is run again: the same work folder (named by the
    vectors and the plan), task 0's cell files untouched, the rest computed, the result one index's."""
    from data_pipeline.distributed.search_steps import SearchCells

    k = 12
    plan = S.make_plan("knn", 420, 420, 384, k=k, shard_rows=96, query_rows=128, threads=G.threads,
                       self_search=True)
    job = S.Job.create(tmp_path / "work", plan, vectors, vectors)
    list(SearchCells(str(job.folder), S.Job).run(None, rank=0, world_size=2))
    done = {p: p.stat().st_mtime_ns for p in (job.folder / "cells").iterdir()}
    assert len(done) == (len(plan.cells()) + 1) // 2
    again = S.Job.create(tmp_path / "work", plan, vectors, vectors)
    assert again.folder == job.folder
    S.run_inline(again)
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())
    assert len(list((job.folder / "cells").iterdir())) == len(plan.cells())
    D = np.concatenate([r["scores"] for _, r in again.results()])
    I = np.concatenate([r["ids"] for _, r in again.results()])
    D0, I0 = flat_knn(vectors, k, [(0, 420)])
    assert np.array_equal(I, I0) and np.array_equal(bits(D), bits(D0))


# ---- range: one index's pairs, block by block ----------------------------------------------------------

@pytest.mark.parametrize("block", [150, 420])
def test_range_equals_one_flat_index(vectors, tmp_path, block):
    """Blocks of 150 rows (pair by pair) and one of 420 (BLAS tiles), at a cosine that leaves thousands of pairs."""
    radius = float(np.quantile(vectors[:50] @ vectors.T, 0.9))
    calls = [(s, min(s + block, 420)) for s in range(0, 420, block)]
    index = faiss.IndexFlatIP(384)
    index.add(vectors)
    blocks, info = S.range_blocks(vectors, vectors, radius, settings(tmp_path), calls)
    n = 0
    for (q0, q1, lims, D, I), (c0, c1) in zip(blocks, calls, strict=True):
        l0, d0, i0 = index.range_search(vectors[c0:c1], radius)
        assert (q0, q1) == (c0, c1)
        assert np.array_equal(lims, l0) and np.array_equal(I, i0) and np.array_equal(bits(D), bits(d0))
        n += len(I)
    assert n > 2000 and info["shards"] == 5


def test_semantic_dedup_functions_sharded(vectors, tmp_path):
    """data_pipeline/dedup/semantic.py with sharded= gives the native pairs and nearest-neighbour cosines."""
    from data_pipeline.dedup.semantic import cosine_pairs, nearest_neighbour_cosine

    cut = float(np.quantile(vectors @ vectors.T, 0.995))
    native = cosine_pairs(vectors, cut, "range", block=128, use_gpu=False, show_progress=False)
    sharded = cosine_pairs(vectors, cut, "range", block=128, use_gpu=False, show_progress=False,
                           sharded=settings(tmp_path))
    for field in ("rows", "cols", "sims"):
        assert np.array_equal(getattr(sharded, field), getattr(native, field))
    assert len(native.sims) > 100
    nn0 = nearest_neighbour_cosine(vectors, 128, use_gpu=False, show_progress=False)
    nn = nearest_neighbour_cosine(vectors, 128, use_gpu=False, show_progress=False, sharded=settings(tmp_path))
    assert np.array_equal(bits(nn), bits(nn0))
    with pytest.raises(ValueError, match="range search on CPUs"):
        cosine_pairs(vectors, cut, "topk", sharded=settings(tmp_path))


# ---- approximate: shared training, exact re-rank -------------------------------------------------------

@pytest.mark.parametrize("index", [{"kind": "ivf", "nlist": 8, "nprobe": 3, "seed": 0},
                                   {"kind": "hnsw", "hnsw_m": 8, "ef_search": 32}])
def test_approximate_rerank_gives_exact_scores(vectors, tmp_path, index):
    """Every (query, id) the approximate path returns carries FAISS's per-pair score (one flat index's score for
    a call below the BLAS threshold) and the float64 cosine to 1e-6; lists ordered by (score desc, id desc)."""
    k = 30
    D, I, info = S.knn(vectors, vectors, k, settings(tmp_path), index=index)
    assert info["index"] == index["kind"] and (I >= 0).all()
    with S.faiss_as(G, blas=False):
        flat = faiss.IndexFlatIP(384)
        flat.add(vectors)
        Dall, Iall = flat.search(vectors, 420)
    pair = np.empty((420, 420), np.float32)
    np.put_along_axis(pair, Iall, Dall, axis=1)
    assert np.array_equal(bits(D), bits(np.take_along_axis(pair, I, 1)))
    exact64 = np.einsum("qd,qkd->qk", vectors.astype(np.float64), vectors.astype(np.float64)[I])
    assert np.abs(D - exact64).max() < 1e-6
    key = D.astype(np.float64) * 1e6 + I * 1e-9
    assert (np.diff(D, axis=1) <= 0).all() and (np.diff(key, axis=1) <= 0).all()
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(I, flat_knn(vectors, k, [(0, 420)])[1])])
    assert recall > 0.6


def test_sharded_ivf_finds_what_one_ivf_finds(vectors, tmp_path):
    """One IVF's cells, trained once on build_index's sample and shared by every shard: the shards' lists of the
    probed cells are the one index's lists cut by shard, so the merged top-k is one IVF index's."""
    from care.retrieval.index import build_index

    opts, k = {"kind": "ivf", "nlist": 8, "nprobe": 3, "seed": 0}, 20
    one = build_index(vectors, use_gpu=False, **opts)
    D0, I0 = one.search(vectors, k)
    D, I, _ = S.knn(vectors, vectors, k, settings(tmp_path), index=opts)
    assert np.mean(I == I0) > 0.99
    assert np.abs(D - D0).max() < 1e-6
