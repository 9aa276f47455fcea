"""Task runners (retrieval, reranking, STS, Acc@N, every scoring head) and BM25 against independent references.

Every score is checked against an independent reference: pytrec_eval (trec_eval itself) on runs built by
brute-force numpy scoring, scipy for correlations, a hand-written Lucene BM25, and plain-Python sparse /
ColBERT / hybrid formulas.  Task files are small real-data samples written to tmp_path (the `samples`
fixture in conftest.py).
"""
from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import pytrec_eval
from _evaluation_helpers import FakeM3, ref_scores, trec
from scipy import stats

from care.data.tasks import load_task
from care.encoders.dense import HFDenseEncoder
from care.evaluation.tasks import run_reranking, run_retrieval, run_sts
from care.retrieval.bm25 import BM25Scorer, tokenize
from care.retrieval.scorer import EncoderScorer


@pytest.fixture(scope="module")
def tiny(tiny_bert_dir):
    return HFDenseEncoder(str(tiny_bert_dir), name="tiny", pooling="cls", max_length=64)


# ---- runners against references ------------------------------------------------------------------------

def test_retrieval_dense_equals_brute_force_scored_by_trec_eval(samples):
    data = load_task("retrieval", samples["retrieval"])
    native = {i: i.split(":", 2)[2] for i in [*data.docs, *data.queries]}  # reader ids are source:role:native
    assert {native[q]: {native[d]: g for d, g in j.items()} for q, j in data.qrels.items()} == samples["qrels"]
    assert {native[d]: t for d, t in data.docs.items()} == {d: t.strip() for d, t in samples["corpus"].items()}
    enc = FakeM3()
    scorer = EncoderScorer(enc, heads=["dense"], show_progress=False)
    got = run_retrieval(data, scorer, ["ndcg_cut_10", "map_cut_10", "recall_100", "mrr_1000"], depth=1024)
    assert set(got) == {"dense"}
    qids, dids = list(data.queries), list(data.docs)
    q = enc.encode([data.queries[i] for i in qids], "query", 32, ["dense"], False).dense.astype(np.float64)
    d = enc.encode([data.docs[i] for i in dids], "query", 32, ["dense"], False).dense.astype(np.float64)
    full = q @ d.T
    run = {qid: {did: float(full[i, j]) for j, did in enumerate(dids)} for i, qid in enumerate(qids)}
    ref = trec(run, data.qrels, ["ndcg_cut_10", "map_cut_10", "recall_100", "recip_rank"])
    for mine, theirs in [("ndcg_cut_10", "ndcg_cut_10"), ("map_cut_10", "map_cut_10"), ("recall_100", "recall_100"),
                         ("mrr_1000", "recip_rank")]:
        assert got["dense"][mine] == pytest.approx(ref[theirs], abs=1e-6), mine
    # a depth smaller than the corpus truncates the run: recall@100 can only fall
    shallow = run_retrieval(data, scorer, ["recall_100"], depth=3)
    assert shallow["dense"]["recall_100"] < got["dense"]["recall_100"]


def test_reranking_equals_trec_eval(samples):
    data = load_task("reranking", samples["reranking"])
    rows = [json.loads(line) for line in samples["reranking"].read_text(encoding="utf-8").splitlines()]
    assert len(data.queries) == len(rows)
    enc = FakeM3()
    items = {}
    got = run_reranking(data, EncoderScorer(enc, heads=["dense"], show_progress=False), ["map_cut_10", "ndcg_cut_10"],
                        items=items)
    run, qrels = {}, {}
    for i, r in enumerate(rows):
        s = ref_scores(enc, r["query"], r["positive"] + r["negative"])["dense"]
        run[f"q{i}"] = {f"d{j}": float(v) for j, v in enumerate(s)}
        qrels[f"q{i}"] = {f"d{j}": int(j < len(r["positive"])) for j in range(len(s))}
    ref = trec(run, qrels, ["map_cut_10", "ndcg_cut_10"])
    assert got["dense"]["map_cut_10"] == pytest.approx(ref["map_cut_10"], abs=1e-6)
    assert got["dense"]["ndcg_cut_10"] == pytest.approx(ref["ndcg_cut_10"], abs=1e-6)
    # each query's own values (what the gain bootstrap resamples) are trec_eval's per-query lines
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"map_cut_10"}).evaluate(run)
    mine = items["dense"]["per_query"]
    assert [mine[q]["map_cut_10"] for q in data.queries] == pytest.approx(
        [per_query[f"q{i}"]["map_cut_10"] for i in range(len(rows))], abs=1e-6)


def test_sts_equals_scipy_on_symmetrised_scores(samples):
    sts = load_task("sts", samples["sts"])
    enc = FakeM3()
    items = {}
    got = run_sts(sts, EncoderScorer(enc, show_progress=False), items=items)
    for method in ("dense", "sparse", "colbert", "hybrid"):
        # both sides are queries; dense is the cosine; a pair scores the mean of its two directions
        pred = [(ref_scores(enc, a, [b])[method][0] + ref_scores(enc, b, [a])[method][0]) / 2 for a, b in sts.pairs]
        assert items[method]["predicted"] == pytest.approx(pred, abs=1e-6) and items[method]["gold"] == sts.gold
        assert got[method]["pearson"] == pytest.approx(stats.pearsonr(pred, sts.gold).statistic, abs=1e-6), method
        # ranks: ColBERT scores of near-identical pairs tie at float32 resolution and may swap places
        assert got[method]["spearman"] == pytest.approx(stats.spearmanr(pred, sts.gold).statistic, abs=1e-3), method


def test_a_real_encoder_through_every_runner(samples, tiny):
    """tiny BERT end to end (random weights: its vectors nearly coincide, so numbers are checked with FakeM3)."""
    scorer = EncoderScorer(tiny, show_progress=False)
    assert scorer.methods == ("dense",)
    sts = run_sts(load_task("sts", samples["sts"]), scorer)["dense"]
    assert -1 <= sts["pearson"] <= 1 and -1 <= sts["spearman"] <= 1
    for kind, runner in (("retrieval", run_retrieval), ("reranking", run_reranking)):
        scores = runner(load_task(kind, samples[kind]), scorer, ["map_cut_10", "ndcg_cut_10"])["dense"]
        assert 0 < scores["map_cut_10"] <= 1 and 0 < scores["ndcg_cut_10"] <= 1


def test_multi_head_encoder_scores_sparse_colbert_and_hybrid(samples):
    enc = FakeM3()
    scorer = EncoderScorer(enc, show_progress=False, rerank_depth=10_000)
    assert scorer.methods == ("dense", "sparse", "colbert", "hybrid")
    data = load_task("reranking", samples["reranking"])
    got = run_reranking(data, scorer, ["map_cut_10", "ndcg_cut_10"])
    for method in scorer.methods:
        # the task's own doc ids: sparse scores tie often, and trec_eval breaks ties by doc id
        run = {qid: dict(zip(judged, ref_scores(enc, data.queries[qid], [data.docs[d] for d in judged])[method].tolist()))
               for qid, judged in data.qrels.items()}
        assert got[method]["map_cut_10"] == pytest.approx(trec(run, data.qrels, ["map_cut_10"])["map_cut_10"], abs=1e-6), method
    assert len({round(got[m]["map_cut_10"], 6) for m in scorer.methods}) > 1  # the heads really differ
    weights = {"dense": 0.5, "sparse": 2.0, "colbert": 0.0}  # configurable hybrid weights
    reweighted = run_reranking(data, EncoderScorer(enc, hybrid_weights=weights, show_progress=False), ["map_cut_10"])
    run = {qid: dict(zip(judged, ref_scores(enc, data.queries[qid], [data.docs[d] for d in judged],
                                            (0.5, 2.0, 0.0))["hybrid"].tolist())) for qid, judged in data.qrels.items()}
    assert reweighted["hybrid"]["map_cut_10"] == pytest.approx(trec(run, data.qrels, ["map_cut_10"])["map_cut_10"], abs=1e-6)

    # retrieval: sparse is exact over the corpus; ColBERT/hybrid rescore a pool that here covers every doc
    ret = load_task("retrieval", samples["retrieval"])
    got = run_retrieval(ret, scorer, ["ndcg_cut_10", "map_cut_10"], depth=1024)
    reference = {qid: ref_scores(enc, text, list(ret.docs.values())) for qid, text in ret.queries.items()}
    for method in scorer.methods:
        run = {qid: dict(zip(ret.docs, reference[qid][method].tolist())) for qid in ret.queries}
        ref = trec(run, ret.qrels, ["ndcg_cut_10", "map_cut_10"])
        assert got[method]["ndcg_cut_10"] == pytest.approx(ref["ndcg_cut_10"], abs=1e-5), method
        assert got[method]["map_cut_10"] == pytest.approx(ref["map_cut_10"], abs=1e-5), method
    dense_only = EncoderScorer(enc, heads=["dense"], show_progress=False)
    assert dense_only.methods == ("dense",)


def test_acc_at_n_uses_the_sampled_negatives(samples):
    data = load_task("retrieval", samples["retrieval"])
    n, enc = 20, FakeM3()
    items: dict = {}
    got = run_retrieval(data, EncoderScorer(enc, heads=["dense"], show_progress=False), [f"acc_{n}", "mrr_10"],
                        seed=3, items=items)["dense"][f"acc_{n}"]
    # reference: the same trials (metrics.sample_acc_trials, seeded) scored by brute force
    from care.evaluation.metrics import sample_acc_trials

    qids, dids = list(data.queries), list(data.docs)
    full = enc.encode([data.queries[q] for q in qids], "query", 32, ["dense"], False).dense @ enc.encode(list(data.docs.values()), "query", 32, ["dense"], False).dense.T
    relevant = [[dids.index(d) for d, g in data.qrels[q].items() if g >= 1] for q in qids]
    trials = list(sample_acc_trials(relevant, n, len(dids), seed=3))
    wins = [full[q, p] > full[q, negs].max() for q, p, negs in trials]
    assert got == pytest.approx(np.mean(wins))
    # its items are the trials (what compare.py / evaluate.py's gain rows resample), beside the queries' mrr_10
    per_item = items["dense"]["per_query"]
    acc = {k: v[f"acc_{n}"] for k, v in per_item.items() if f"acc_{n}" in v}
    assert acc == {f"{qids[q]}#{dids[p]}": float(w) for (q, p, _), w in zip(trials, wins)}
    assert 0 < sum(acc.values()) < len(acc)  # both outcomes occur: the check can tell trials apart
    assert {k for k, v in per_item.items() if "mrr_10" in v} == set(qids)


# ---- BM25 -------------------------------------------------------------------------------------------------

def lucene_bm25(query: list[str], docs: list[list[str]], k1=1.5, b=0.75) -> np.ndarray:
    n, avg = len(docs), np.mean([len(d) for d in docs])
    df = Counter(t for d in docs for t in set(d))
    out = []
    for d in docs:
        tf = Counter(d)
        out.append(sum(math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) * tf[t] / (tf[t] + k1 * (1 - b + b * len(d) / avg))
                       for t in set(query) if t in tf))
    return np.array(out)


def test_bm25_equals_lucene_formula(samples):
    data = load_task("retrieval", samples["retrieval"])
    assert tokenize("小孩子发烧39度怎么办？") == ["小孩子", "发烧", "39", "度", "怎么办"]
    docs = list(data.docs.values())
    prepared = BM25Scorer().prepare(list(data.queries.values()), docs)
    idx, scores = prepared.search(depth=1000)["bm25"]
    for qi, query in enumerate(data.queries.values()):
        ref = lucene_bm25(list(dict.fromkeys(tokenize(query))), [tokenize(d) for d in docs])
        np.testing.assert_allclose(prepared.score("bm25", qi, np.arange(len(docs))), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(scores[qi], ref[idx[qi]], rtol=1e-5, atol=1e-6)
        assert (np.diff(scores[qi]) <= 1e-6).all()  # best first
    got = run_reranking(load_task("reranking", samples["reranking"]), BM25Scorer(), ["map_cut_10"])
    assert set(got) == {"bm25"} and 0 < got["bm25"]["map_cut_10"] <= 1
