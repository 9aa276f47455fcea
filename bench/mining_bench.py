"""Mining benchmark on real shared texts: `run() -> dict`.

Examples: the first 2,000 cEpilepsyQA train questions -> their answers (pool "answers") and the first
2,000 cMedQQ train paraphrase pairs (pool "questions"), mined with the configured encoder (me5_small;
its vectors come from the embedding cache after the first run, so this measures mining, not encoding).
Reported per similarity mode:
- `mining_over_raw_search`, the headline figure: mining's FAISS search plus its window selection
  (data_pipeline.negatives.PoolMiner.mine_all) over a raw FAISS search of the same vectors (flat inner
  product, same k), both timed in the same run: what the window, exclusion and fallback logic costs on
  top of the search;
- mining wall time (also reading the vectors from the cache) and examples/s, its split, the raw search.
The machine is shared (2 cores, other jobs): each mode is timed `REPEATS` times, mining and raw search
alternating, and the medians are reported, with every repeat's ratio and the load average around them.
The window is the encoder's calibrated one (model.thresholds) when it has one, else the 50th-95th
percentile of its top-K neighbour similarities, flagged as such.
"""

from __future__ import annotations

import csv
import os
import statistics
import time

import faiss
import numpy as np

from care.config import load_config
from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache
from care.paths import shared_data
from data_pipeline import mining
from data_pipeline.mining_window import mining_window

REPEATS = 5


def real_examples() -> tuple[list[dict], dict[str, str]]:
    folder = shared_data() / "cepilepsyqa"
    with open(folder / "question.csv", encoding="utf-8") as fh:
        questions = {r["question_id"]: r["content"] for r in csv.DictReader(fh)}
    held = set()
    for split in ("dev", "test"):
        with open(folder / f"{split}_candidates.txt", encoding="utf-8") as fh:
            held |= {r["question_id"] for r in csv.DictReader(fh)}
    texts, examples = {}, []
    with open(folder / "answer.csv", encoding="utf-8") as fh:
        for a in csv.DictReader(fh):
            if a["question_id"] not in held and len(examples) < 2000:
                q, d = f"q:{a['question_id']}", f"a:{a['ans_id']}"
                texts[q], texts[d] = questions[a["question_id"]], a["content"]
                examples.append({"query_id": q, "pos_ids": [d], "pool": "answers"})
    with open(shared_data() / "chineseblue_cmedqq" / "train.txt", encoding="utf-8") as fh:
        pairs = [r for r in csv.reader(fh, delimiter="\t") if r[0] == "1"][:2000]
    for k, (_, q1, q2) in enumerate(pairs):
        texts[f"qq1:{k}"], texts[f"qq2:{k}"] = q1, q2
        examples.append({"query_id": f"qq1:{k}", "pos_ids": [f"qq2:{k}"], "pool": "questions"})
    return examples, texts


def median(reps: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in reps)


def run() -> dict:
    cfg = load_config("data_pipeline")
    opts = {**dict(cfg.mine), "cache": None}
    encoder = build_encoder(cfg.model)
    cache = EmbeddingCache(cfg.mine.cache)
    examples, texts = real_examples()
    pools = {p: [e for e in examples if e["pool"] == p] for p in ("answers", "questions")}
    try:
        window = mining_window(cfg)
    except ValueError:
        q = mining.encode(encoder, [texts[e["query_id"]] for e in pools["answers"]], "query", 64, cache)
        index = faiss.IndexFlatIP(q.shape[1])
        index.add(q)
        sims = index.search(q, min(opts["top_k"], len(q)))[0][:, 1:]
        window = {
            "lo": round(float(np.quantile(sims, 0.5)), 3),
            "hi": round(float(np.quantile(sims, 0.95)), 3),
            "source": "bench only: 50th-95th percentile of top-K similarities (no calibrated window)",
        }
    result = {
        "encoder": cfg.model.name,
        "window": window,
        "top_k": opts["top_k"],
        "examples": len(examples),
        "pools": {p: len(v) for p, v in pools.items()},
        "modes": {},
    }
    result["load_before"] = [round(x, 2) for x in os.getloadavg()]
    for mode in ("question", "document"):
        opts["similarity"] = mode
        reps = []
        for _ in range(REPEATS):
            timing = {"encode": 0.0, "search": 0.0, "select": 0.0}
            start = time.perf_counter()
            for pool in pools.values():
                mining.mine_pool(pool, texts, encoder, {}, set(), opts, window, cache, timing)
            wall = time.perf_counter() - start
            raw = 0.0  # the same vectors (cached now), the same index type and k, nothing else
            for pool in pools.values():
                q = mining.encode(encoder, [texts[e["query_id"]] for e in pool], "query", 64, cache)
                if mode == "question":
                    d = q
                else:
                    docs = list(dict.fromkeys(p for e in pool for p in e["pos_ids"]))
                    d = mining.encode(encoder, [texts[t] for t in docs], "document", 64, cache)
                t0 = time.perf_counter()
                index = faiss.IndexFlatIP(d.shape[1])
                index.add(d)
                index.search(q, min(opts["top_k"] + (mode == "question"), len(d)))
                raw += time.perf_counter() - t0
            reps.append({"wall": wall, "raw": raw, **timing})

        ratios = [(r["search"] + r["select"]) / max(r["raw"], 1e-9) for r in reps]
        wall = median(reps, "wall")
        result["modes"][mode] = {
            # Per repeat, mining and the raw search ran back to back: their ratio, then the median.
            "mining_over_raw_search": round(statistics.median(ratios), 2),
            "mining_over_raw_search_each_repeat": [round(x, 2) for x in ratios],
            "raw_faiss_search_s": round(median(reps, "raw"), 3),
            "mining_s": round(wall, 3),
            "of_which": {k: round(median(reps, k), 3) for k in ("encode", "search", "select")},
            "ratio_mining_vs_raw_search": round(wall / max(median(reps, "raw"), 1e-9), 2),
            "examples_per_s": round(len(examples) / wall, 1),
            "repeats": REPEATS,
        }
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    result["embedding_cache"] = {"hits": cache.hits, "misses": cache.misses}
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2, ensure_ascii=False))
