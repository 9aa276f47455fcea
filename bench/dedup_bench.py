"""Dedup benchmark on real shared texts (cEpilepsyQA answers and questions): `run() -> dict`.

- throughput (texts/s) of each stage: exact and MinHash on every text, semantic (encoding + FAISS search)
  on a sample, with the configured encoder (me5_small by default; no embedding cache, so it measures encoding);
- MinHash recall on planted near duplicates (ground truth: the generator's exact Jaccard) and precision
  (share of merged pairs whose exact Jaccard, recomputed here, reaches the threshold);
- the character n-gram choice: share of one-character edits that keep Jaccard >= 0.8, bigrams vs trigrams;
- datasketch MinHash.bulk vs one MinHash per text (time ratio).
"""
from __future__ import annotations

import random
import time

import numpy as np
from datasketch import MinHash

from care.config import load_config
from data_pipeline.dedup.clusters import clusters_from_edges
from data_pipeline.dedup.exact import exact_clusters
from data_pipeline.dedup.minhash import jaccard, minhash_pairs, shingles
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.planted import edit_until, plant, shared_texts


def _rate(n: int, seconds: float) -> float:
    return round(n / max(seconds, 1e-9), 1)


def planted_recall(texts: list[str], ngram: int, threshold: float, seed: int = 0) -> dict:
    rows, pairs = plant(texts, n_exact=0, n_variant=0, n_near=1000, ngram=ngram, near_range=(0.6, 1.0), seed=seed)
    norm = Normalizer()
    normed = [norm(r["text"]) for r in rows]
    res = minhash_pairs(normed, ngram=ngram, threshold=threshold, show_progress=False)
    label = np.arange(len(rows))
    for c in clusters_from_edges(len(rows), res.rows, res.cols, res.sims):
        label[c.removed] = c.kept
    pos = {r["id"]: i for i, r in enumerate(rows)}
    hi = [p for p in pairs if p.jaccard >= threshold]
    found = sum(label[pos[p.original]] == label[pos[p.copy]] for p in hi)
    exact_ok = sum(jaccard(shingles(normed[a], ngram), shingles(normed[b], ngram)) >= threshold
                   for a, b in zip(res.rows, res.cols))
    return {"planted_pairs_at_or_above_threshold": len(hi), "recall": round(found / max(len(hi), 1), 4),
            "merged_pairs": len(res.sims), "precision": round(exact_ok / max(len(res.sims), 1), 4),
            "candidate_pairs": res.candidates, "bands": res.bands, "rows_per_band": res.rows_per_band}


def ngram_choice(texts: list[str], seed: int = 0) -> dict:
    """Share of single-character edits that keep Jaccard >= 0.8, by text length, for n = 2 and 3."""
    rng = random.Random(seed)
    alphabet = sorted({c for t in texts for c in t if not c.isspace()})
    out = {}
    for lo, hi in ((0, 30), (30, 100), (100, 10 ** 6)):
        sample = [t for t in texts if lo <= len(t) < hi][:500]
        for n in (2, 3):
            # one edit: a target above any reachable Jaccard stops after the first change
            kept = [edit_until(t, 0.999999, n, alphabet, rng)[1] >= 0.8 for t in sample if len(t) > n]
            out[f"len[{lo},{hi}) n={n}"] = round(float(np.mean(kept)), 3)
    return out


def bulk_vs_loop(texts: list[str], num_perm: int = 128) -> dict:
    data = [[s.encode("utf-8") for s in shingles(t, 2)] for t in texts]
    t0 = time.perf_counter()
    MinHash.bulk(data, num_perm=num_perm, seed=1)
    bulk = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d in data:
        m = MinHash(num_perm=num_perm, seed=1)
        m.update_batch(d)
    loop = time.perf_counter() - t0
    return {"texts": len(texts), "bulk_s": round(bulk, 3), "per_object_s": round(loop, 3),
            "per_object_over_bulk": round(loop / bulk, 2)}


def run(model: str = "me5_small", semantic_sample: int = 300) -> dict:
    norm = Normalizer()
    texts = shared_texts()
    normed = [norm(t) for t in texts]
    out: dict = {"texts": len(texts), "stages": {}}

    t0 = time.perf_counter()
    exact_clusters(normed)
    out["stages"]["exact"] = {"texts": len(texts), "texts_per_s": _rate(len(texts), time.perf_counter() - t0)}
    t0 = time.perf_counter()
    res = minhash_pairs(normed, ngram=2, threshold=0.8, show_progress=False)
    out["stages"]["minhash"] = {"texts": len(texts), "texts_per_s": _rate(len(texts), time.perf_counter() - t0),
                                "verified_pairs": len(res.sims)}

    from care.encoders import build_encoder
    from data_pipeline.dedup.semantic import cosine_pairs

    cfg = load_config("data_pipeline", [f"model={model}"])
    encoder = build_encoder(cfg.model)
    sample = random.Random(0).sample(texts, min(semantic_sample, len(texts)))
    t0 = time.perf_counter()
    vectors = encoder.encode_documents(sample, batch_size=32).dense
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cosine_pairs(vectors, 0.98, show_progress=False)
    search_s = time.perf_counter() - t0
    out["stages"]["semantic"] = {"encoder": encoder.name, "texts": len(sample),
                                 "median_chars": float(np.median([len(t) for t in sample])),
                                 "encode_texts_per_s": _rate(len(sample), enc_s),
                                 "search_texts_per_s": _rate(len(sample), search_s),
                                 "texts_per_s": _rate(len(sample), enc_s + search_s)}

    out["minhash_planted"] = planted_recall(random.Random(1).sample(texts, 3000), ngram=2, threshold=0.8)
    out["ngram_one_edit_keeps_j_0.8"] = ngram_choice(normed)
    out["minhash_bulk_vs_per_object"] = bulk_vs_loop([t for t in normed if len(t) < 40][:5000])
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2, ensure_ascii=False))
