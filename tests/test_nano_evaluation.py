"""Evaluation on Nano datasets: a fixture written the way the hub stores NanoCMTEB (hub file names, README
configs with globs, HAKARI's column names, a dense config named after harrier) is read and scored with no
code change; the candidate reranking shuffles, drops the safeguard when asked, and agrees with pytrec_eval."""
from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import pytrec_eval

from care.config import load_config
from care.data.nano import load_split, splits
from care.data.tasks import load_task
from care.evaluation.benchmarks import load_benchmark
from care.evaluation.tasks import run_candidates, shuffled

SPLITS = {"cmedqa": 0, "medical": 1}
N_DOCS, N_QUERIES = 130, 12


def _write(path, columns: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    types = {"_id": pa.string(), "text": pa.string(), "query-id": pa.string(), "corpus-id": pa.string(),
             "corpus-ids": pa.list_(pa.string())}
    pq.write_table(pa.table({k: pa.array(v, type=types[k]) for k, v in columns.items()}), path)


def _texts(shared) -> tuple[list[str], list[str]]:
    """Real Chinese medical questions and answers (ChineseBLUE cMedQA2 test) for the fixture's texts."""
    rows = [line.split("\t") for line in (shared / "chineseblue_cmedqa2_pairs" / "test.txt")
            .read_text(encoding="utf-8").splitlines()[1:400]]
    questions = list(dict.fromkeys(r[1] for r in rows if len(r) >= 3))
    answers = list(dict.fromkeys(r[2] for r in rows if len(r) >= 3))
    return questions, answers


@pytest.fixture(scope="module")
def nanocmteb(shared, tmp_path_factory):
    """A two-split dataset in NanoCMTEB's hub layout, built here with pyarrow (not with our writer)."""
    root = tmp_path_factory.mktemp("NanoCMTEB")
    questions, answers = _texts(shared)
    truth = {}
    configs = ["queries", "corpus", "qrels", "bm25", "harrier_oss_v1_270m", "reranking_hybrid"]
    meta = {"splits": {}}
    for split, offset in SPLITS.items():
        rng = random.Random(offset)
        docs = {f"{split}-d{i}": answers[(i + offset) % len(answers)] for i in range(N_DOCS)}
        queries = {f"{split}-q{i}": questions[i + offset] for i in range(N_QUERIES)}
        ids = list(docs)
        qrels = {q: rng.sample(ids, 1 + i % 2) for i, q in enumerate(queries)}
        hybrid, additions = {}, []
        for i, q in enumerate(queries):
            others = [d for d in ids if d not in qrels[q]]
            rng.shuffle(others)
            if i % 3 == 0:  # no positive in the fused top 100: the safeguard at 101
                hybrid[q] = others[:100] + [min(qrels[q])]
                additions.append({"query_id": q, "reason": "missing_positive_in_rrf_top_100",
                                  "corpus_id": hybrid[q][100], "rank": 101})
            else:
                hybrid[q] = qrels[q][:1] + others[:99]
        _write(root / "queries" / f"{split}-00000-of-00001.parquet", {"_id": list(queries), "text": list(queries.values())})
        _write(root / "corpus" / f"{split}-00000-of-00001.parquet", {"_id": ids, "text": list(docs.values())})
        pairs = [(q, d) for q in queries for d in qrels[q]]
        _write(root / "qrels" / f"{split}-00000-of-00001.parquet",
               {"query-id": [q for q, _ in pairs], "corpus-id": [d for _, d in pairs]})
        for config in ("bm25", "harrier_oss_v1_270m"):
            _write(root / config / f"{split}-00000-of-00001.parquet",
                   {"query-id": list(queries), "corpus-ids": [rng.sample(ids, len(ids)) for _ in queries]})
        _write(root / "reranking_hybrid" / f"{split}-00000-of-00001.parquet",
               {"query-id": list(queries), "corpus-ids": [hybrid[q] for q in queries]})
        meta["splits"][split] = {"reranking_hybrid": {"additions": additions}}
        truth[split] = {"queries": queries, "docs": docs, "qrels": qrels, "hybrid": hybrid, "additions": additions}
    card = ["---", "configs:"]
    for config in configs:
        card += [f"- config_name: {config}"] + (["  default: true"] if config == "queries" else []) + ["  data_files:"]
        card += [line for split in SPLITS for line in (f"  - split: {split}", f"    path: {config}/{split}-*")]
    (root / "README.md").write_text("\n".join(card + ["---", "", "# NanoCMTEB-shaped fixture", ""]), encoding="utf-8")
    (root / "reranking_hybrid_metadata.json").write_text(json.dumps(meta), encoding="utf-8")
    return root, truth


def test_loader_reads_the_hub_layout(nanocmteb):
    root, truth = nanocmteb
    assert splits(root) == list(SPLITS)
    s = load_split(root, "medical")
    t = truth["medical"]
    assert s.queries == t["queries"] and s.corpus == t["docs"]
    assert {q: set(j) for q, j in s.qrels.items()} == {q: set(d) for q, d in t["qrels"].items()}
    assert set(s.candidates) == {"bm25", "harrier_oss_v1_270m", "reranking_hybrid"}
    assert s.candidates["reranking_hybrid"] == t["hybrid"]
    assert s.safeguards == {a["query_id"]: a["corpus_id"] for a in t["additions"]} and s.safeguards


def test_safeguards_inferred_without_metadata(nanocmteb, tmp_path):
    import shutil

    root, truth = nanocmteb
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "reranking_hybrid_metadata.json").unlink()
    s = load_split(copy, "cmedqa")
    assert s.safeguards == {a["query_id"]: a["corpus_id"] for a in truth["cmedqa"]["additions"]}


def test_a_candidate_outside_the_corpus_is_named(nanocmteb, tmp_path):
    import shutil

    from care.data.io import DataError

    root, truth = nanocmteb
    copy = tmp_path / "bad"
    shutil.copytree(root, copy)
    t = truth["cmedqa"]
    rows = [t["hybrid"][q] for q in t["queries"]]
    rows[2] = rows[2][:-1] + ["no-such-doc"]
    _write(copy / "reranking_hybrid" / "cmedqa-00000-of-00001.parquet", {"query-id": list(t["queries"]), "corpus-ids": rows})
    with pytest.raises(DataError, match="no-such-doc"):
        load_split(copy, "cmedqa")


class MatrixScorer:
    """A scorer with given scores (query i, doc j): the runners' interface, no model."""

    methods = ("dense",)

    def __init__(self, scores: np.ndarray):
        self.scores = scores

    def prepare(self, queries, docs, doc_side="document", cosine=False, task=None):
        assert len(queries) == self.scores.shape[0] and len(docs) == self.scores.shape[1]
        return self

    def score(self, method, qi, docs):
        return self.scores[qi, np.asarray(docs)]


def _pytrec(run: dict, qrels: dict, metrics: set[str]) -> dict[str, float]:
    per_query = pytrec_eval.RelevanceEvaluator(qrels, metrics).evaluate(run)
    return {m: float(np.mean([per_query.get(q, {}).get(m, 0.0) for q in qrels])) for m in metrics}


@pytest.mark.parametrize("safeguard", [True, False])
def test_candidate_reranking_matches_pytrec_eval(nanocmteb, safeguard):
    root, _ = nanocmteb
    data = load_task("candidates", root, "cmedqa", reader="nano")
    rng = np.random.default_rng(0)
    scores = rng.random((len(data.queries), len(data.docs))).astype(np.float32)  # distinct: no ties
    got = run_candidates(data, MatrixScorer(scores), ["ndcg_cut_10", "recall_100"], safeguard=safeguard)["dense"]
    dids = list(data.docs)
    run = {}
    for qi, q in enumerate(data.queries):
        cands = [d for d in data.candidates[q] if safeguard or d != data.safeguards.get(q)]
        run[q] = {d: float(scores[qi, dids.index(d)]) for d in cands}
    want = _pytrec(run, data.qrels, {"ndcg_cut_10", "recall_100"})
    assert got["ndcg_cut_10"] == pytest.approx(want["ndcg_cut_10"], abs=1e-9)
    assert got["recall_100"] == pytest.approx(want["recall_100"], abs=1e-9)
    if not safeguard:  # a query whose only listed positive was the safeguard can no longer find it
        with_sg = run_candidates(data, MatrixScorer(scores), ["recall_100"], safeguard=True)["dense"]
        assert got["recall_100"] < with_sg["recall_100"]


def _documented_order(qid: str, docs: list[str]) -> list[str]:
    """The candidate order as docs/nano.md states HAKARI's rule, written out here rather than taken from
    care.evaluation.tasks: ascending sha256 hex of "<seed>\\0<query id>\\0<doc id>", seed care-nano-candidates-v1."""
    return sorted(docs, key=lambda d: hashlib.sha256(("care-nano-candidates-v1" + "\0" + qid + "\0" + d)
                                                     .encode("utf-8")).hexdigest())


def test_ties_follow_the_shuffle_not_the_stored_order(nanocmteb):
    """A model that scores every candidate alike must not profit from the stored order (positive first in
    most rows) nor from rank 101: the ranking is the seeded shuffle."""
    root, _ = nanocmteb
    data = load_task("candidates", root, "cmedqa", reader="nano")
    flat = np.zeros((len(data.queries), len(data.docs)), dtype=np.float32)
    items = {}
    got = run_candidates(data, MatrixScorer(flat), ["ndcg_cut_10"], items=items)["dense"]
    run = {q: {d: float(-i) for i, d in enumerate(_documented_order(q, data.candidates[q]))} for q in data.queries}
    assert all(shuffled(q, data.candidates[q]) == list(run[q]) for q in data.queries)
    assert got["ndcg_cut_10"] == pytest.approx(_pytrec(run, data.qrels, {"ndcg_cut_10"})["ndcg_cut_10"], abs=1e-9)
    stored = {q: {d: float(-i) for i, d in enumerate(data.candidates[q])} for q in data.queries}
    assert _pytrec(stored, data.qrels, {"ndcg_cut_10"})["ndcg_cut_10"] > got["ndcg_cut_10"]
    assert set(items["dense"]["per_query"]) == set(data.queries)


def test_benchmark_config_expands_every_split_and_view(nanocmteb):
    root, _ = nanocmteb
    cfg = load_config("evaluate", ["benchmark=nano", f"benchmark.nano.path={root}"])
    bench = load_benchmark(cfg.benchmark)
    keys = [t.key for t in bench.tasks]
    assert keys == ["cmedqa", "medical", "cmedqa_hybrid", "medical_hybrid", "cmedqa_hybrid_nosg", "medical_hybrid_nosg"]
    assert {t.average for t in bench.tasks} == {None, "Hybrid mean", "Hybrid mean w/o safeguard"}
    only = load_benchmark(load_config("evaluate", ["benchmark=nano", f"benchmark.nano.path={root}",
                                                   "benchmark.nano.splits=[medical]", "benchmark.nano.views=[hybrid]"]).benchmark)
    assert [t.key for t in only.tasks] == ["medical_hybrid"]
    with pytest.raises(FileNotFoundError, match="stage=nano"):
        load_benchmark(load_config("evaluate", ["benchmark=nano", f"benchmark.nano.path={root / 'missing'}"]).benchmark)


def test_evaluate_scores_the_fixture_with_bm25_and_intervals(nanocmteb, tiny_bert_dir, tmp_path):
    """`evaluate.py benchmark=nano` on a folder in NanoCMTEB's layout: every view, the means, the gain rows
    over BM25 with paired-bootstrap intervals; no code knows this folder."""
    from evaluate import evaluate

    root, _ = nanocmteb
    cfg = load_config("evaluate", ["benchmark=nano", f"benchmark.nano.path={root}", "~benchmark@extra_benchmark",
                                   "model=tiny_bert", f"model.path={tiny_bert_dir}", "baselines=[bm25]",
                                   "gain_over=bm25", f"out_dir={tmp_path / 'eval'}", f"cache.dir={tmp_path / 'cache'}"])
    result = evaluate(cfg)
    tiny = next(r for r in result["rows"] if r["name"] == "tiny_bert")
    for key in ("nano/cmedqa", "nano/medical_hybrid", "nano/medical_hybrid_nosg", "nano/avg",
                "nano/avg/Hybrid mean", "nano/avg/Hybrid mean w/o safeguard"):
        assert key in tiny["scores"], key
    assert tiny["scores"]["nano/avg"] == pytest.approx((tiny["scores"]["nano/cmedqa"] + tiny["scores"]["nano/medical"]) / 2)
    intervals = tiny["gain"]["intervals"]
    assert tiny["gain"]["over"] == "bm25" and intervals["nano/cmedqa_hybrid"]["low"] <= intervals["nano/cmedqa_hybrid"]["high"]
    assert "Hybrid mean w/o safeguard" in result["table"] and "95% interval" in result["table"]
    record = json.loads((tmp_path / "eval" / "tiny_bert" / "nano" / "cmedqa_hybrid_nosg.json").read_text())
    assert set(record["scores"]["dense"]) == {"ndcg_cut_10", "recall_100", "mrr_10"}
