"""The maths of threshold calibration (calibrate.py runs it): cosine intervals, the positive rate in each,
and the thresholds that follow.  Pure functions of cosines and labels: no files, no encoder.

Every mode of `python -m data_pipeline.dedup.calibrate` bins labelled pairs by cosine into the intervals of
dedup.calibrate.edges (`interval_of`), reports the positive rate per interval (`rate_table`,
`format_table`) and, where it can, suggests the dedup cut and the mining window (`suggest`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from omegaconf import DictConfig


def interval_of(cosines, edges: Sequence[float]) -> np.ndarray:
    """Index of the interval [edges[k], edges[k+1]) holding each cosine (the last one closed), -1 if none."""
    edges = np.asarray(edges, dtype=np.float64)
    if len(edges) < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"dedup.calibrate.edges must be increasing, got {edges.tolist()}")
    c = np.asarray(cosines, dtype=np.float64)
    k = np.searchsorted(edges, c, side="right") - 1
    k[c == edges[-1]] = len(edges) - 2
    k[(c < edges[0]) | (c > edges[-1])] = -1
    return k


def interval_name(edges: Sequence[float], k: int) -> str:
    return f"[{edges[k]:g}, {edges[k + 1]:g}{']' if k == len(edges) - 2 else ')'}"


def rate_table(cosines, labels, edges: Sequence[float]) -> list[dict]:
    """Pairs, positives and positive rate per interval (rate null for an empty interval)."""
    k, labels = interval_of(cosines, edges), np.asarray(labels, dtype=np.float64)
    rows = []
    for j in range(len(edges) - 1):
        sel = labels[k == j]
        rows.append({"interval": interval_name(edges, j), "lo": float(edges[j]), "hi": float(edges[j + 1]),
                     "pairs": len(sel), "positives": int(sel.sum()),
                     "rate": round(float(sel.mean()), 4) if len(sel) else None})
    return rows


def format_table(rows: list[dict], what: str = "duplicate rate") -> str:
    lines = [f"{'interval':<16}{'pairs':>8}{'positives':>11}{what:>18}"]
    for r in rows:
        rate = "-" if r["rate"] is None else f"{100 * r['rate']:.1f}%"
        lines.append(f"{r['interval']:<16}{r['pairs']:>8}{r['positives']:>11}{rate:>18}")
    return "\n".join(lines)


def suggest(rows: list[dict], random_cosines, crossing: float = 0.5, mine_lo_quantile: float = 0.95) -> dict:
    """The dedup cut: the lower edge of the lowest interval from which every non-empty interval upward has
    a positive rate >= `crossing` (the source's 0.80 had 54% in [0.80, 0.85)).  The mining window is
    [lo, cut): above the cut a "negative" is likely a duplicate of the positive; lo is the
    `mine_lo_quantile` quantile of the cosine of random (unrelated) pairs, so a mined negative is more
    similar to the query than that share of unrelated texts."""
    cut = None
    for r in reversed(rows):
        if r["rate"] is None:
            continue
        if r["rate"] < crossing:
            break
        cut = r["lo"]
    if cut is None:
        raise ValueError(f"no interval reaches a positive rate of {crossing:.0%}: widen dedup.calibrate.edges")
    lo = round(float(np.quantile(np.asarray(random_cosines, dtype=np.float64), mine_lo_quantile)), 2)
    if lo >= cut:
        raise ValueError(f"mining window [{lo}, {cut}) is empty: unrelated pairs score as high as duplicates")
    return {"dedup_cosine": cut, "mine_lo": lo, "mine_hi": cut}


def labelled_rates(c: DictConfig, cos: np.ndarray, labels, random_cos: np.ndarray, positive: str) -> dict:
    """What the pairs and qa modes report of labelled cosines: the rate table, the cosine quantiles of the
    positive, the other and the random pairs, and how many fall below the first edge."""
    labels = np.asarray(labels)
    return {
        "table": rate_table(cos, labels, c.edges),
        "cosine_quantiles": {
            kind: {f"q{q}": round(float(np.quantile(v, q / 100)), 4) for q in (5, 25, 50, 75, 95)}
            for kind, v in ((positive, cos[labels == 1]), (f"not_{positive}", cos[labels == 0]),
                            ("random", random_cos))},
        "below_first_edge": int((cos < c.edges[0]).sum()),
    }


def suggestion(result: dict, random_cos: np.ndarray, c: DictConfig) -> dict | None:
    """`suggest` on the result's table; None, with the reason recorded in `result`, when there is none (the
    table is still worth having)."""
    try:
        return suggest(result["table"], random_cos, c.crossing, c.mine_lo_quantile)
    except ValueError as e:
        result["suggested_thresholds"], result["no_suggestion_because"] = None, str(e)
        return None
