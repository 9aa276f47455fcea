"""Validation during training: a reranking dev task scored by the evaluation's own reranking runner
(care.evaluation.tasks.run_reranking, trec conventions), and early stopping on it.

The default dev task is cEpilepsyQA dev (490 questions x ~100 candidates, repeated rows collapsed by the
reader), never in training (the build stage keeps dev and test questions out); it is written on first use
from the shared data when `validation.build_from` is set.
"""
from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

from care.data.io import write_jsonl
from care.data.records import QueryCandidates, Text
from care.data.sources import cmedqa_release
from care.data.sources.common import Report
from care.data.tasks import TaskData, load_task
from care.encoders.base import Encoder
from care.encoders.cache import EmbeddingCache
from care.evaluation.tasks import run_reranking
from care.paths import shared_data
from care.retrieval.scorer import EncoderScorer


class EarlyStopping:
    """Stop after `patience` validations without an improvement of more than `min_delta`."""

    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_step, self.bad = -math.inf, -1, 0

    def update(self, value: float, step: int) -> bool:
        """Record a validation; True when it is the best so far."""
        if value > self.best + self.min_delta:
            self.best, self.best_step, self.bad = value, step, 0
            return True
        self.bad += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.bad >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, d: dict) -> None:
        self.best, self.best_step, self.bad = d["best"], d["best_step"], d["bad"]


def ensure_dev_task(v: DictConfig) -> Path:
    """The dev reranking file, written from the shared data on first use when `build_from` names a split."""
    path = Path(v.task)
    if path.exists() or not v.get("build_from"):
        return path
    texts, lists = {}, []
    report = Report(source=v.build_from.source, root=shared_data())
    for rec in cmedqa_release.read({"path": v.build_from.path, "splits": [v.build_from.split]}, shared_data(), report):
        if isinstance(rec, Text):
            texts[rec.id] = rec.text
        elif isinstance(rec, QueryCandidates) and rec.split == v.build_from.split:
            lists.append(rec)
    def row(c: QueryCandidates) -> dict:
        # cEpilepsyQA repeats some answer texts under two ids with two labels: such a text is a positive.
        positive = list(dict.fromkeys(texts[d] for d, label in c.candidates if label == 1))
        negative = [t for t in dict.fromkeys(texts[d] for d, label in c.candidates if label == 0) if t not in positive]
        return {"query": texts[c.query_id], "positive": positive, "negative": negative}

    write_jsonl(path, (row(c) for c in lists))
    return path


def first_queries(data: TaskData, n: int | None) -> TaskData:
    """The task restricted to its first `n` queries (file order), so a validation stays cheap."""
    if n is None or n >= len(data.queries):
        return data
    qids = list(data.queries)[:n]
    qrels = {q: data.qrels[q] for q in qids}
    docs = {d: data.docs[d] for judged in qrels.values() for d in judged}
    return TaskData(data.type, data.path, {q: data.queries[q] for q in qids}, docs, qrels,
                    counts={**data.counts, "queries": len(qids), "docs": len(docs)})


class Validator:
    """`validator(encoder)` -> the dev metric of the model as it is now: each dev query's candidates
    ranked by the summed scores of `validation.heads` (the hybrid of equal weights when several)."""

    def __init__(self, v: DictConfig, cache: EmbeddingCache | None = None):
        """`cache`: embeddings of a side that does not change in training (CARE stage I's frozen documents)."""
        self.metric, self.heads, self.batch_size, self.cache = v.metric, list(v.heads), v.batch_size, cache
        self.data = first_queries(load_task("reranking", ensure_dev_task(v)), v.max_queries)

    def __call__(self, encoder: Encoder) -> float:
        # only the frozen document side may come from the cache: the query side is the model being trained
        scorer = EncoderScorer(encoder, self.cache, cached_sides=("document",), batch_size=self.batch_size,
                               heads=self.heads, hybrid_weights=dict.fromkeys(self.heads, 1.0), show_progress=False)
        method = self.heads[0] if len(self.heads) == 1 else "hybrid"
        return run_reranking(self.data, scorer, [self.metric])[method][self.metric]
