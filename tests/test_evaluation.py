"""Task runners, the embedding cache, BM25, benchmarks-as-configs, reports and the stand-in builder.

Every score is checked against an independent reference: pytrec_eval (trec_eval itself) on runs built by
brute-force numpy scoring, scipy for correlations, a hand-written Lucene BM25, and plain-Python sparse /
ColBERT / hybrid formulas.  Task files are small real-data samples written to tmp_path.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
from collections import Counter

import numpy as np
import pytest
import pytrec_eval
from scipy import stats

from care.config import load_config
from care.data.io import DataError, write_jsonl
from care.data.tasks import load_task
from care.encoders import Embeddings, Encoder
from care.encoders.cache import EmbeddingCache, list_hash, text_key
from care.encoders.dense import HFDenseEncoder
from care.evaluation.benchmarks import average, load_benchmark, resolve_paths
from care.evaluation.report import columns, write_summary
from care.evaluation.tasks import run_reranking, run_retrieval, run_sts
from care.retrieval.bm25 import BM25Scorer, tokenize
from care.retrieval.scorer import EncoderScorer

# ---- fixtures: small task files from the real data ------------------------------------------------------


def write_beir(folder, corpus: dict, queries: dict, qrels: dict, split: str = "test"):
    write_jsonl(folder / "corpus.jsonl", ({"_id": k, "text": v} for k, v in corpus.items()))
    write_jsonl(folder / "queries.jsonl", ({"_id": k, "text": v} for k, v in queries.items()))
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{g}" for q, j in qrels.items() for d, g in j.items()]
    (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def samples(shared, tmp_path_factory):
    """A BEIR folder (12 KUAKE-QTR dev queries, their titles + 40 train titles, graded qrels), a reranking file
    (cMedIR test, label >= 2 positive) and an STS file (KUAKE-QQR dev), all small."""
    tmp = tmp_path_factory.mktemp("tasks")
    dev = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    train = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_train.json").read_text(encoding="utf-8"))
    qid_of, corpus, qrels = {}, {}, {}
    for row in dev:
        if row["query"] not in qid_of:
            if len(qid_of) == 12:
                continue
            qid_of[row["query"]] = f"q{len(qid_of)}"
        did = f"t{len(corpus)}"
        corpus[did] = row["title"]
        qrels.setdefault(qid_of[row["query"]], {})[did] = int(row["label"])
    queries = {qid: text for text, qid in qid_of.items()}
    for row in train[:40]:
        corpus[f"t{len(corpus)}"] = row["title"]
    retrieval = write_beir(tmp / "retrieval", corpus, queries, qrels)

    rows, groups = [], {}
    for line in (shared / "chineseblue_cmedir" / "test.json").read_text(encoding="utf-8").splitlines()[:120]:
        r = json.loads(line)
        for d in r["documents"]:
            groups.setdefault(r["query"], {})[d["title"].lstrip(":")] = int(d["label"])
    for query, judged in groups.items():
        pos = [t for t, g in judged.items() if g >= 2]
        neg = [t for t, g in judged.items() if g < 2]
        if pos and neg:
            rows.append({"query": query, "positive": pos, "negative": neg})
    reranking = tmp / "rerank.jsonl"
    write_jsonl(reranking, rows[:15])

    qqr = json.loads((shared / "cblue_kuake_qqr" / "KUAKE-QQR_dev.json").read_text(encoding="utf-8"))
    sts = tmp / "sts.jsonl"
    write_jsonl(sts, ({"sentence1": r["query1"], "sentence2": r["query2"], "score": int(r["label"])}
                      for r in qqr[10:50]))
    return {"retrieval": retrieval, "reranking": reranking, "sts": sts, "qrels": qrels, "corpus": corpus,
            "queries": queries}


@pytest.fixture(scope="module")
def tiny(tiny_bert_dir):
    return HFDenseEncoder(str(tiny_bert_dir), name="tiny", pooling="cls", max_length=64)


def trec(run, qrels, measures):
    """trec_eval means over every qrels query (a query missing from the run counts 0, as trec_eval -c)."""
    per_query = pytrec_eval.RelevanceEvaluator(qrels, set(measures)).evaluate(run)
    return {m: sum(per_query.get(q, {}).get(m, 0.0) for q in qrels) / len(qrels) for m in measures}


# ---- a deterministic multi-head encoder -----------------------------------------------------------------

def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(int(hashlib.md5(key.encode()).hexdigest()[:8], 16))


def _unit(v):
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


class FakeM3(Encoder):
    """Dense = a text-seeded random unit vector; sparse = one weight per character (its code point mod 7);
    ColBERT = one unit vector per character.  Counts the texts it encodes; can be told to return NaN."""

    heads = ("dense", "sparse", "colbert")
    name = "fake_m3"

    def __init__(self, nan_for: str | None = None):
        self.encoded = 0
        self.nan_for = nan_for

    def identity(self, side):
        return {"fake": "m3", "nan": self.nan_for}

    @property
    def online_parameters(self):
        return 1234

    def encode(self, texts, side, batch_size, heads, show_progress):
        self.encoded += len(texts)
        dense = np.stack([_unit(_rng(t).normal(size=8)) for t in texts]).astype(np.float32) if texts else np.zeros((0, 8), np.float32)
        for i, t in enumerate(texts):
            if t == self.nan_for:
                dense[i, 0] = np.nan
        sparse = [{ord(c): (ord(c) % 7 + 1) / 7 for c in t} for t in texts] if "sparse" in heads else None
        colbert = ([np.stack([_unit(_rng(c).normal(size=4)) for c in t]).astype(np.float32) for t in texts]
                   if "colbert" in heads else None)
        return Embeddings(dense, sparse, colbert)


def ref_lexical(a: dict, b: dict) -> float:
    return sum(w * b[t] for t, w in a.items() if t in b)


def ref_colbert(q: np.ndarray, d: np.ndarray) -> float:
    return float(np.mean([max(float(qv @ dv) for dv in d) for qv in q]))


def ref_scores(enc: FakeM3, query: str, docs: list[str], weights=(1.0, 0.3, 1.0)) -> dict[str, np.ndarray]:
    q = enc.encode([query], "query", 32, enc.heads, False)
    d = enc.encode(docs, "query", 32, enc.heads, False)
    out = {"dense": d.dense @ q.dense[0],
           "sparse": np.array([ref_lexical(q.sparse[0], s) for s in d.sparse]),
           "colbert": np.array([ref_colbert(q.colbert[0], c) for c in d.colbert])}
    out["hybrid"] = (weights[0] * out["dense"] + weights[1] * out["sparse"] + weights[2] * out["colbert"]) / sum(weights)
    return out


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
    got = run_retrieval(data, EncoderScorer(enc, heads=["dense"], show_progress=False), [f"acc_{n}"], seed=3)["dense"][f"acc_{n}"]
    # reference: the same trials (metrics.sample_acc_trials, seeded) scored by brute force
    from care.evaluation.metrics import sample_acc_trials

    qids, dids = list(data.queries), list(data.docs)
    full = enc.encode([data.queries[q] for q in qids], "query", 32, ["dense"], False).dense @ enc.encode(list(data.docs.values()), "query", 32, ["dense"], False).dense.T
    relevant = [[dids.index(d) for d, g in data.qrels[q].items() if g >= 1] for q in qids]
    wins = [full[q, p] > full[q, negs].max() for q, p, negs in sample_acc_trials(relevant, n, len(dids), seed=3)]
    assert got == pytest.approx(np.mean(wins))


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


# ---- the embedding cache ---------------------------------------------------------------------------------

def test_cache_encodes_each_text_once_and_survives_bad_chunks(tmp_path, caplog):
    enc = FakeM3()
    cache = EmbeddingCache(tmp_path)
    heads = enc.heads

    def get(texts):
        return cache.get(enc.fingerprint, "document", heads, texts, lambda t: enc.encode_documents(t, heads=heads))

    texts = ["头痛", "发烧怎么办", "头痛", "糖尿病饮食"]
    first = get(texts)
    assert enc.encoded == 3  # the repeated text is encoded once
    direct = FakeM3().encode(texts, "document", 32, heads, False)
    np.testing.assert_array_equal(first.dense, direct.dense)
    for a, b in zip(first.sparse, direct.sparse):  # weights are stored as float32, as models give them
        assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), rtol=1e-6)
    for a, b in zip(first.colbert, direct.colbert):
        np.testing.assert_array_equal(a, b)

    again = get(["糖尿病饮食", "头痛"])  # a subset in another order: served from the chunk
    assert enc.encoded == 3
    np.testing.assert_array_equal(again.dense, direct.dense[[3, 0]])
    mixed = get(["新的文本", "发烧怎么办"])  # only the new text is encoded
    assert enc.encoded == 4 and len(list((tmp_path).rglob("*.npz"))) == 2
    np.testing.assert_array_equal(mixed.dense[1], direct.dense[1])
    assert cache.get(enc.fingerprint, "query", heads, ["头痛"], lambda t: enc.encode_queries(t, heads=heads))
    assert enc.encoded == 5  # the query side is a separate key

    # an encoder failing half way leaves no chunk behind
    chunks = set(tmp_path.rglob("*.npz"))
    with pytest.raises(RuntimeError):
        cache.get(enc.fingerprint, "document", heads, ["失败"], lambda t: (_ for _ in ()).throw(RuntimeError("boom")))
    assert set(tmp_path.rglob("*.npz")) == chunks and not list(tmp_path.rglob("*.tmp"))
    # a truncated chunk is ignored (with a warning) and its texts re-encoded
    victim = tmp_path / enc.fingerprint / "doc-dense+sparse+colbert" / f"{list_hash([text_key(t) for t in texts[:2] + texts[3:]])}.npz"
    victim.write_bytes(victim.read_bytes()[:40])
    before = enc.encoded
    fresh = EmbeddingCache(tmp_path)
    with caplog.at_level("WARNING"):
        out = fresh.get(enc.fingerprint, "document", heads, texts, lambda t: enc.encode_documents(t, heads=heads))
    assert "unreadable" in caplog.text and enc.encoded > before
    np.testing.assert_array_equal(out.dense, direct.dense)


def test_scorer_uses_cache_and_nan_stops_with_the_text(samples, tmp_path):
    data = load_task("reranking", samples["reranking"])
    enc = FakeM3()
    scorer = EncoderScorer(enc, EmbeddingCache(tmp_path), show_progress=False)
    first = run_reranking(data, scorer, ["map_cut_10"])
    n = enc.encoded
    assert run_reranking(data, scorer, ["map_cut_10"]) == first and enc.encoded == n

    bad_text = data.docs[next(iter(data.docs))]
    bad = EncoderScorer(FakeM3(nan_for=bad_text), EmbeddingCache(tmp_path / "nan"), show_progress=False)
    with pytest.raises(FloatingPointError, match="NaN") as err:
        run_reranking(data, bad, ["map_cut_10"])
    assert bad_text[:20] in str(err.value)
    assert not list((tmp_path / "nan").rglob("doc-*/*.npz"))  # NaN never reaches the cache


# ---- bad input ---------------------------------------------------------------------------------------------

def test_bad_task_files_name_file_line_and_field(tmp_path, samples):
    folder = write_beir(tmp_path / "beir", {"d1": "头痛"}, {"q1": "头疼怎么办"}, {"q1": {"d1": 1, "d404": 1}})
    with pytest.raises(DataError) as err:
        load_task("retrieval", folder)
    assert "qrels/test.tsv" in str(err.value) and "line 3" in str(err.value) and "d404" in str(err.value)

    empty = tmp_path / "empty.jsonl"
    write_jsonl(empty, [{"query": "头痛", "positive": [], "negative": []}])
    with pytest.raises(DataError, match="line 1.*no candidates"):
        load_task("reranking", empty)

    wrong = tmp_path / "sts.jsonl"
    write_jsonl(wrong, [{"text1": "头痛", "text2": "头疼", "score": 1}])
    with pytest.raises(DataError) as err:
        load_task("sts", wrong)
    assert str(wrong) in str(err.value) and "sentence1" in str(err.value) and "line 1" in str(err.value)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_task("sts", tmp_path / "missing.jsonl")


# ---- benchmarks, Avg, reports -------------------------------------------------------------------------------

def test_benchmark_configs_compose_and_missing_paths_are_named():
    cfg = load_config("evaluate")
    assert cfg.model.name == "me5_small" and cfg.benchmark.name == "cmedteb_open"
    assert cfg.extra_benchmark.name == "cmedqa2_retrieval" and list(cfg.baselines) == ["bm25", "me5_small"]
    open_bench = load_benchmark(cfg.benchmark)
    assert [t.slot for t in open_bench.tasks] == ["CMed v1", "CMed v2", "Retrieval", "Rerank", "STS"]
    assert [t.primary for t in open_bench.tasks] == ["map_cut_10", "map_cut_10", "ndcg_cut_10", "map_cut_10", "pearson"]
    assert open_bench.open_stand_in

    real = load_benchmark(load_config("evaluate", ["benchmark=cmedteb"]).benchmark)
    with pytest.raises(FileNotFoundError) as err:  # conftest sets HF_HUB_OFFLINE=1: no hub fallback
        resolve_paths(real)
    msg = str(err.value)
    for key in ("cmed_v1", "cmed_v2", "retrieval", "rerank", "sts"):
        assert f"benchmark.tasks.{key}.path=" in msg
    assert "C-MTEB/CMedQAv1-reranking" in msg and "BEIR folder" in msg

    extra = load_benchmark(load_config("evaluate").extra_benchmark, "extra_benchmark")
    assert [t.key for t in resolve_paths(extra, "extra_benchmark")] == ["cmedqa2"]  # the optional one is skipped
    assert average(open_bench, dict(zip([t.key for t in open_bench.tasks], [0.5, 0.6, 0.4, 0.7, 0.9]))) == \
        pytest.approx(100 * (0.5 + 0.6 + 0.4 + 0.7 + 0.9) / 5)
    assert average(open_bench, {"cmed_v1": 0.5}) is None


def test_report_files_say_open_stand_in(tmp_path):
    bench = load_benchmark(load_config("evaluate").benchmark)
    cols = columns([bench])
    rows = [{"label": f"m{i}", "scores": {c["key"]: 10.0 * (i + 1) for c in cols},
             "efficiency": {"online_parameters": 117_000_000, "query_latency_ms_p50": 12.0,
                            "query_latency_ms_p95": 20.0, "docs_per_second": 80.0}} for i in range(2)]
    text = write_summary(tmp_path, "run", [bench], rows, {"table_method": "dense"})
    assert "open stand-in" in text and "| m1 | 20.00 |" in text and "| 117.0 | 12.0 | 20.0 | 80 |" in text
    assert "| Model | CMed v1 MAP@10 (stand-in) |" in text and "| Avg (stand-in) |" in text
    assert "cEpilepsyQA" in text  # slot sources named
    assert (tmp_path / "slots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["benchmarks"][0]["open_stand_in"] is True


def test_report_shows_the_gain_over_the_zero_shot_baseline(tmp_path):
    bench = load_benchmark(load_config("evaluate").benchmark)
    cols = columns([bench])
    scores = {"tuned": 50.0, "me5": 47.5, "bm25": 90.0}
    rows = [{"name": n, "label": n, "baseline": n != "tuned", "efficiency": {},
             "scores": {c["key"]: v + j for j, c in enumerate(cols)}} for n, v in scores.items()]
    text = write_summary(tmp_path, "run", [bench], rows, {"table_method": "dense"})
    gain = next(line for line in text.splitlines() if line.startswith("| gain of tuned over me5 |"))
    # the difference to the first encoder baseline (never BM25), on every score column
    assert gain.split(" | ")[1:1 + len(cols)] == ["+2.50"] * len(cols)
    assert not any(line.startswith("| gain of me5") or "over bm25" in line for line in text.splitlines())


# ---- the stand-in builder on the real shared data ---------------------------------------------------------

def test_stand_in_builder_matches_the_raw_files(shared, tmp_path):
    from omegaconf import OmegaConf

    from data_pipeline.benchmarks import build

    data = OmegaConf.to_container(load_config("data_pipeline").data, resolve=True)
    stats = build("cmedteb_open", data, tmp_path)
    out = tmp_path / "benchmarks" / "cmedteb_open"

    # Retrieval: every distinct non-empty KUAKE-QTR title; dev queries with a title labelled >= 1
    titles, dev_q = set(), {}
    for split in ("train", "dev", "test"):
        for r in json.loads((shared / "cblue_kuake_qtr" / f"KUAKE-QTR_{split}.json").read_text(encoding="utf-8")):
            if r["title"].strip():
                titles.add(r["title"].strip())
            if split == "dev":
                dev_q[r["query"].strip()] = max(dev_q.get(r["query"].strip(), 0), int(r["label"]))
    ret = load_task("retrieval", out / "retrieval", split="dev")
    assert set(ret.docs.values()) == titles
    assert sorted(ret.queries.values()) == sorted(q for q, best in dev_q.items() if best >= 1)
    assert stats["slots"]["retrieval"]["dropped_no_relevant"] == sum(best < 1 for best in dev_q.values())

    # STS: KUAKE-QQR dev without s9
    qqr = [r for r in json.loads((shared / "cblue_kuake_qqr" / "KUAKE-QQR_dev.json").read_text(encoding="utf-8"))
           if r["id"] != "s9"]
    sts = load_task("sts", out / "sts" / "dev.jsonl", split="dev")
    assert sts.gold == [float(r["label"]) for r in qqr]

    # CMed v2: the trusted questions (1-2 positives) of the ChineseBLUE cMedQA2 test file
    pos = Counter()
    with open(shared / "chineseblue_cmedqa2_pairs" / "test.txt", encoding="utf-8", newline="") as fh:
        for label, question, answer in csv.reader(fh, delimiter="\t"):  # csv-quoted TSV
            pos[question.strip()] += int(label)
    v2 = load_task("reranking", out / "cmed_v2" / "test.jsonl")
    assert sorted(v2.queries.values()) == sorted(q for q, n in pos.items() if 1 <= n <= 2)

    # CMed v1: 490 cEpilepsyQA test questions, one positive each, 95-100 unique candidates
    v1 = load_task("reranking", out / "cmed_v1" / "test.jsonl")
    sizes = [len(j) for j in v1.qrels.values()]
    assert len(v1.queries) == 490 and min(sizes) >= 95 and max(sizes) <= 100
    assert all(sum(j.values()) == 1 for j in v1.qrels.values())

    # Rerank: every positive came from a cMedIR label >= 2
    labels = {}
    for line in (shared / "chineseblue_cmedir" / "test.json").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        for d in r["documents"]:
            key = (r["query"].strip(), d["title"].lstrip(":").strip())
            labels[key] = max(labels.get(key, 0), int(d["label"]))  # a title judged twice keeps its best label
    for row in map(json.loads, (out / "rerank" / "test.jsonl").read_text(encoding="utf-8").splitlines()):
        assert all(labels[(row["query"], t)] >= 2 for t in row["positive"])
        assert all(labels[(row["query"], t)] <= 1 for t in row["negative"])
        assert row["positive_grades"] == [labels[(row["query"], t)] for t in row["positive"]]

    mtime = (out / "sts" / "dev.jsonl").stat().st_mtime_ns
    assert build("cmedteb_open", data, tmp_path).get("skipped") is True  # idempotent
    assert (out / "sts" / "dev.jsonl").stat().st_mtime_ns == mtime


def test_a_cmedqa2_release_folder_loads_as_retrieval(shared):
    """cEpilepsyQA ships in cMedQA2's release format: the loader behind `cmedqa2_release` (reader: cmedqa_release)."""
    data = load_task("retrieval", shared / "cepilepsyqa", split="test", reader="cmedqa_release")
    with open(shared / "cepilepsyqa" / "answer.csv", encoding="utf-8", newline="") as fh:
        answers = {r["ans_id"]: r["content"].strip() for r in csv.DictReader(fh)}
    with open(shared / "cepilepsyqa" / "test_candidates.txt", encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(data.docs.values()) == sorted(answers.values())  # the corpus is every answer
    assert len(data.queries) == len({r["question_id"] for r in rows})
    positives = {(r["question_id"], r["ans_id"]) for r in rows if r["label"] == "1"}
    got = {(q.split(":", 2)[2], d.split(":", 2)[2]) for q, j in data.qrels.items() for d, g in j.items() if g >= 1}
    assert got == positives
