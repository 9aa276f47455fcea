"""Evaluation benchmark on real data: `run() -> dict`.

On a slice of the open stand-in Retrieval slot (KUAKE-QTR dev queries against KUAKE-QTR titles: the first
`QUERIES` queries, their judged titles and the first other titles up to `DOCS`), with the configured model
(evaluate.yaml's, me5_small by default):

- evaluation throughput (queries/s, documents/s) of a full retrieval run with a cold embedding cache;
- the raw encoding of the same texts (Encoder.encode_queries / encode_documents, no cache, no search, no
  metrics) timed in the same run: overhead = evaluation time / raw encoding time;
- the same evaluation again with the cache warm: speed-up = cold / warm;
- the warm evaluation with the cache's per-read digest check (care/encoders/cache_chunks.py) and without it, in
  alternation, median of `REPEATS`: what verifying every chunk costs a cached re-run (goal <= 1.10);
- BM25 (bm25s + jieba) on the same slice, for scale.
"""
from __future__ import annotations

import tempfile
import time

from omegaconf import OmegaConf

from care.config import load_config
from care.data.tasks import TaskData, load_task
from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache
from care.evaluation.tasks import run_retrieval
from care.retrieval.bm25 import BM25Scorer
from care.retrieval.scorer import EncoderScorer
from data_pipeline.benchmarks import build

QUERIES, DOCS = 100, 2000
REPEATS = 9
METRICS = ["ndcg_cut_10", "recall_100"]


def task_slice(cfg) -> TaskData:
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    build("cmedteb_open", data_cfg, cfg.data_dir)
    full = load_task("retrieval", cfg.benchmark.tasks.retrieval.path, split="dev")
    qids = list(full.queries)[:QUERIES]
    judged = list(dict.fromkeys(d for q in qids for d in full.qrels[q]))
    docs = list(dict.fromkeys(judged + list(full.docs)))[:max(DOCS, len(judged))]
    return TaskData("retrieval", full.path, queries={q: full.queries[q] for q in qids},
                    docs={d: full.docs[d] for d in docs}, qrels={q: full.qrels[q] for q in qids})


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def digest_check_ratio(data: TaskData, encoder, cache_dir: str, cfg) -> dict:
    """Median warm evaluation time with the chunk digests checked on every read, and with the check
    replaced by a no-op (the cost the digests add), alternating so load drifts hit both alike."""
    import statistics

    from care.encoders import cache_chunks

    checked, unchecked = [], []
    real = cache_chunks._mismatch
    for _ in range(REPEATS):
        for times, check in ((checked, real), (unchecked, lambda *a, **k: None)):
            cache_chunks._mismatch = check
            try:
                scorer = EncoderScorer(encoder, EmbeddingCache(cache_dir), batch_size=cfg.batch_size,
                                       show_progress=False)
                times.append(_timed(lambda s=scorer: run_retrieval(data, s, METRICS, depth=cfg.depth))[1])
            finally:
                cache_chunks._mismatch = real
    a, b = statistics.median(checked), statistics.median(unchecked)
    return {"eval_cached_checked_s": round(a, 3), "eval_cached_unchecked_s": round(b, 3),
            "digest_check_ratio": round(a / b, 3)}


def run() -> dict:
    cfg = load_config("evaluate")
    data = task_slice(cfg)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["max_length"] = min(model.get("max_length", 512), cfg.max_length)
    encoder = build_encoder(model)
    queries, docs = list(data.queries.values()), list(data.docs.values())

    _, raw_q = _timed(lambda: encoder.encode_queries(queries, batch_size=cfg.batch_size))
    _, raw_d = _timed(lambda: encoder.encode_documents(docs, batch_size=cfg.batch_size))
    with tempfile.TemporaryDirectory() as tmp:
        scorer = EncoderScorer(encoder, EmbeddingCache(tmp), batch_size=cfg.batch_size, show_progress=False)
        scores, cold = _timed(lambda: run_retrieval(data, scorer, METRICS, depth=cfg.depth))
        again, warm = _timed(lambda: run_retrieval(data, scorer, METRICS, depth=cfg.depth))
        digests = digest_check_ratio(data, encoder, tmp, cfg)
    bm25, bm25_s = _timed(lambda: run_retrieval(data, BM25Scorer(), METRICS, depth=cfg.depth))
    return {
        "model": model["name"], "max_length": model["max_length"], "batch_size": cfg.batch_size,
        "queries": len(queries), "docs": len(docs), "depth": cfg.depth,
        "eval_cold_s": round(cold, 2), "queries_per_s": round(len(queries) / cold, 1),
        "docs_per_s": round(len(docs) / cold, 1),
        "raw_encode_s": round(raw_q + raw_d, 2), "overhead_ratio": round(cold / (raw_q + raw_d), 3),
        "eval_cached_s": round(warm, 2), "cached_speedup": round(cold / warm, 1),
        "cached_scores_identical": again == scores, **digests,
        "scores": scores["dense"], "bm25_s": round(bm25_s, 2), "bm25_scores": bm25["bm25"],
    }
