"""The sharded search against one index on real me5 vectors: `python -m bench.sharded_search [n=50000]
[queries=2000] [shards=4] [store=...] [cache=...]`; writes bench/results/sharded_search.json (docs/scale.md,
"Search past one machine").

Vectors: multilingual-e5-small's query side (the mining side, question mode) of the first n distinct questions
of the import stage's text store (`python -m data_pipeline stage=import`), through the embedding cache (encoded
once, minutes on a CPU).  Queries: a seeded sample of `queries` of those rows, searched as one call, as mining
searches its queries.
- exact (index kind flat): the sharded top-501 (mining's k in question mode) and the range search at the
  mining window's top (0.97) against one IndexFlatIP: rows whose ids or scores differ (expected 0), the ties
  at the k-th place the tie pass settled, and the seconds of each;
- approximate (ivf, hnsw, care/retrieval/index.py's defaults): one index (build_index) and the sharded search
  (the IVF's cells trained once and shared, an HNSW graph per shard, every candidate re-scored exactly), each
  against flat: recall@10 and recall@500 (the share of flat's top k found), build and search seconds.
The machine's load is recorded with the times: on a shared CPU they are upper bounds.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from datetime import date

import numpy as np

K = 501           # mining's top_k + 1 in question mode (conf/mine/default.yaml)
RANGE_COSINE = 0.97   # conf/model/me5_small.yaml thresholds.mine_hi: the query side's near-duplicate zone


def _args(argv: list[str]) -> dict:
    out = {"n": 50_000, "queries": 2_000, "shards": 4, "store": None, "cache": None}
    for a in argv:
        key, _, value = a.partition("=")
        if key not in out:
            raise SystemExit(f"unknown argument {a!r}: give n=, queries=, shards=, store=, cache=")
        out[key] = value if key in ("store", "cache") else int(value)
    return out


def vectors(n: int, store: str | None, cache: str | None) -> np.ndarray:
    """me5's query-side unit vectors of the first n distinct questions of the import store."""
    from care.config import load_config
    from care.data.io import read_jsonl
    from care.encoders import build_encoder
    from care.encoders.cache import EmbeddingCache, embed
    from care.paths import outputs_dir
    from care.retrieval.index import unit_rows

    path = store or outputs_dir() / "data" / "import" / "texts.jsonl"
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: run `python -m data_pipeline stage=import` first")
    texts = list(dict.fromkeys(r["text"] for r in read_jsonl(path) if r.get("role") == "question"))[:n]
    cfg = load_config("data_pipeline", ["model=me5_small"])
    x = embed(build_encoder(cfg.model), texts, "query", EmbeddingCache(cache or cfg.mine.cache), 32).dense
    return unit_rows(x)


def recall(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, exact)]))


def numerics(x: np.ndarray, xq: np.ndarray, D0: np.ndarray) -> dict:
    """Why the cells are cut as they are: the share of one index's top-K scores whose bits change when the
    database is cut at multiples of 1,000 rows (not of FAISS's 1,024-row tile), and when FAISS runs on one
    thread instead of two; and the share whose 6-decimal rounding (the score train.jsonl stores) changes.  And
    why the merge is its own: the rows where FAISS's ResultHeap or IndexShards over 4 tile-aligned shards,
    and this engine, give other ids or scores than one index, at top-10 and top-K."""
    import faiss

    from data_pipeline.distributed import search as S

    def share(D: np.ndarray) -> dict:
        bits = float(np.mean(D.view(np.uint32) != D0.view(np.uint32)))
        rounded = float(np.mean(np.round(D.astype(np.float64), 6) != np.round(D0.astype(np.float64), 6)))
        return {"scores_bits_differ": round(bits, 4), "scores_6_decimals_differ": round(rounded, 5)}

    here = S.Geometry.here()
    plan = S.make_plan("knn", len(xq), len(x), x.shape[1], k=K)
    plan.shards = [[s, min(s + 1000 * (-(-len(x) // 4000)), len(x))]
                   for s in range(0, len(x), 1000 * (-(-len(x) // 4000)))]
    D, _, _ = S.merge_knn([S.exact_cell(plan, 0, xq, x[s0:s1], s0) for s0, s1 in plan.shards], K)
    out = {"shards_cut_at_1000_rows": share(D)}
    # FAISS's own mergers over the same 4 tile-aligned shards: one index's scores, but their heaps keep other
    # ids among scores tied at the k-th place
    for k in (10, K):
        index = faiss.IndexFlatIP(x.shape[1])
        index.add(x)
        D0k, I0k = index.search(xq, k)
        heap, shards = faiss.ResultHeap(len(xq), k, keep_max=True), faiss.IndexShards(x.shape[1], True, True)
        rows = -(-len(x) // 4 // here.block) * here.block
        for s0 in range(0, len(x), rows):
            sub = faiss.IndexFlatIP(x.shape[1])
            sub.add(x[s0:s0 + rows])
            Ds, Is = sub.search(xq, k)
            heap.add_result(Ds, np.where(Is >= 0, Is + s0, -1))
            shards.add_shard(sub)
        heap.finalize()
        Dsh, Ish = shards.search(xq, k)
        Dme, Ime, _ = S.knn(xq, x, k, S.Settings(shard_rows=rows, work_dir=tempfile.mkdtemp()))
        out[f"mergers_top{k}"] = {
            "this engine": {"rows_ids_differ": int((Ime != I0k).any(1).sum()),
                            "rows_scores_differ": int((Dme != D0k).any(1).sum())},
            "ResultHeap": {"rows_ids_differ": int((heap.I != I0k).any(1).sum()),
                           "rows_scores_differ": int((heap.D != D0k).any(1).sum())},
            "IndexShards": {"rows_ids_differ": int((Ish != I0k).any(1).sum()),
                            "rows_scores_differ": int((Dsh != D0k).any(1).sum())}}
    for threads in (1, 2):
        if threads != here.threads:
            with S.faiss_as(S.Geometry(here.tile, here.block, here.blas_threshold, threads)):
                index = faiss.IndexFlatIP(x.shape[1])
                index.add(x)
                out[f"{threads}_threads_instead_of_{here.threads}"] = share(index.search(xq, K)[0])
    return out


def run(args: dict) -> dict:
    import faiss

    from care.retrieval.index import build_index, flat_index
    from data_pipeline.distributed import search as S

    load0 = os.getloadavg()
    x = vectors(args["n"], args["store"], args["cache"])
    n = len(x)
    rng = np.random.default_rng(0)
    xq = np.ascontiguousarray(x[np.sort(rng.choice(n, size=min(args["queries"], n), replace=False))])
    settings = S.Settings(executor=None, shard_rows=-(-n // args["shards"]), work_dir=tempfile.mkdtemp())
    out = {"date": date.today().isoformat(), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                         "faiss": faiss.__version__,
                                                         "faiss_threads": faiss.omp_get_max_threads()},
           "vectors": {"n": n, "dim": int(x.shape[1]), "what": "me5_small query side of the import store's "
                                                               "first distinct questions"},
           "queries": len(xq), "shards_asked": args["shards"]}

    t0 = time.perf_counter()
    index = flat_index(x, use_gpu=False)
    D0, I0 = index.search(xq, K)
    flat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    D, I, info = S.knn(xq, x, K, settings)
    sharded_s = time.perf_counter() - t0
    radius = float(np.nextafter(np.float32(RANGE_COSINE), np.float32(-np.inf)))
    t0 = time.perf_counter()
    l0, d0, i0 = index.range_search(xq, radius)
    range_flat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blocks, rinfo = S.range_blocks(xq, x, radius, settings, [(0, len(xq))])
    (_, _, lims, d, i), = list(blocks)
    range_sharded_s = time.perf_counter() - t0
    out["exact"] = {
        "knn": {"k": K, "rows_ids_differ": int((I != I0).any(axis=1).sum()),
                "rows_scores_differ": int((D.view(np.uint32) != D0.view(np.uint32)).any(axis=1).sum()),
                "tied_at_k": info["tied_at_k"], "cells": info["cells"], "shards": info["shards"],
                "flat_seconds": round(flat_s, 2), "sharded_seconds": round(sharded_s, 2)},
        "range": {"cosine": RANGE_COSINE, "pairs": len(i0),
                  "identical": bool(np.array_equal(lims, l0) and np.array_equal(i, i0)
                                    and np.array_equal(d.view(np.uint32), d0.view(np.uint32))),
                  "flat_seconds": round(range_flat_s, 2), "sharded_seconds": round(range_sharded_s, 2),
                  "cells": rinfo["cells"]}}
    print(f"sharded_search: exact top-{K}: {out['exact']['knn']}", flush=True)
    print(f"sharded_search: exact range: {out['exact']['range']}", flush=True)
    out["faiss_numerics"] = numerics(x, xq, D0)
    print(f"sharded_search: FAISS's numerics: {out['faiss_numerics']}", flush=True)

    out["approximate"] = {}
    for kind in ("ivf", "hnsw"):
        t0 = time.perf_counter()
        one = build_index(x, kind=kind, use_gpu=False)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, I1 = one.search(xq, K - 1)
        search_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, I2, _ = S.knn(xq, x, K - 1, settings, index={"kind": kind})
        sharded_s = time.perf_counter() - t0
        out["approximate"][kind] = {
            "one_index": {"recall@10": round(recall(I1, I0, 10), 3), "recall@500": round(recall(I1, I0, 500), 3),
                          "build_seconds": round(build_s, 1), "search_seconds": round(search_s, 1)},
            "sharded": {"recall@10": round(recall(I2, I0, 10), 3), "recall@500": round(recall(I2, I0, 500), 3),
                        "build_and_search_seconds": round(sharded_s, 1)}}
        print(f"sharded_search: {kind}: {out['approximate'][kind]}", flush=True)
    out["machine"]["load_average_start_end"] = [round(load0[0], 1), round(os.getloadavg()[0], 1)]
    return out


if __name__ == "__main__":
    from care.data.io import write_json
    from care.paths import PROJECT_ROOT

    result = run(_args(sys.argv[1:]))
    write_json(PROJECT_ROOT / "bench" / "results" / "sharded_search.json", result)
    print(json.dumps(result, indent=2))
