"""Is a gain more than the noise of the evaluation set?  A paired bootstrap over the set's items.

Two models scored on the same queries (or STS pairs) differ by a number; resampling the items with
replacement, the same draw for both models, gives the spread that number would have on another sample
of the same kind of queries.  The 95% interval is the 2.5th-97.5th percentile of the resampled
differences (the percentile bootstrap, scipy.stats.bootstrap with paired=True): a gain whose interval
excludes 0 is more than sampling noise; one whose interval holds 0 is not told apart from it.

What an item is:
    ranking tasks   a query: the task's metric is a mean over queries, so the difference of the means
                    is resampled from each query's pair of values (the per-query values trec_eval prints)
    STS             a sentence pair: Pearson is not a mean of per-pair values, so each resample
                    recomputes both models' correlations with the gold scores on the same pairs

This measures the evaluation set's noise, not a training run's: a second training seed moves a score as
well, and only another run can say by how much.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95


def _mean_difference(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return a.mean(axis=axis) - b.mean(axis=axis)


def _pearson(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - x.mean(axis=axis, keepdims=True)
    y = y - y.mean(axis=axis, keepdims=True)
    return (x * y).sum(axis=axis) / np.sqrt((x * x).sum(axis=axis) * (y * y).sum(axis=axis))


def _pearson_difference(a: np.ndarray, b: np.ndarray, gold: np.ndarray, axis: int = -1) -> np.ndarray:
    return _pearson(a, gold, axis) - _pearson(b, gold, axis)


def _interval(data: tuple[np.ndarray, ...], statistic, seed: int, resamples: int) -> dict:
    """The interval; when the statistic is undefined on the set or on some resamples (Pearson of a constant
    prediction: a few STS pairs with tied scores), `low` and `high` are None and `undefined` says why (the
    percentiles of a distribution holding NaN are NaN, which a table would print as [+nan, +nan])."""
    import warnings

    from scipy import stats  # imported here: only a table with a gain row needs it

    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)  # said in `undefined` instead
        observed = float(statistic(*data))
        result = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=resamples,
                                 confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed))
    out = {"difference": observed, "low": float(result.confidence_interval.low),
           "high": float(result.confidence_interval.high), "items": len(data[0]),
           "resamples": resamples, "confidence": CONFIDENCE}
    if not np.isfinite(observed):
        return {**out, "difference": None, "low": None, "high": None,
                "undefined": f"the difference is undefined on the {len(data[0])} items themselves (a constant score)"}
    if not (np.isfinite(out["low"]) and np.isfinite(out["high"])):
        bad = int((~np.isfinite(result.bootstrap_distribution)).sum())
        return {**out, "low": None, "high": None,
                "undefined": f"undefined on {bad} of {resamples} resamples: {len(data[0])} items are too few"}
    return out


def paired_query_bootstrap(a: Mapping[str, float], b: Mapping[str, float], *, seed: int = 0,
                           resamples: int = RESAMPLES) -> dict[str, float]:
    """CI of mean(a) - mean(b) over the queries both score (`{query id: metric value}` each)."""
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        raise ValueError(f"the two models were scored on different queries ({len(only)} differ, e.g. {only[0]!r})")
    if len(a) < 2:
        raise ValueError(f"a bootstrap needs >= 2 queries, got {len(a)}")
    ids = sorted(a)
    return _interval((np.array([a[q] for q in ids], float), np.array([b[q] for q in ids], float)),
                     _mean_difference, seed, resamples)


def paired_pearson_bootstrap(a: Sequence[float], b: Sequence[float], gold: Sequence[float], *, seed: int = 0,
                             resamples: int = RESAMPLES) -> dict[str, float]:
    """CI of pearson(a, gold) - pearson(b, gold), resampling the pairs (a[i], b[i], gold[i])."""
    a, b, gold = (np.asarray(x, dtype=float) for x in (a, b, gold))
    if not (a.shape == b.shape == gold.shape) or a.ndim != 1 or len(a) < 3:
        raise ValueError(f"need three equal-length lists of >= 3 pairs, got {a.shape}, {b.shape}, {gold.shape}")
    return _interval((a, b, gold), _pearson_difference, seed, resamples)


def gain_interval(items: Mapping, reference: Mapping, *, seed: int = 0) -> dict[str, float] | None:
    """The bootstrap of one table cell from two models' per-item records (evaluate.py's `items`), on the
    0-100 scale of the table; None when either model has no per-item record for it; `low` and `high` None,
    with `undefined` saying why, when the statistic has no value to resample (see _interval)."""
    if not items or not reference:
        return None
    if "predicted" in items:  # STS
        if items["gold"] != reference["gold"]:
            raise ValueError("the two models were scored on different STS pairs")
        result = paired_pearson_bootstrap(items["predicted"], reference["predicted"], items["gold"], seed=seed)
    else:
        result = paired_query_bootstrap(items["per_query"], reference["per_query"], seed=seed)
    return {**result, **{k: None if result[k] is None else 100 * result[k] for k in ("difference", "low", "high")}}


def cell_items(record: dict | None, metric: str) -> dict | None:
    """One table cell's per-item record from a task's `items`: each query's value of `metric`, or the STS
    predictions (what gain_interval resamples)."""
    if record is None or "predicted" in record:
        return record
    values = {q: v[metric] for q, v in record["per_query"].items() if metric in v}
    return {"per_query": values} if values else None
