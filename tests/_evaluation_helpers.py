"""Shared by the evaluation tests: BEIR folders, trec_eval means, a deterministic multi-head encoder (FakeM3)
and plain-Python reference scores for its heads."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytrec_eval

from care.data.io import write_jsonl
from care.encoders import Embeddings, Encoder


def write_beir(folder, corpus: dict, queries: dict, qrels: dict, split: str = "test"):
    write_jsonl(folder / "corpus.jsonl", ({"_id": k, "text": v} for k, v in corpus.items()))
    write_jsonl(folder / "queries.jsonl", ({"_id": k, "text": v} for k, v in queries.items()))
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{g}" for q, j in qrels.items() for d, g in j.items()]
    (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


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
    """The two weight maps as dense vectors over the union of their tokens, dotted (math.fsum: exactly
    rounded), rather than the production loop over the shared tokens (care/encoders/scores.py)."""
    vocab = sorted(set(a) | set(b))
    return math.fsum(x * y for x, y in zip([a.get(t, 0.0) for t in vocab], [b.get(t, 0.0) for t in vocab]))


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


def kuake_qtr_beir(shared, folder, n_queries: int, n_extra_titles: int):
    """A small BEIR retrieval folder from the shared KUAKE-QTR files: the first `n_queries` dev queries, every
    dev title judged for them (graded qrels 0-3), and the first `n_extra_titles` train titles as distractors.
    Returns (folder, corpus, queries, qrels)."""
    import json

    dev = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    train = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_train.json").read_text(encoding="utf-8"))
    qid_of, corpus, qrels = {}, {}, {}
    for row in dev:
        if row["query"] not in qid_of:
            if len(qid_of) == n_queries:
                continue
            qid_of[row["query"]] = f"q{len(qid_of)}"
        did = f"t{len(corpus)}"
        corpus[did] = row["title"]
        qrels.setdefault(qid_of[row["query"]], {})[did] = int(row["label"])
    for row in train[:n_extra_titles]:
        corpus[f"t{len(corpus)}"] = row["title"]
    queries = {qid: text for text, qid in qid_of.items()}
    return write_beir(folder, corpus, queries, qrels), corpus, queries, qrels


class Recorder:
    """A project Encoder stand-in for the mteb adapter tests: records each call's side, task type and texts;
    a text's vector is [its length, 1 + (sum of its code points mod 7)]."""

    name, heads = "recorder", ("dense",)
    # what the Encoder interface says of a model (care/encoders/base.py): no torch network, widths unstated
    networks, dense_width, max_tokens, unit_vectors, backend = {}, None, None, True, "torch"

    def __init__(self):
        from care.encoders.prompts import Prompts

        self.prompts, self.calls, self.fingerprint = Prompts(), [], "f" * 16
        self.online_parameters, self.online_embedding_parameters = 7, 0

    @staticmethod
    def vector(text: str) -> list[float]:
        return [len(text), 1.0 + sum(map(ord, text)) % 7]

    def _encode(self, side, texts, task):
        self.calls.append((side, task, list(texts)))
        return Embeddings(dense=np.array([self.vector(t) for t in texts], dtype=np.float32))

    def encode_queries(self, texts, batch_size=32, heads=("dense",), show_progress=False, task=None):
        return self._encode("query", texts, task)

    def encode_documents(self, texts, batch_size=32, heads=("dense",), show_progress=False, task=None):
        return self._encode("document", texts, task)


def pair_logits(folder, pairs: list[tuple[str, str]], max_length: int) -> list[float]:
    """A cross-encoder folder called through transformers alone on each (query, passage) pair, no batching,
    no cache: the reference for the project's pair scores (teacher, judge, reranker rows)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        return [float(model(**tok(q, p, truncation=True, max_length=max_length, return_tensors="pt")).logits[0, 0])
                for q, p in pairs]
