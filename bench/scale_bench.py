"""`make bench-scale`: the data pipeline's search stages at the size of the full cMedQA2 release and a cost
model beyond it.  Writes bench/results/scale.json (docs/scale.md).

Texts: the import stage's 204,583 real texts plus planted near duplicates (data_pipeline/planted.py) up to
226,000.  Vectors: multilingual-e5-small's document vectors where the embedding cache already has them
(evaluation and the nano stage put ~90K there), random unit vectors for the rest (the search costs the same
for any vectors of a width), and random unit vectors at 1,024 dimensions (BGE-M3's width).

Measured, each in a fresh subprocess (so its peak resident memory is its own), at N/4, N/2 and N:
- exact dedup (normalised MD5) and MinHash dedup (shingle + hash + LSH + exact-Jaccard verify);
- the semantic range search (cosine >= the me5 cut, the dedup stage's blocked FAISS range search) and
  the mining top-500 search (flat inner product), both on a fixed sample of query rows: exact search costs
  queries x N, so the whole self-join is the sample's time x N / sample (checked at N/4, where the full
  self-join is also run);
- at N: IVF and HNSW indexes (care/retrieval/index.py build_index) against flat: build time, search time
  and recall@10 / recall@500 of the same queries, on the real me5 vectors (random ones have no
  neighbourhood structure, so recall on them means nothing; the 1,024-d random run times builds only).
Each stage's growth exponent is fitted on the three sizes (time ~ N^k); the report extrapolates to 1M and
10M texts on this CPU, and for one GPU from the datasheet FP32 peak (docs/facts.md s.9) at an assumed 50%
efficiency, which is an estimate, not a measurement.
"""
from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time

import numpy as np

N_FULL = 226_000
QUERY_SAMPLE = 2_000
TOP_K = 500
ME5_CUT = 0.98            # conf/model/me5_small.yaml thresholds.dedup_cosine
GPU_FP32_FLOPS = 67e12    # H100 SXM FP32 peak, docs/facts.md s.9
GPU_EFFICIENCY = 0.5      # assumed
SIZES = (N_FULL // 4, N_FULL // 2, N_FULL)


def _texts(n: int) -> list[str]:
    """n real texts (the import store, in its order), topped up with planted near duplicates."""
    from care.data.io import read_text_store
    from care.paths import outputs_dir
    from data_pipeline.planted import plant

    store = outputs_dir() / "data" / "import" / "texts.jsonl"
    if not store.is_file():
        raise FileNotFoundError(f"{store} is missing: run `python -m data_pipeline stage=import` first "
                                "(make bench-scale does)")
    texts = list(read_text_store(store).values())
    if n > len(texts):
        rows, _ = plant(random.Random(0).sample(texts, 20_000), n_exact=0, n_variant=0,
                        n_near=n - len(texts), ngram=2, near_range=(0.6, 1.0), seed=0)
        texts += [r["text"] for r in rows if "-near" in r["id"]][: n - len(texts)]
    return texts[:n]


def _vectors(n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors: me5's cached document vectors for the texts the cache holds (dim 384), random rows
    for the rest; and which rows are real."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, dim), dtype=np.float32)
    found = np.zeros(n, dtype=bool)
    if dim == 384:
        from care.config import load_config
        from care.encoders import build_encoder
        from care.encoders.cache import EmbeddingCache
        from care.evaluation.corpora import evaluation_model

        app = load_config("evaluate")
        model = evaluation_model(dict(app.model), 256)
        fingerprint = build_encoder(model).side_fingerprint("document", "retrieval")
        found, dense = EmbeddingCache(app.cache.dir).lookup(fingerprint, "document", ("dense",), _texts(n))
        x[found] = dense
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, found


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(what: str, n: int, dim: int = 384) -> dict:
    """One measurement in this process: seconds and peak memory above what loading the inputs took."""
    from care.retrieval.index import build_index, flat_index
    from data_pipeline.dedup.exact import exact_clusters
    from data_pipeline.dedup.minhash import minhash_pairs
    from data_pipeline.dedup.normalize import Normalizer
    from data_pipeline.dedup.semantic import cosine_pairs

    out: dict = {"what": what, "n": n, "dim": dim}
    if what in ("exact", "minhash"):
        normed = [Normalizer()(t) for t in _texts(n)]
        base, t0 = _peak_mb(), time.perf_counter()
        if what == "exact":
            out["clusters"] = len(exact_clusters(normed))
        else:
            out["pairs"] = len(minhash_pairs(normed, ngram=2, threshold=0.8, show_progress=False).sims)
    else:
        x, real = _vectors(n, dim)
        out["real_vectors"] = int(real.sum())
        if what == "ann_real":  # recall means something only where neighbours exist: real vectors only
            x, n = x[real], int(real.sum())
            out["n_real"] = n
            if n < 1000:  # a fresh clone's cache is empty until evaluate.py or the nano stage has run
                return {**out, "skipped": "fewer than 1,000 me5 vectors in the embedding cache: run "
                                          "`python evaluate.py` (or make run) first, then make bench-scale"}
        queries = x[np.random.default_rng(1).choice(n, size=min(QUERY_SAMPLE, n), replace=False)]
        base, t0 = _peak_mb(), time.perf_counter()
        if what == "semantic":      # the blocked range search of the dedup stage, over a query sample
            index = flat_index(x)
            lims, _, _ = index.range_search(queries, ME5_CUT)
            out["pairs_in_sample"] = int(lims[-1])
        elif what == "semantic_full":
            out["pairs"] = len(cosine_pairs(x, ME5_CUT, show_progress=False).sims)
        elif what == "mining":
            flat_index(x).search(queries, TOP_K)
        else:                       # ann / ann_real: flat vs ivf vs hnsw at this size
            truth = flat_index(x).search(queries, TOP_K)[1]
            out["indexes"] = {}
            for kind in ("ivf", "hnsw"):
                t1 = time.perf_counter()
                index = build_index(x, kind)
                built = time.perf_counter() - t1
                t1 = time.perf_counter()
                found = index.search(queries, TOP_K)[1]
                searched = time.perf_counter() - t1
                out["indexes"][kind] = {
                    "build_s": round(built, 2), "search_s": round(searched, 2),
                    "recall_at_10": round(float(np.mean([len(set(a[:10]) & set(b[:10])) / 10
                                                         for a, b in zip(found, truth)])), 4),
                    "recall_at_500": round(float(np.mean([len(set(a) & set(b)) / TOP_K
                                                          for a, b in zip(found, truth)])), 4)}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    # ru_maxrss is the process's high-water mark: the stage's own peak shows above the inputs' only when it
    # exceeds what loading them took, so the absolute peak and the inputs' size are reported too.
    out["peak_mb"] = round(max(_peak_mb() - base, 0.0), 1)
    out["peak_rss_mb"], out["inputs_peak_rss_mb"] = round(_peak_mb(), 1), round(base, 1)
    if what not in ("exact", "minhash"):
        out["vectors_mb"] = round(x.nbytes / 2**20, 1)
    if what in ("semantic", "mining"):
        out["queries"] = len(queries)
        out["full_seconds"] = round(out["seconds"] * n / len(queries), 1)  # exact search: linear in queries
    return out


def _run(what: str, n: int, dim: int = 384) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.scale_bench", "--measure", what, str(n), str(dim)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"scale bench {what} at {n}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fit(rows: list[dict], key: str) -> dict:
    """time ~ c N^k on the measured sizes; the extrapolation to 1M and 10M on this CPU."""
    n = np.array([r["n"] for r in rows], dtype=float)
    t = np.array([r[key] for r in rows], dtype=float)
    k, log_c = np.polyfit(np.log(n), np.log(np.maximum(t, 1e-3)), 1)
    at = {size: float(np.exp(log_c) * size ** k) for size in (1_000_000, 10_000_000)}
    return {"exponent": round(float(k), 2), "seconds_1M": round(at[1_000_000], 1),
            "seconds_10M": round(at[10_000_000], 1)}


def cost_model(result: dict) -> dict:
    """Per stage: the fitted exponent and, for the exact searches, the quadratic model of a whole self-join
    (every text a query: 2 N^2 d flops at the throughput measured at N), on this CPU and on one GPU."""
    out = {}
    for name, rows in result["stages"].items():
        what = name.split("_")[0]
        key = "full_seconds" if what in ("semantic", "mining") else "seconds"
        model = _fit(rows, key)
        if what in ("semantic", "mining"):
            last, dim = rows[-1], rows[-1]["dim"]
            gflops = 2.0 * last["queries"] * last["n"] * dim / last["seconds"] / 1e9
            model.update(achieved_gflops=round(gflops, 1), **{
                f"self_join_seconds_{label}": round(2.0 * n * n * dim / (gflops * 1e9), 1)
                for label, n in (("226K", N_FULL), ("1M", 1_000_000), ("10M", 10_000_000))},
                **{f"gpu_estimate_seconds_{label}": round(_gpu_seconds(n, dim), 1)
                   for label, n in (("1M", 1_000_000), ("10M", 10_000_000))})
        out[name] = model
    return out


def _gpu_seconds(n: int, dim: int) -> float:
    """An exact self-join's flops (2 N^2 d) at the datasheet peak x the assumed efficiency."""
    return 2.0 * n * n * dim / (GPU_FP32_FLOPS * GPU_EFFICIENCY)


def run() -> dict:
    out: dict = {"n": N_FULL, "sizes": list(SIZES), "query_sample": QUERY_SAMPLE, "stages": {}, "model": {}}
    plan = [("exact", 384), ("minhash", 384), ("semantic", 384), ("mining", 384), ("mining", 1024)]
    for what, dim in plan:
        name = what if dim == 384 else f"{what}_{dim}d"
        rows = []
        for n in SIZES:
            rows.append(_run(what, n, dim))
            print(f"scale: {name} at {n:,}: {rows[-1]['seconds']} s, peak {rows[-1]['peak_mb']} MB", flush=True)
        out["stages"][name] = rows
    out["check_linear_in_queries"] = {"semantic_full_at_quarter": _run("semantic_full", SIZES[0]),
                                      "semantic_sampled_at_quarter": out["stages"]["semantic"][0]}
    # Random unit vectors have no neighbourhood structure (every point nearly equidistant in 384-d), so an
    # approximate index's recall on them says nothing: recall is measured on the real me5 vectors only;
    # the 1,024-d run (random) times the builds and searches.
    out["approximate_at_full"] = {"384_real": _run("ann_real", N_FULL, 384), "1024_random": _run("ann", N_FULL, 1024)}
    out["model"] = cost_model(out)
    return out


if __name__ == "__main__":
    from care.data.io import write_json
    from care.paths import PROJECT_ROOT

    results = PROJECT_ROOT / "bench" / "results" / "scale.json"
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "--model":  # the cost model again, from the measured rows
        result = json.loads(results.read_text(encoding="utf-8"))
        result["model"] = cost_model(result)
        write_json(results, result)
        print(json.dumps(result["model"], indent=2))
    else:
        result = run()
        write_json(results, result)
        print(json.dumps(result["model"], indent=2))
