"""A reranker scored by evaluate.py (issue #35 item 2), on tiny models: retrieve-then-rerank returns the first
stage's top k reordered by the cross-encoder, and `ckpt=<reranker>` scores the candidate-list slots with its
pair scores, the retrieval slot behind the configured retriever, STS n/a, both stages in the efficiency
columns.  References independent of the code: the first stage as a NumPy product of the encoder's own vectors
and its top k by argsort, each pair scored alone by transformers' AutoModelForSequenceClassification, the
rerank slot's MAP@10 by pytrec_eval over those scores."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _evaluation_helpers import trec
from test_evaluate_cli import DOCS, QUERIES, overrides, task_paths  # noqa: F401 (task_paths: a fixture)
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from care.config import load_config
from care.data.io import write_json
from care.encoders import build_encoder, detect
from care.encoders.cross_encoder import CrossEncoder
from care.encoders.registry import TRAINING_RECORD
from care.models.tiny import save_tiny
from care.retrieval.rerank import RERANK, RerankerScorer
from care.retrieval.scorer import EncoderScorer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp("reranker") / "final", "reranker", seed=5)
    write_json(folder / TRAINING_RECORD, {"model": {"kind": "reranker", "name": "tiny_reranker", "path": ".",
                                                     "max_length": 128}})
    return folder


def alone(folder, pairs) -> np.ndarray:
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return np.array([float(model(**tok(q, d, truncation=True, max_length=128, return_tensors="pt")).logits[0, 0])
                         for q, d in pairs])


def test_retrieve_then_rerank_equals_a_brute_force_reorder(reranker, tiny_bert_dir):
    encoder = build_encoder(detect(tiny_bert_dir, {"name": "tiny"}))
    k = 3
    scorer = RerankerScorer(CrossEncoder(str(reranker), max_length=128), EncoderScorer(encoder), k=k, batch_size=4)
    idx, val = scorer.prepare(QUERIES, DOCS, task="retrieval").search(depth=1024)[RERANK]
    first = encoder.encode_queries(QUERIES).dense @ encoder.encode_documents(DOCS).dense.T
    for qi, q in enumerate(QUERIES):
        top = np.argsort(-first[qi], kind="stable")[:k]
        s = alone(reranker, [(q, DOCS[j]) for j in top])
        order = np.argsort(-s, kind="stable")
        assert idx[qi].tolist() == top[order].tolist()
        np.testing.assert_allclose(val[qi], s[order], atol=1e-5)


def test_evaluate_a_reranker_checkpoint(task_paths, reranker, tiny_bert_dir, tmp_path):  # noqa: F811
    from evaluate import evaluate

    cfg = load_config("evaluate", overrides(task_paths, tmp_path, f"ckpt={reranker}", "baselines=[]",
                                            f"rerank.retriever={tiny_bert_dir}", "rerank.k=4", cmedqa2=False))
    result = evaluate(cfg)
    row = json.loads((tmp_path / "eval" / "summary.json").read_text())["models"][0]
    scores = row["scores"]
    assert {"cmedteb/cmed_v1", "cmedteb/cmed_v2", "cmedteb/rerank", "cmedteb/retrieval"} <= set(scores)
    assert "cmedteb/sts" not in scores and "cmedteb/avg" not in scores  # STS n/a, so no five-slot mean
    assert "reranks the top 4 of" in row["label"] and "| n/a |" in result["table"]
    # the rerank slot: every candidate list scored pair by pair, MAP@10 by trec_eval
    lists = [json.loads(x) for x in task_paths["rerank"].read_text(encoding="utf-8").splitlines()]
    run, qrels = {}, {}
    for i, r in enumerate(lists):
        cands = list(dict.fromkeys(r["positive"] + r["negative"]))
        run[f"q{i}"] = dict(zip(cands, alone(reranker, [(r["query"], d) for d in cands]).tolist()))
        qrels[f"q{i}"] = {d: int(d in r["positive"]) for d in cands}
    assert scores["cmedteb/rerank"] == pytest.approx(100 * trec(run, qrels, ["map_cut_10"])["map_cut_10"], abs=1e-3)
    e = row["efficiency"]
    retriever = build_encoder(detect(tiny_bert_dir, {"name": "tiny"}))
    cross = CrossEncoder(str(reranker))
    assert e["online_parameters"] == cross.online_parameters + retriever.online_parameters
    assert e["query_latency_ms_p50"] > 0 and e["docs_per_second"] > 0


def test_truncate_dim_refuses_a_reranker_in_its_own_words():
    from care.evaluation.entries import cut_entry

    with pytest.raises(ValueError, match="truncate_dim=128: its pair scores are no vectors"):
        cut_entry({"name": "r", "label": "r", "model": {"kind": "reranker", "path": "p"}}, 128)
