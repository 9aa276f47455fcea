"""The similarity window of stage "mine" (data_pipeline/mining.py): [lo, hi) from the encoder's calibrated
thresholds or mine.window, and the optional positive-aware rules (mine.relative_margin, absolute_margin,
max_score; conf/mine/default.yaml) that lower an example's top below hi from its similarity to its
positives, which every row of train.jsonl carries as `pos_scores`.  data_pipeline/negatives.py takes the
lowered top as a per-example cap.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.data.io import DataError
from data_pipeline.dedup.stage import encoder_thresholds

RULES = ("relative_margin", "absolute_margin", "max_score")  # positive-aware, conf/mine/default.yaml
_PAIRS = 1 << 16  # (query, positive) dot products computed at once by positive_scores


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
