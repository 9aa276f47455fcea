"""Stage "mine": hard negatives for every training example, from a similarity window (README, "Data
pipeline", for the files it writes).

The recipe (bge-m3-medical-cn, docs/facts.md s.1): encode, take each query's top-K neighbours with FAISS
(care.retrieval.index: exact inner product over L2-normalised vectors, on GPUs when faiss-gpu sees any),
keep the candidates whose similarity lies in [lo, hi): below lo they are easy, at or above hi likely
unlabelled positives.  Which candidates may be a negative, and the fallback when the window holds too few,
is data_pipeline.negatives.  Optional positive-aware rules (mine.relative_margin, absolute_margin,
max_score; conf/pipeline/mine.yaml) lower each example's top below hi from its positives' similarity;
every row of train.jsonl carries that similarity per positive as `pos_scores`.  Embeddings go through the
on-disk cache (care.encoders.cache), so a re-run with another window costs no encoding; a run whose
inputs, encoder weights and config are unchanged is skipped.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.data.io import (
    DataError,
    read_jsonl,
    read_jsonl_numbered,
    read_text_store,
    save_figure,
    write_json,
    write_jsonl,
)
from care.data.stage_cache import claim_outputs, fingerprint, mark_in_progress, up_to_date
from care.encoders import Encoder, build_encoder
from care.encoders.cache import EmbeddingCache, embed
from care.models.hub import weights_digest
from care.retrieval.index import build_index, unit_rows
from data_pipeline.build import export_flag
from data_pipeline.dedup.clusters import clusters_from_edges
from data_pipeline.dedup.stage import encoder_thresholds
from data_pipeline.negatives import Mined, PoolMiner

SIMILARITY = ("question", "document")
FORMAT = 2  # of the files this stage writes; 2: pos_scores in train.jsonl, teacher-only scores in flag_train.jsonl
RULES = ("relative_margin", "absolute_margin", "max_score")  # positive-aware, conf/pipeline/mine.yaml
_PAIRS = 1 << 16  # (query, positive) dot products computed at once by positive_scores
OUTPUTS = ("train.jsonl", "texts.jsonl", "flag_train.jsonl", "leakage.json", "neg_similarity.png", "stats.json")


# The calibrated window of each similarity mode: question-question cosines (query side; calibrate mode=pairs)
# and query-answer cosines (query vs document side; calibrate mode=qa) are different scales.
WINDOW_KEYS = {"question": ("mine_lo", "mine_hi"), "document": ("mine_doc_lo", "mine_doc_hi")}


def mining_window(cfg: DictConfig) -> dict:
    """[lo, hi) from mine.window (an explicit override) or the encoder's thresholds calibrated for the mode."""
    model, override = cfg.model, cfg.mine.get("window")
    lo_key, hi_key = WINDOW_KEYS.get(cfg.mine.get("similarity"), WINDOW_KEYS["question"])
    where = f"model config '{model.get('name')}' (conf/model/{model.get('name')}.yaml)"
    th = OmegaConf.to_container(model.thresholds, resolve=True) if model.get("thresholds") else {}
    if override is not None:
        lo, hi = (float(x) for x in override)
        how = {"source": "explicit override (mine.window)", "calibrated_for": th.get("calibrated_for")}
    else:
        mode = cfg.mine.get("similarity")
        th = encoder_thresholds(model, (lo_key, hi_key), f"A mining window (mine.similarity={mode})",
                                "mine.window=[LO,HI]")
        lo, hi = float(th[lo_key]), float(th[hi_key])
        how = {"source": "model.thresholds", "calibrated_for": th["calibrated_for"]}
    if not lo < hi:
        field = "mine.window" if override is not None else f"thresholds.{lo_key}"
        raise DataError(where if override is None else "mine config", None, field,
                        f"mining window [{lo}, {hi}) is empty (lo >= hi)")
    return {"lo": lo, "hi": hi, **how}


def read_examples(path: Path, texts: dict[str, str]) -> list[dict]:
    examples = []
    for line, ex in read_jsonl_numbered(path, ("query_id", "pos_ids", "pool")):
        for fld in ("query_id", "pos_ids"):
            for tid in ex[fld] if fld == "pos_ids" else [ex[fld]]:
                if tid not in texts:
                    raise DataError(path, line, fld, f"unknown text id {tid!r} (not in the text store)")
        if not ex["pos_ids"]:
            raise DataError(path, line, "pos_ids", "an example with no positive")
        examples.append(ex)
    if not examples:
        raise DataError(path, None, "query_id", "no training examples (no queries to mine for)")
    return examples


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


def positive_rules(opts: dict) -> dict[str, float]:
    """The positive-aware rules that are set (name -> value), checked before any work: a margin in [0, 1),
    max_score a cosine; the margins only in document mode, since in question mode the positive's
    similarity is the query's with itself and a margin below it is no more than a fixed cap."""
    rules = {}
    for name in RULES:
        value = opts.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"mine.{name} must be a number or null, not {value!r}")
        if name == "max_score" and not -1.0 <= value <= 1.0:
            raise ValueError(f"mine.max_score must lie in [-1, 1] (a cosine), not {value}")
        if name != "max_score" and not 0.0 <= value < 1.0:
            raise ValueError(f"mine.{name} must lie in [0, 1), not {value}")
        rules[name] = float(value)
    margins = [n for n in rules if n != "max_score"]
    if margins and opts["similarity"] == "question":
        raise ValueError(
            f"mine.{margins[0]} needs mine.similarity=document: in question mode a positive's similarity is "
            "the query's with itself (1.0), so a margin below it is only a fixed cap; use mine.max_score or "
            "the window's hi (mine.window) for that, or mine.similarity=document")
    return rules


def rule_thresholds(rules: dict[str, float], pos_min: np.ndarray) -> dict[str, np.ndarray]:
    """Per active rule, per example: the score above which a candidate is dropped, from the example's least
    similar positive.  The relative margin is taken off |p|, so a negative p keeps its threshold below p."""
    out = {}
    if "relative_margin" in rules:
        out["relative_margin"] = pos_min - np.abs(pos_min) * rules["relative_margin"]
    if "absolute_margin" in rules:
        out["absolute_margin"] = pos_min - rules["absolute_margin"]
    if "max_score" in rules:
        out["max_score"] = np.full(len(pos_min), rules["max_score"])
    return out


def positive_scores(examples: list[dict], doc_ids: list[str], queries: np.ndarray, cands: np.ndarray,
                    similarity: str, encode_docs) -> list[list[float]]:
    """Each example's similarity to each of its positives, in the mining's own terms and rounded like a
    negative's score (6 decimals): in question mode the query's with itself (a positive's question IS the
    query), in document mode cos(query, positive) from the search's unit vectors.  A positive that is not
    a candidate (dedup removed it) is encoded through `encode_docs`, on its own, so the candidates'
    vectors stay the ones the search used."""
    if similarity == "question":
        own = np.round(np.einsum("ij,ij->i", queries, queries).astype(np.float64), 6).tolist()
        return [[s] * len(ex["pos_ids"]) for s, ex in zip(own, examples)]
    row = {d: n for n, d in enumerate(doc_ids)}
    extra = list(dict.fromkeys(p for ex in examples for p in ex["pos_ids"] if p not in row))
    if extra:
        cands = np.concatenate([cands, encode_docs(extra)])
        row.update((d, len(doc_ids) + n) for n, d in enumerate(extra))
    q_of = np.array([i for i, ex in enumerate(examples) for _ in ex["pos_ids"]], np.int64)
    d_of = np.array([row[p] for ex in examples for p in ex["pos_ids"]], np.int64)
    flat = np.concatenate([np.einsum("ij,ij->i", queries[q_of[a:a + _PAIRS]], cands[d_of[a:a + _PAIRS]])
                           for a in range(0, len(q_of), _PAIRS)])
    flat = np.round(flat.astype(np.float64), 6).tolist()
    ends = np.cumsum([len(ex["pos_ids"]) for ex in examples]).tolist()
    return [flat[b - len(ex["pos_ids"]):b] for ex, b in zip(examples, ends)]


@dataclass
class PoolResult:
    mined: list[Mined]
    neighbour_sims: np.ndarray    # every top-K neighbour similarity (for the histogram)
    pos_scores: list[list[float]]  # per example, aligned with its pos_ids
    removed: dict[str, int]        # what the positive-aware rules removed (stats.json "positive_aware")


def mine_pool(examples: list[dict], texts: dict[str, str], encoder: Encoder, cluster_of: dict[str, int],
              removed: set[str], opts: dict, window: dict, cache: EmbeddingCache | None,
              timing: dict) -> PoolResult:
    """Negatives for every example of one pool, its positives' similarities and what the rules removed."""
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
    # flat (exact) by default, moved to the GPUs when faiss-gpu sees any; mine.index picks IVF or HNSW
    index = build_index(cands, **(opts.get("index") or {}))
    scores, neighbours = index.search(queries, k)
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


def positive_aware_stats(rules: dict[str, float], per_pool: list[dict[str, int]]) -> dict:
    """stats.json "positive_aware": per rule its value and the (example, candidate) pairs among the top-K
    usable candidates in [lo, hi) it alone would drop; removed_any (dropped by at least one rule) and the
    examples that lost a candidate.  A rule that is off has value and removed null."""
    total = defaultdict(int)
    for counts in per_pool:
        for name, n in counts.items():
            total[name] += n
    return {**{name: {"value": rules.get(name), "removed": total[name] if name in rules else None}
               for name in RULES},
            "removed_any": total["removed_any"], "examples_affected": total["examples_affected"]}


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
    ax.set_xlabel("similarity to the query (cosine)")
    ax.set_ylabel("count")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.subplots_adjust(left=0.09, right=0.98, top=0.88, bottom=0.12)
    save_figure(fig, path, dpi=110)


def run(cfg: DictConfig) -> dict:
    opts = OmegaConf.to_container(cfg.mine, resolve=True)
    if opts["similarity"] not in SIMILARITY:
        raise ValueError(f"mine.similarity must be one of {SIMILARITY}, not {opts['similarity']!r}")
    rules = positive_rules(opts)
    window = mining_window(cfg)
    in_dir, out_dir = Path(opts["input_dir"]), Path(opts["out_dir"])
    clusters_path = Path(opts["dedup_clusters"]) if opts.get("dedup_clusters") else None
    inputs = [in_dir / "examples.jsonl", in_dir / "texts.jsonl", in_dir / "leakage.json",
              *([clusters_path] if clusters_path else [])]
    model = OmegaConf.to_container(cfg.model, resolve=True)
    # The weights digest, not the encoder: a skipped run should not pay for loading the model.  `format`:
    # outputs of the stage before train.jsonl had pos_scores (and flag_train.jsonl carried the miner's cosine
    # as FlagEmbedding's teacher scores) are mined again once, never kept as up to date.
    settings = {k: v for k, v in opts.items() if k not in RULES or v is not None}
    fp = fingerprint(inputs, {"mine": settings, "window": window, "model": model,
                              "weights": weights_digest(model["path"]), "format": FORMAT})
    if not cfg.get("force") and (old := up_to_date(out_dir, fp)):
        print(f"mine: inputs, encoder and config unchanged, skipped ({out_dir})")
        return {**old, "skipped": True}
    claim_outputs(out_dir, "mine", OUTPUTS, bool(cfg.get("force")))

    t0 = time.perf_counter()
    texts = read_text_store(in_dir / "texts.jsonl")
    examples = read_examples(in_dir / "examples.jsonl", texts)
    cluster_of, removed = read_clusters(clusters_path)
    encoder = build_encoder(cfg.model)
    cache = EmbeddingCache(opts["cache"]) if opts.get("cache") else None
    timing = {"encode": 0.0, "search": 0.0, "select": 0.0}
    pools: dict[str, list[int]] = defaultdict(list)  # pool -> positions in examples
    for i, ex in enumerate(examples):
        pools[ex["pool"]].append(i)
    mined: list[Mined | None] = [None] * len(examples)
    pos_scores: list[list[float] | None] = [None] * len(examples)
    neighbour_sims, per_pool, rule_counts = [], {}, []
    for pool, members in pools.items():
        result = mine_pool([examples[i] for i in members], texts, encoder, cluster_of, removed, opts,
                           window, cache, timing)
        neighbour_sims.append(result.neighbour_sims)
        rule_counts.append(result.removed)
        for i, m, p in zip(members, result.mined, result.pos_scores):
            mined[i], pos_scores[i] = m, p
        short = sum(m.in_window < opts["min_negatives"] for m in result.mined)
        per_pool[pool] = {"examples": len(members), "short_before_fallback": short}
    rows = []
    for ex, m, p in zip(examples, mined, pos_scores):
        rows.append({"query_id": ex["query_id"], "pos_ids": ex["pos_ids"], "pos_scores": p,
                     "neg_ids": m.neg_ids, "neg_scores": m.neg_scores, "rule": ex.get("rule"),
                     "pool": ex["pool"], "fallback": m.fallback})
    used = dict.fromkeys(t for r in rows for t in [r["query_id"], *r["pos_ids"], *r["neg_ids"]])
    mark_in_progress(out_dir, "mine")
    write_jsonl(out_dir / "texts.jsonl", ({"id": t, "text": texts[t]} for t in used))
    write_jsonl(out_dir / "train.jsonl", rows)
    export_flag(out_dir / "train.jsonl", out_dir / "texts.jsonl", out_dir / "flag_train.jsonl")
    write_json(out_dir / "leakage.json", json.loads((in_dir / "leakage.json").read_text("utf-8")))

    kept_scores = [s for m in mined for s in m.neg_scores[:len(m.neg_scores) - m.fallback]]
    filled_scores = [s for m in mined for s in m.neg_scores[len(m.neg_scores) - m.fallback:]]
    n_negs = np.array([len(m.neg_ids) for m in mined])
    seconds = {k: round(v, 2) for k, v in timing.items()} | {"total": round(time.perf_counter() - t0, 2)}
    stats = {
        "stage": "mine", "fingerprint": fp, "examples": len(rows), "texts": len(used),
        "encoder": {"name": cfg.model.get("name"), "label": cfg.model.get("label"),
                    "fingerprint": encoder.fingerprint},
        "window": window, "similarity": opts["similarity"], "top_k": opts["top_k"],
        "max_negatives": opts["max_negatives"], "min_negatives": opts["min_negatives"],
        "fallback": opts["fallback"],
        "positive_aware": positive_aware_stats(rules, rule_counts),
        "pools": per_pool,
        "negatives": {"total": int(n_negs.sum()), "per_example_mean": round(float(n_negs.mean()), 2),
                      "per_example_min": int(n_negs.min()), "per_example_max": int(n_negs.max()),
                      "in_window": len(kept_scores), "fallback": len(filled_scores)},
        "examples_short_before_fallback": sum(m.in_window < opts["min_negatives"] for m in mined),
        "examples_with_fallback": sum(m.fallback > 0 for m in mined),
        "examples_short_after_fallback": int((n_negs < opts["min_negatives"]).sum()),
        "dedup_clusters": str(clusters_path) if clusters_path else None,
        "dedup_texts_clustered": len(cluster_of), "dedup_texts_removed": len(removed),
        "embedding_cache": {"hits": cache.hits, "misses": cache.misses} if cache else None,
        "seconds": seconds, "queries_per_s": round(len(rows) / max(seconds["total"], 1e-9), 1),
    }
    title = (f"{cfg.model.get('label') or cfg.model.get('name')}: {opts['similarity']} similarity\n"
             f"window [{window['lo']:g}, {window['hi']:g}) from {window['source']}"
             + "".join(f", {name} {value:g}" for name, value in rules.items()))
    plot_histogram(out_dir / "neg_similarity.png", np.concatenate(neighbour_sims), kept_scores, filled_scores,
                   window, title, opts["histogram_bins"])
    write_json(out_dir / "stats.json", stats)  # last: its fingerprint marks the outputs complete
    print(f"mine: {len(rows):,} examples, {stats['negatives']['total']:,} negatives "
          f"({stats['negatives']['per_example_mean']} per example); "
          f"{stats['examples_short_before_fallback']:,} had fewer than {opts['min_negatives']} in "
          f"[{window['lo']:g}, {window['hi']:g}) and got the fallback; "
          + (f"positive-aware rules removed {stats['positive_aware']['removed_any']:,} window candidates of "
             f"{stats['positive_aware']['examples_affected']:,} examples; " if rules else "")
          + f"{seconds['total']} s -> {out_dir}")
    return stats


def summary(stats: dict) -> str:
    n, w = stats.get("negatives", {}), stats.get("window", {})
    return (f"{stats.get('examples', 0):,} examples, {n.get('per_example_mean', 0)} negatives each in "
            f"[{w.get('lo')}, {w.get('hi')}), {stats.get('examples_with_fallback', 0):,} with fallback")
