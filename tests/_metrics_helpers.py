"""Shared by the metric tests: random, nasty runs and qrels, pytrec_eval, trec_eval's order and MAP@min(R,k)
by brute force."""
from __future__ import annotations

import numpy as np
import pytrec_eval

TOL = 1e-6


def random_case(seed: int, n_queries: int = 80):
    rng = np.random.default_rng(seed)
    pool = [f"d{i}" for i in range(40)] + [f"文{i}" for i in range(10)] + ["中", "z", "Z", "a-1"]
    qrels, run = {}, {}
    for i in range(n_queries):
        qid = f"q{i}"
        judged = rng.choice(pool, size=rng.integers(1, 12), replace=False)
        grades = rng.choice([0, 0, 1, 2, 3, -1], size=len(judged))
        if i % 7 == 0:
            grades[:] = 0  # a query with judgements but no relevant doc
        qrels[qid] = {str(d): int(g) for d, g in zip(judged, grades)}
        if i % 9 == 4:
            continue  # in the qrels, missing from the run
        retrieved = rng.choice(pool, size=rng.integers(0, 30), replace=False)
        # few distinct values -> many exact ties; +1e-9 ties only after rounding to float32
        scores = rng.integers(0, 4, len(retrieved)) / 2 + rng.choice([0.0, 1e-9, 1e-3], len(retrieved))
        run[qid] = {str(d): float(s) for d, s in zip(retrieved, scores)}
    run["only_in_run"] = {"d1": 1.0, "d2": 0.5}
    return run, qrels


def pytrec(run, qrels, measures, relevance_level=1):
    return pytrec_eval.RelevanceEvaluator(qrels, measures, relevance_level=relevance_level).evaluate(run)


def reference_order(doc_scores):
    """The test's own statement of trec_eval's order, used only to cut runs for reference values."""
    return [d for d, _ in sorted(doc_scores.items(), key=lambda kv: (np.float32(kv[1]), kv[0]), reverse=True)]


def brute_map_min_r(ranked, judged, k, level):
    num_rel = sum(g >= level for g in judged.values())
    hits, total = 0, 0.0
    for rank, doc in enumerate(ranked[:k], 1):
        if judged.get(doc, 0) >= level:
            hits += 1
            total += hits / rank
    return total / min(num_rel, k) if num_rel else 0.0
