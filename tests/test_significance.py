"""The paired bootstrap of a gain: exact on degenerate cases, against the normal approximation for a mean
difference, against a plain resampling loop (numpy + scipy.stats.pearsonr) for an STS difference, and the
table row it ends up in."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from care.config import load_config
from care.evaluation.benchmarks import load_benchmark
from care.evaluation.report import columns, write_summary
from care.evaluation.significance import gain_interval, paired_pearson_bootstrap, paired_query_bootstrap


def test_identical_models_and_a_constant_shift_are_exact():
    a = {f"q{i}": v for i, v in enumerate(np.random.default_rng(0).random(50))}
    same = paired_query_bootstrap(a, dict(a))
    assert same["difference"] == same["low"] == same["high"] == 0.0
    shifted = paired_query_bootstrap({q: v + 0.1 for q, v in a.items()}, a)
    assert shifted["low"] == pytest.approx(0.1) and shifted["high"] == pytest.approx(0.1)


def test_mean_difference_matches_the_normal_approximation():
    rng = np.random.default_rng(1)
    b = rng.random(800)
    a = b + rng.normal(0.03, 0.2, size=800)
    got = paired_query_bootstrap({f"q{i}": x for i, x in enumerate(a)}, {f"q{i}": x for i, x in enumerate(b)})
    d = a - b
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    assert got["difference"] == pytest.approx(d.mean())
    assert got["low"] == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert got["high"] == pytest.approx(d.mean() + half, abs=0.15 * half)
    assert got["low"] > 0  # 0.03 over 800 queries with sd 0.2 is more than noise


def test_pearson_difference_matches_a_plain_resampling_loop():
    rng = np.random.default_rng(2)
    gold = rng.integers(0, 3, size=400).astype(float)
    a = gold + rng.normal(0, 1.0, size=400)
    b = gold + rng.normal(0, 1.2, size=400)
    got = paired_pearson_bootstrap(a, b, gold, seed=5, resamples=4000)
    draws = rng.integers(0, 400, size=(4000, 400))
    ref = np.array([stats.pearsonr(a[i], gold[i]).statistic - stats.pearsonr(b[i], gold[i]).statistic for i in draws])
    assert got["difference"] == pytest.approx(stats.pearsonr(a, gold).statistic - stats.pearsonr(b, gold).statistic)
    assert got["low"] == pytest.approx(np.quantile(ref, 0.025), abs=0.01)
    assert got["high"] == pytest.approx(np.quantile(ref, 0.975), abs=0.01)


def test_mismatched_items_are_refused():
    with pytest.raises(ValueError, match="different queries"):
        paired_query_bootstrap({"q1": 1.0, "q2": 0.0}, {"q1": 1.0, "q3": 0.0})
    with pytest.raises(ValueError, match="different STS pairs"):
        gain_interval({"predicted": [1, 2, 3], "gold": [0, 1, 2]}, {"predicted": [1, 2, 3], "gold": [0, 1, 1]})
    assert gain_interval(None, {"per_query": {"q": 1.0}}) is None


def test_the_table_shows_each_gain_interval(tmp_path):
    bench = load_benchmark(load_config("evaluate").benchmark)
    cols = columns([bench])
    rows = [{"name": n, "label": n, "baseline": n != "tuned", "efficiency": {},
             "scores": {c["key"]: 50.0 for c in cols}} for n in ("tuned", "me5")]
    sts = f"{bench.name}/sts"
    rows[0]["gain"] = {"over": "me5", "intervals": {
        sts: {"difference": -0.9, "low": -1.6, "high": -0.2},
        f"{bench.name}/cmed_v1": {"difference": 0.5, "low": -0.3, "high": 1.2}}}
    text = write_summary(tmp_path, "run", [bench], rows, {"table_method": "dense"})
    line = next(line for line in text.splitlines() if line.startswith("| 95% interval of that gain |"))
    cells = dict(zip([c["key"] for c in cols], line.split(" | ")[1:1 + len(cols)]))
    assert cells[sts] == "[-1.60, -0.20]*" and cells[f"{bench.name}/cmed_v1"] == "[-0.30, +1.20]"
    assert cells[f"{bench.name}/avg"] == ""


def test_evaluate_attaches_intervals_to_gain_rows_only():
    from evaluate import gain_intervals

    rng = np.random.default_rng(3)
    gold = rng.integers(0, 3, size=60).tolist()

    def row(name, baseline, noise):
        return {"name": name, "baseline": baseline, "items": {
            "b/rerank": {"per_query": {f"q{i}": float(v) for i, v in enumerate(rng.random(30))}},
            "b/sts": {"predicted": (np.array(gold) + rng.normal(0, noise, 60)).tolist(), "gold": gold},
            "b/retrieval/acc_1024": None}}

    rows = [row("tuned", False, 0.5), row("me5", True, 2.0), row("bm25", True, 1.0)]
    rows[2]["name"] = "bm25"
    gain_intervals(rows)
    assert [("gain" in r, "items" in r) for r in rows] == [(True, False), (False, False), (False, False)]
    intervals = rows[0]["gain"]["intervals"]
    assert rows[0]["gain"]["over"] == "me5" and intervals["b/retrieval/acc_1024"] is None
    assert intervals["b/sts"]["low"] > 0  # far less noise than the baseline: a real STS gain
    assert intervals["b/rerank"]["low"] < intervals["b/rerank"]["difference"] < intervals["b/rerank"]["high"]
