"""Stage "mine": hard negatives for every training example, from a similarity window (docs/pipeline.md,
"The stages", for the files it writes).

The recipe (bge-m3-medical-cn, docs/facts.md s.1): encode, take each query's top-K neighbours with FAISS
(care.retrieval.index: exact inner product over L2-normalised vectors, on GPUs when faiss-gpu sees any),
keep the candidates whose similarity lies in [lo, hi): below lo they are easy, at or above hi likely
unlabelled positives.  Which candidates may be a negative, and the fallback when the window holds too few,
is data_pipeline.negatives.  The window, and the optional positive-aware rules (mine.relative_margin,
absolute_margin, max_score; conf/mine/default.yaml) that lower each example's top below hi from its
positives' similarity, are data_pipeline.mining_window; every row of train.jsonl carries that similarity
per positive as `pos_scores`.  Embeddings go through the on-disk cache (care.encoders.cache), so a
re-run with another window costs no encoding; a run whose inputs, encoder weights and config are
unchanged is skipped.
"""
from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.data.examples import read_example_rows, write_examples
from care.data.io import read_jsonl, read_text_store, save_histogram, write_json, write_jsonl
from care.data.stage_cache import fingerprint
from care.data.stage_start import stage_start
from care.encoders import Encoder, build_encoder
from care.encoders.cache import EmbeddingCache, embed
from care.encoders.prompts import legacy_keyed
from care.families import require
from care.models.hub import weights_digest
from care.retrieval.index import build_index, unit_rows
from data_pipeline.build import export_flag
from data_pipeline.dedup.clusters import clusters_from_edges
from data_pipeline.distributed.search import search_identity, stage_settings
from data_pipeline.judge import JUDGE_KEYS, judge_identity, judge_rows, judge_spec
from data_pipeline.mining_window import (
    RULES,
    mining_window,
    positive_aware_stats,
    positive_rules,
    positive_scores,
    rule_thresholds,
)
from data_pipeline.negatives import Mined, PoolMiner

SIMILARITY = ("question", "document")
FORMAT = 2  # of the files this stage writes; 2: pos_scores in train.jsonl, teacher-only scores in flag_train.jsonl
OUTPUTS = ("train.jsonl", "texts.jsonl", "flag_train.jsonl", "leakage.json", "neg_similarity.png", "stats.json")


def read_examples(path: Path, texts: dict[str, str]) -> list[dict]:
    """The build stage's examples (care.data.examples: one reader of the format), each naming its pool."""
    return [ex for _, ex in read_example_rows(path, texts, need=("pool",))]


def read_clusters(path: Path | None) -> tuple[dict[str, int], set[str]]:
    """(text id -> cluster number, ids the dedup stage removed).  A chain across dedup stages (a kept by
    exact dedup, then merged into b by MinHash) is one cluster: connected components of kept-removed edges."""
    if path is None:
        return {}, set()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the dedup stage first, or pass "
                                "mine.dedup_clusters=null to mine without excluding a positive's duplicates")
    ids: dict[str, int] = {}
    edges, removed = [], set()
    for row in read_jsonl(path, ("kept_id", "removed_ids")):
        kept = ids.setdefault(row["kept_id"], len(ids))
        for r in row["removed_ids"]:
            edges.append((kept, ids.setdefault(r, len(ids))))
            removed.add(r)
    names = list(ids)
    cluster_of = {}
    for n, c in enumerate(clusters_from_edges(len(names), *zip(*edges), [1.0] * len(edges)) if edges else []):
        for pos in [c.kept, *c.removed]:
            cluster_of[names[pos]] = n
    return cluster_of, removed


def encode(encoder: Encoder, texts: list[str], side: str, batch_size: int,
           cache: EmbeddingCache | None) -> np.ndarray:
    """Unit rows, so scores are cosines whatever the encoder's own normalisation (CARE truncates after it)."""
    return unit_rows(embed(encoder, texts, side, cache, batch_size).dense)


@dataclass
class PoolResult:
    mined: list[Mined]
    neighbour_sims: np.ndarray    # every top-K neighbour similarity (for the histogram)
    pos_scores: list[list[float]]  # per example, aligned with its pos_ids
    removed: dict[str, int]        # what the positive-aware rules removed (stats.json "positive_aware")


def search(queries: np.ndarray, cands: np.ndarray, k: int, opts: dict, sharded=None,
           log: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each query's top k candidates: one FAISS index here (flat = exact, moved to the GPUs when faiss-gpu sees
    any; mine.index picks IVF or HNSW), or with mine.engine=sharded the same search as tasks of mine.executor
    (data_pipeline/distributed/search.py: a flat search's ids and scores bitwise one CPU index's), its
    figures appended to `log`."""
    if sharded is None:
        return build_index(cands, **(opts.get("index") or {})).search(queries, k)
    from data_pipeline.distributed.search import knn

    scores, ids, info = knn(queries, cands, k, sharded, index=opts.get("index"))
    if log is not None:
        log.append(info)
    return scores, ids


def mine_pool(examples: list[dict], texts: dict[str, str], encoder: Encoder, cluster_of: dict[str, int],
              removed: set[str], opts: dict, window: dict, cache: EmbeddingCache | None,
              timing: dict, sharded=None, log: list | None = None) -> PoolResult:
    """Negatives for every example of one pool, its positives' similarities and what the rules removed;
    `sharded`, `log`: the search's (`search`)."""
    miner = PoolMiner(examples, texts, cluster_of, removed, opts["similarity"])
    t0 = time.perf_counter()
    queries = encode(encoder, [texts[ex["query_id"]] for ex in examples], "query", opts["batch_size"], cache)
    if opts["similarity"] == "question":
        cands = queries
    else:
        cands = encode(encoder, [texts[d] for d in miner.docs], "document", opts["batch_size"], cache)
    t1 = time.perf_counter()
    # +1: in question mode each query comes back as its own nearest neighbour (its positives are excluded).
    k = min(opts["top_k"] + (opts["similarity"] == "question"), len(cands))
    scores, neighbours = search(queries, cands, k, opts, sharded, log)
    t2 = time.perf_counter()
    pos_scores = positive_scores(
        examples, getattr(miner, "docs", []), queries, cands, opts["similarity"],
        lambda ids: encode(encoder, [texts[d] for d in ids], "document", opts["batch_size"], cache))
    thresholds = rule_thresholds(positive_rules(opts), np.array([min(p) for p in pos_scores]))
    cap = np.minimum.reduce(list(thresholds.values())) if thresholds else None
    rng = random.Random(opts["seed"])
    lo, hi = window["lo"], window["hi"]
    mined = miner.mine_all(scores, neighbours, lambda i: cands @ queries[i], lo, hi, opts["max_negatives"],
                           opts["min_negatives"], list(opts["fallback"]), rng, cap=cap)
    counts = {}
    if thresholds:
        above = miner.count_above(scores, neighbours, lo, hi, {**thresholds, "removed_any": cap})
        counts = {name: int(c.sum()) for name, c in above.items()}
        counts["examples_affected"] = int((above["removed_any"] > 0).sum())
    timing["encode"] += t1 - t0
    timing["search"] += t2 - t1
    timing["select"] += time.perf_counter() - t2
    return PoolResult(mined, scores[neighbours >= 0], pos_scores, counts)


def plot_histogram(path: Path, neighbour_sims: np.ndarray, kept: list[float], filled: list[float],
                   window: dict, title: str, bins: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lo, hi = window["lo"], window["hi"]
    span = np.concatenate([neighbour_sims, [lo, hi]])
    bottom, top = max(span.min() - 0.02, -1.0), min(span.max() + 0.02, 1.0)
    width = (hi - lo) / max(1, round(bins * (hi - lo) / (top - bottom)))  # lo and hi fall on bin edges
    edges = lo + width * np.arange(np.floor((bottom - lo) / width), np.ceil((top - lo) / width) + 1)
    ax.hist(neighbour_sims, bins=edges, color="0.75", label=f"top-K neighbours ({len(neighbour_sims):,})")
    ax.hist(np.asarray(kept), bins=edges, color="tab:blue", alpha=0.8,
            label=f"stored negatives in the window ({len(kept):,})")
    if filled:
        ax.hist(np.asarray(filled), bins=edges, color="tab:orange", alpha=0.8,
                label=f"fallback negatives ({len(filled):,})")
    ax.axvspan(lo, hi, color="tab:red", alpha=0.08)
    ax.axvline(lo, color="tab:red", linestyle="--", label=f"window [{lo:g}, {hi:g})")
    ax.axvline(hi, color="tab:red", linestyle="--")
    ax.set_yscale("log")
    save_histogram(fig, ax, path, title, "similarity to the query (cosine)", "count")


def run(cfg: DictConfig) -> dict:
    require(cfg.model, "the mine stage", one_backbone=True)  # dense vectors, keyed by one weights folder
    opts = OmegaConf.to_container(cfg.mine, resolve=True)
    if opts["similarity"] not in SIMILARITY:
        raise ValueError(f"mine.similarity must be one of {SIMILARITY}, not {opts['similarity']!r}")
    positive_rules(opts)  # checked before any work
    judge = judge_spec(opts, cfg)  # mine.judge (data_pipeline/judge.py): None when off
    window = mining_window(cfg)
    in_dir, out_dir = Path(opts["input_dir"]), Path(opts["out_dir"])
    clusters_path = Path(opts["dedup_clusters"]) if opts.get("dedup_clusters") else None
    inputs = [in_dir / "examples.jsonl", in_dir / "texts.jsonl", in_dir / "leakage.json",
              *([clusters_path] if clusters_path else [])]
    model = legacy_keyed(OmegaConf.to_container(cfg.model, resolve=True))  # fingerprints predating `prompts:`
    # The weights digest, not the encoder: a skipped run should not pay for loading the model.  `format`:
    # outputs of the stage before train.jsonl had pos_scores (and flag_train.jsonl carried the miner's cosine
    # as FlagEmbedding's teacher scores) are mined again once, never kept as up to date.
    settings = {k: v for k, v in opts.items() if (k not in RULES or v is not None) and (k not in JUDGE_KEYS or judge)}
    settings = search_identity(settings)  # how the search runs (mine.engine, ...), not what it finds
    fp = fingerprint(inputs, {"mine": settings, "window": window, "model": model,
                              "weights": weights_digest(model["path"]), "format": FORMAT,
                              **({"judge": judge_identity(judge, opts, cfg)} if judge else {})})
    with stage_start(cfg, "mine", out_dir, fp, OUTPUTS) as start:
        if start.done:
            return start.skip(f"mine: inputs, encoder and config unchanged, skipped ({out_dir})")
        return _mine(cfg, opts, window, clusters_path, fp, start, judge)


def _mine(cfg: DictConfig, opts: dict, window: dict, clusters_path: Path | None, fp: str, start, judge=None) -> dict:
    """Negatives for every example, the outputs and stats.json (last)."""
    rules, in_dir, out_dir = positive_rules(opts), Path(opts["input_dir"]), start.out
    t0 = time.perf_counter()
    texts = read_text_store(in_dir / "texts.jsonl")
    examples = read_examples(in_dir / "examples.jsonl", texts)
    cluster_of, removed = read_clusters(clusters_path)
    encoder = build_encoder(cfg.model)
    cache = EmbeddingCache(opts["cache"]) if opts.get("cache") else None
    timing = {"encode": 0.0, "search": 0.0, "select": 0.0}
    sharded = stage_settings(opts, cfg.mine, cfg.cache_root, "mine")  # None: native
    engine = _encode_as_tasks(cfg, opts, examples, texts, encoder, cache, sharded) if sharded else None
    mined, pos_scores, neighbour_sims, per_pool, rule_counts = _mine_pools(
        examples, texts, encoder, cluster_of, removed, opts, window, cache, timing, sharded,
        engine["search"] if engine else None)
    rows = []
    for ex, m, p in zip(examples, mined, pos_scores):
        rows.append({"query_id": ex["query_id"], "pos_ids": ex["pos_ids"], "pos_scores": p,
                     "neg_ids": m.neg_ids, "neg_scores": m.neg_scores, "rule": ex.get("rule"),
                     "pool": ex["pool"], "fallback": m.fallback})
    judged = judge_rows(rows, texts, judge, opts, cfg) if judge else None  # after the window, before writing
    rows = judged[0] if judged else rows
    used = dict.fromkeys(t for r in rows for t in [r["query_id"], *r["pos_ids"], *r["neg_ids"]])
    start.writing()
    write_jsonl(out_dir / "texts.jsonl", ({"id": t, "text": texts[t]} for t in used))
    write_examples(out_dir / "train.jsonl", rows)
    export_flag(out_dir / "train.jsonl", out_dir / "texts.jsonl", out_dir / "flag_train.jsonl")
    write_json(out_dir / "leakage.json", json.loads((in_dir / "leakage.json").read_text("utf-8")))

    kept_scores = [s for m in mined for s in m.neg_scores[:len(m.neg_scores) - m.fallback]]
    filled_scores = [s for m in mined for s in m.neg_scores[len(m.neg_scores) - m.fallback:]]
    seconds = {k: round(v, 2) for k, v in timing.items()} | {"total": round(time.perf_counter() - t0, 2)}
    stats = {
        "stage": "mine", "fingerprint": fp, "examples": len(rows), "texts": len(used),
        "encoder": {"name": cfg.model.get("name"), "label": cfg.model.get("label"),
                    "fingerprint": encoder.fingerprint},
        "window": window, "similarity": opts["similarity"], "top_k": opts["top_k"],
        "max_negatives": opts["max_negatives"], "min_negatives": opts["min_negatives"],
        "fallback": opts["fallback"],
        "positive_aware": positive_aware_stats(rules, rule_counts),
        **({"judge": judged[1]} if judged else {}),
        "pools": per_pool,
        **_negative_counts(mined, opts["min_negatives"]),
        "dedup_clusters": str(clusters_path) if clusters_path else None,
        "dedup_texts_clustered": len(cluster_of), "dedup_texts_removed": len(removed),
        "embedding_cache": {"hits": cache.hits, "misses": cache.misses} if cache else None,
        **({"engine": engine} if engine else {}),
        "seconds": seconds, "queries_per_s": round(len(rows) / max(seconds["total"], 1e-9), 1),
    }
    title = (f"{cfg.model.get('label') or cfg.model.get('name')}: {opts['similarity']} similarity\n"
             f"window [{window['lo']:g}, {window['hi']:g}) from {window['source']}"
             + "".join(f", {name} {value:g}" for name, value in rules.items()))
    plot_histogram(out_dir / "neg_similarity.png", np.concatenate(neighbour_sims), kept_scores, filled_scores,
                   window, title, opts["histogram_bins"])
    stats = start.finish(stats)  # stats.json last: its fingerprint marks the outputs complete
    print(f"mine: {len(rows):,} examples, {stats['negatives']['total']:,} negatives "
          f"({stats['negatives']['per_example_mean']} per example); "
          f"{stats['examples_short_before_fallback']:,} had fewer than {opts['min_negatives']} in "
          f"[{window['lo']:g}, {window['hi']:g}) and got the fallback; "
          + (f"positive-aware rules removed {stats['positive_aware']['removed_any']:,} window candidates of "
             f"{stats['positive_aware']['examples_affected']:,} examples; " if rules else "")
          + f"{seconds['total']} s -> {out_dir}")
    return stats


def _negative_counts(mined: list[Mined], min_negatives: int) -> dict:
    """stats.json's counts of the negatives kept: per example, from the window and from the fallback."""
    n_negs = np.array([len(m.neg_ids) for m in mined])
    fallback = sum(m.fallback for m in mined)
    return {
        "negatives": {"total": int(n_negs.sum()), "per_example_mean": round(float(n_negs.mean()), 2),
                      "per_example_min": int(n_negs.min()), "per_example_max": int(n_negs.max()),
                      "in_window": int(n_negs.sum()) - fallback, "fallback": fallback},
        "examples_short_before_fallback": sum(m.in_window < min_negatives for m in mined),
        "examples_with_fallback": sum(m.fallback > 0 for m in mined),
        "examples_short_after_fallback": int((n_negs < min_negatives).sum()),
    }


def _encode_as_tasks(cfg: DictConfig, opts: dict, examples: list[dict], texts: dict[str, str], encoder, cache,
                     sharded) -> dict:
    """mine.engine=sharded: every text the pools encode, into the embedding cache by tasks of mine.executor
    (data_pipeline/distributed/encode_tasks.py), before mine_pool reads them back through the cache.  The
    engine's record for stats.json, its `search` list filled by the pools' searches."""
    from data_pipeline.distributed.encode_tasks import encode_as_tasks

    if cache is None:
        raise ValueError("mine.engine=sharded encodes as tasks into the embedding cache: mine.cache cannot be null")
    sides = {"query": [texts[ex["query_id"]] for ex in examples]}
    if opts["similarity"] == "document":
        sides["document"] = [texts[p] for ex in examples for p in ex["pos_ids"]]
    done = encode_as_tasks(encoder, OmegaConf.to_container(cfg.model, resolve=True), sides, cache,
                           opts["batch_size"], sharded.encode_shard, sharded)
    return {"name": "sharded", "executor": str(opts.get("executor")), "tasks": sharded.tasks, "encode": done,
            "search": []}


def _mine_pools(examples: list[dict], texts, encoder, cluster_of, removed, opts: dict, window: dict, cache,
                timing: dict, sharded=None, log: list | None = None
                ) -> tuple[list[Mined], list[list[float]], list[np.ndarray], dict, list[dict]]:
    """Each pool's examples mined against that pool's texts (mine_pool); the results back in example order,
    with each pool's similarity sample, its count of examples short of min_negatives before the fallback,
    and the positive-aware rules' removal counts."""
    pools: dict[str, list[int]] = defaultdict(list)  # pool -> positions in examples
    for i, ex in enumerate(examples):
        pools[ex["pool"]].append(i)
    mined: list[Mined | None] = [None] * len(examples)
    pos_scores: list[list[float] | None] = [None] * len(examples)
    neighbour_sims, per_pool, rule_counts = [], {}, []
    for pool, members in pools.items():
        result = mine_pool([examples[i] for i in members], texts, encoder, cluster_of, removed, opts,
                           window, cache, timing, sharded, log)
        neighbour_sims.append(result.neighbour_sims)
        rule_counts.append(result.removed)
        for i, m, p in zip(members, result.mined, result.pos_scores):
            mined[i], pos_scores[i] = m, p
        short = sum(m.in_window < opts["min_negatives"] for m in result.mined)
        per_pool[pool] = {"examples": len(members), "short_before_fallback": short}
    return mined, pos_scores, neighbour_sims, per_pool, rule_counts


def summary(stats: dict) -> str:
    n, w = stats.get("negatives", {}), stats.get("window", {})
    return (f"{stats.get('examples', 0):,} examples, {n.get('per_example_mean', 0)} negatives each in "
            f"[{w.get('lo')}, {w.get('hi')}), {stats.get('examples_with_fallback', 0):,} with fallback")
