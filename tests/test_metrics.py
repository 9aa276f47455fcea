"""Retrieval metrics against trec_eval itself (pytrec-eval-terrier), the rest against brute-force references.

Runs are random and nasty on purpose: many exact score ties, ties that only appear after trec_eval's
float32 rounding, docids whose string order differs from their numeric order (d9 > d10) and Chinese ids,
graded and negative grades, queries with no relevant docs, qrels queries missing from the run, run
queries and docs absent from the qrels, lists shorter than k.
"""
from __future__ import annotations

import numpy as np
import pytest
from _metrics_helpers import TOL, brute_map_min_r, pytrec, random_case, reference_order
from scipy import stats

from care.evaluation.metrics import (
    accuracy_at_n,
    evaluate,
    evaluate_per_query,
    parse_metric,
    run_from_topk,
    sample_acc_trials,
    sts_correlations,
    trec_order,
)

CUTS = (1, 3, 5, 10, 50)  # 50 is longer than every run list below


@pytest.mark.parametrize("seed,relevance_level", [(0, 1), (1, 1), (2, 2)])
def test_per_query_and_means_match_pytrec_eval(seed, relevance_level):
    run, qrels = random_case(seed)
    cuts = ",".join(map(str, CUTS))
    ref = pytrec(run, qrels, {f"ndcg_cut.{cuts}", f"map_cut.{cuts}", f"success.{cuts}", f"recall.{cuts}"},
                 relevance_level)
    names = {f"{fam}_{k}": f"{fam}_{k}" for fam in ("ndcg_cut", "map_cut", "success", "recall") for k in CUTS}
    ours = evaluate_per_query(run, qrels, list(names), relevance_level=relevance_level, complete=False)
    assert set(ours) == set(ref) == set(qrels) & set(run)  # pytrec_eval: the intersection only
    for qid in ref:
        for name in names:
            assert ours[qid][name] == pytest.approx(ref[qid][name], abs=TOL), (qid, name)

    complete = evaluate_per_query(run, qrels, list(names), relevance_level=relevance_level)
    assert set(complete) == set(qrels)
    means = evaluate(run, qrels, list(names), relevance_level=relevance_level)
    means_skip = evaluate(run, qrels, list(names), relevance_level=relevance_level, complete=False)
    for name in names:
        total = sum(ref[qid][name] for qid in ref)
        assert means_skip[name] == pytest.approx(total / len(ref), abs=TOL)
        assert means[name] == pytest.approx(total / len(qrels), abs=TOL)  # missing queries count 0
        assert all(complete[qid][name] == 0.0 for qid in set(qrels) - set(run))
    # the case really exercises what it claims to
    assert set(qrels) - set(run) and any(max(j.values()) < 1 for j in qrels.values())
    assert any(ours[q]["ndcg_cut_10"] > 0 for q in ours) and any(0 < ours[q]["recall_3"] < 1 for q in ours)


@pytest.mark.parametrize("seed", [3, 4])
def test_mrr_cut_is_recip_rank_of_the_run_cut_at_k(seed):
    run, qrels = random_case(seed)
    metrics = [f"mrr_{k}" for k in CUTS]
    ours = evaluate_per_query(run, qrels, metrics, complete=False)
    for k in CUTS:
        cut = {qid: {d: docs[d] for d in reference_order(docs)[:k]} for qid, docs in run.items()}
        ref = pytrec(cut, qrels, {"recip_rank"})
        for qid in ref:
            assert ours[qid][f"mrr_{k}"] == pytest.approx(ref[qid]["recip_rank"], abs=TOL), (qid, k)
    full = pytrec(run, qrels, {"recip_rank"})  # no cut needed when k exceeds every list
    assert all(ours[q]["mrr_50"] == pytest.approx(full[q]["recip_rank"], abs=TOL) for q in full)


@pytest.mark.parametrize("relevance_level", [1, 2])
def test_map_min_r_matches_brute_force(relevance_level):
    run, qrels = random_case(5)
    metrics = [f"map_min_r_{k}" for k in CUTS]
    ours = evaluate_per_query(run, qrels, metrics, relevance_level=relevance_level)
    for qid, judged in qrels.items():
        ranked = reference_order(run.get(qid, {}))
        for k in CUTS:
            expected = brute_map_min_r(ranked, judged, k, relevance_level)
            assert ours[qid][f"map_min_r_{k}"] == pytest.approx(expected, abs=1e-12), (qid, k)
    map_cut = pytrec(run, qrels, {"map_cut.3"}, relevance_level)
    differs = sum(abs(map_cut[q]["map_cut_3"] - ours[q]["map_min_r_3"]) > TOL for q in map_cut)
    assert differs > 0  # the two conventions really differ on this data


def test_order_matches_trec_eval_exactly():
    """pytrec_eval's own rank of every doc (1 / recip_rank with that doc alone relevant) vs trec_order."""
    rng = np.random.default_rng(7)
    ids = [f"d{i}" for i in range(30)] + ["文档", "中", "é", "z", "Z", "𠀀", "d09"]
    values = [0.0, -0.0, 1.0, 1.0 + 1e-9, 1.0 + 1e-6, 3.5e38, 1e39, float("inf"), -2.0]
    doc_scores = {d: float(rng.choice(values)) for d in ids}
    ranks = {}
    for doc in ids:
        rr = pytrec({"q": doc_scores}, {"q": {doc: 1}}, {"recip_rank"})["q"]["recip_rank"]
        ranks[doc] = round(1 / rr)
    assert trec_order(doc_scores) == sorted(ids, key=ranks.get)
    assert trec_order({"d10": 1.0, "d9": 1.0, "d2": 1.0}) == ["d9", "d2", "d10"]  # docid descending
    assert trec_order({"a": 1.0 + 1e-12, "b": 1.0}) == ["b", "a"]  # equal in float32, so a tie


def test_query_sets_and_no_relevant_queries():
    qrels = {"has_rel": {"a": 2, "b": 0}, "no_rel": {"a": 0}, "not_run": {"a": 1}}
    run = {"has_rel": {"a": 1.0, "x": 2.0}, "no_rel": {"a": 1.0}, "not_in_qrels": {"a": 1.0}}
    ref = pytrec(run, qrels, {"success.1,5", "ndcg_cut.5"})
    assert set(ref) == {"has_rel", "no_rel"}  # pytrec_eval keeps the no-relevant query, with zeros
    assert ref["no_rel"] == {"success_1": 0.0, "success_5": 0.0, "ndcg_cut_5": 0.0}
    ours = evaluate_per_query(run, qrels, ["success_1", "success_5", "ndcg_cut_5"])
    assert set(ours) == set(qrels)
    assert ours["has_rel"]["success_5"] == 1.0 and ours["has_rel"]["success_1"] == 0.0
    assert ours["no_rel"]["success_5"] == ours["not_run"]["success_5"] == 0.0
    assert evaluate(run, qrels, ["success_5"])["success_5"] == pytest.approx(1 / 3)
    assert evaluate(run, qrels, ["success_5"], complete=False)["success_5"] == pytest.approx(1 / 2)


def test_bad_arguments():
    for name in ("ndcg@10", "ndcg_cut_0", "map_10", "success_"):
        with pytest.raises(ValueError, match="unknown metric"):
            parse_metric(name)
    assert parse_metric("map_min_r_10") == ("map_min_r", 10)
    with pytest.raises(ValueError, match="relevance_level"):
        evaluate({"q": {"a": 1.0}}, {"q": {"a": 1}}, relevance_level=0)
    with pytest.raises(ValueError, match="NaN"):
        evaluate({"q": {"a": float("nan")}}, {"q": {"a": 1}})
    with pytest.raises(ValueError, match="no query"):
        evaluate({"q": {"a": 1.0}}, {"other": {"a": 1}}, complete=False)


def test_run_from_faiss_topk():
    import faiss

    rng = np.random.default_rng(0)
    docs = rng.standard_normal((7, 16)).astype(np.float32)
    queries = rng.standard_normal((3, 16)).astype(np.float32)
    index = faiss.IndexFlatIP(16)
    index.add(docs)
    scores, indices = index.search(queries, 10)  # k > corpus: FAISS pads with -1
    assert (indices == -1).any()
    doc_ids = [f"doc{i}" for i in range(7)]
    run = run_from_topk(["q0", "q1", "q2"], doc_ids, indices, scores)
    brute = queries @ docs.T
    for qi, qid in enumerate(["q0", "q1", "q2"]):
        assert set(run[qid]) == set(doc_ids)
        for di, did in enumerate(doc_ids):
            assert run[qid][did] == pytest.approx(float(brute[qi, di]), rel=1e-5)
    with pytest.raises(ValueError, match="twice"):
        run_from_topk(["q"], doc_ids, np.array([[1, 1]]), np.array([[0.5, 0.4]]))
    with pytest.raises(ValueError, match="out of range"):
        run_from_topk(["q"], doc_ids, np.array([[7]]), np.array([[0.5]]))
    with pytest.raises(ValueError, match="shape"):
        run_from_topk(["q", "r"], doc_ids, indices, scores)


# ---------------------------------------------------------------- Acc@N

def acc_case(seed=0, n_queries=40, corpus=60):
    rng = np.random.default_rng(seed)
    relevant = [set(rng.choice(corpus, rng.integers(0, 3), replace=False).tolist()) for _ in range(n_queries)]
    scores = rng.integers(0, 6, size=(n_queries, corpus)).astype(float)  # coarse: ties are common
    for q, rel in enumerate(relevant):
        for p in rel:
            scores[q, p] += rng.integers(0, 3)  # positives tend to score higher, not always strictly
    return scores, relevant


def test_acc_trials_are_valid_samples():
    _, relevant = acc_case()
    trials = list(sample_acc_trials(relevant, 16, 60, seed=3))
    assert [(q, p) for q, p, _ in trials] == [(q, p) for q, rel in enumerate(relevant) for p in sorted(rel)]
    for q, _, negatives in trials:
        assert len(negatives) == 15 == len(set(negatives.tolist()))
        assert not set(negatives.tolist()) & relevant[q] and negatives.min() >= 0 and negatives.max() < 60
    again = list(sample_acc_trials(relevant, 16, 60, seed=3))
    other = list(sample_acc_trials(relevant, 16, 60, seed=4))
    assert all((a[2] == b[2]).all() for a, b in zip(trials, again))
    assert any((a[2] != b[2]).any() for a, b in zip(trials, other))
    with pytest.raises(ValueError, match="non-relevant"):
        list(sample_acc_trials([{0, 1}], 5, 5))


def test_acc_negatives_are_uniform():
    counts = np.zeros(20)
    trials = 0
    for _, _, negatives in sample_acc_trials([{0, 1}] * 1500, 5, 20, seed=0):
        counts[negatives] += 1
        trials += 1
    assert trials == 3000 and counts[:2].sum() == 0
    expected = trials * 4 / 18
    # each count is binomial(trials, 4/18): 5 standard deviations is a generous, still sharp band
    assert np.abs(counts[2:] - expected).max() < 5 * np.sqrt(expected * (1 - 4 / 18))


def test_acc_at_n_matches_brute_force():
    scores, relevant = acc_case()
    wins = trials = 0
    for q, positive, negatives in sample_acc_trials(relevant, 16, 60, seed=1):
        trials += 1
        wins += all(scores[q, positive] > scores[q, d] for d in negatives)  # ties fail
    assert accuracy_at_n(scores, relevant, 16, seed=1) == wins / trials
    via_fn = accuracy_at_n(lambda q, docs: scores[q, docs], relevant, 16, corpus_size=60, seed=1)
    assert via_fn == wins / trials
    assert 0 < wins / trials < 1


def test_acc_at_n_with_every_negative_is_exact():
    """N - 1 = all non-relevant docs: no sampling left, so the answer is known without it."""
    scores, _ = acc_case(seed=2)
    relevant = [{q % 60} for q in range(len(scores))]
    expected = np.mean([scores[q, p] > np.delete(scores[q], p).max() for q, (p,) in enumerate(relevant)])
    assert accuracy_at_n(scores, relevant, 60, seed=9) == pytest.approx(expected)
    assert accuracy_at_n(np.ones((3, 10)), [{0}, {1}, {2}], 4) == 0.0  # all tied: all failures
    with pytest.raises(ValueError, match="no query"):
        accuracy_at_n(np.ones((2, 10)), [set(), set()], 4)
    with pytest.raises(ValueError, match="corpus_size"):
        accuracy_at_n(lambda q, d: d, [{0}], 4)


def test_sts_correlations_match_numpy():
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 3, size=200).astype(float)  # graded, many ties (like KUAKE-QQR)
    predicted = gold + rng.normal(0, 1, size=200)
    out = sts_correlations(predicted.tolist(), gold.tolist())
    assert out["pearson"] == pytest.approx(np.corrcoef(predicted, gold)[0, 1], abs=1e-12)
    spearman = np.corrcoef(stats.rankdata(predicted), stats.rankdata(gold))[0, 1]  # average ranks for ties
    assert out["spearman"] == pytest.approx(spearman, abs=1e-12)
    with pytest.raises(ValueError, match="equal-length"):
        sts_correlations([1.0, 2.0], [1.0])
