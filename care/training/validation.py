"""Validation during training: a reranking dev task scored by the evaluation's own reranking runner
(care.evaluation.tasks.run_reranking, trec conventions), and early stopping on it.

The default dev task is cEpilepsyQA dev (490 questions x ~100 candidates, repeated rows collapsed by the
reader), never in training (the build stage keeps dev and test questions out); it is written on first use
from the shared data when `validation.build_from` is set.

CARE's stage I can also hold out a slice of its own texts (`model.stages.stage1.heldout_texts`,
care.training.care_recipe): `AlignmentLog` then logs, beside the dev metric and on its schedule, how well
the query tower reproduces the frozen document vectors of texts it never trained on (`alignment_metrics`):
val/align_cos, val/align_acc and val/align_cos_<kind>.  Early stopping keeps using `validation.metric`.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from care.data.io import write_jsonl
from care.data.records import QueryCandidates, Text
from care.data.sources import cmedqa_release
from care.data.sources.common import Report
from care.data.tasks import TaskData, load_task
from care.encoders.base import Encoder, PairScorer
from care.encoders.cache import EmbeddingCache
from care.evaluation.tasks import run_reranking
from care.families import Family, family_of
from care.paths import shared_data
from care.retrieval.rerank import RERANK, RerankerScorer
from care.retrieval.scorer import EncoderScorer


class EarlyStopping:
    """Stop after `patience` validations without an improvement of more than `min_delta`; patience None never
    stops (a fixed budget: validation still picks best/)."""

    def __init__(self, patience: int | None, min_delta: float = 0.0):
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
        return self.patience is not None and self.bad >= self.patience

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
    ranked by the summed scores of `validation.heads` (the hybrid of equal weights when several), or, for a
    family whose outputs are pair scores (a cross-encoder), by its pair scores."""

    def __init__(self, v: DictConfig, cache: EmbeddingCache | None = None, family: Family | None = None):
        """`cache`: embeddings of a side that does not change in training (CARE stage I's frozen documents);
        `family`: the trained model's (care.families; None: `kind: dense`), which says what it gives."""
        self.metric, self.heads, self.batch_size, self.cache = v.metric, list(v.heads), v.batch_size, cache
        self.family = family or family_of({})
        self.data = first_queries(load_task("reranking", ensure_dev_task(v)), v.max_queries)

    def __call__(self, encoder: Encoder | PairScorer) -> float:
        if self.family.cross_encoder:  # a reranker's live module: each candidate scored with its query
            scorer, method = RerankerScorer(encoder, batch_size=self.batch_size), RERANK
        else:
            # only the frozen document side may come from the cache: the query side is the model being trained
            scorer = EncoderScorer(encoder, self.cache, cached_sides=("document",), batch_size=self.batch_size,
                                   heads=self.heads, hybrid_weights=dict.fromkeys(self.heads, 1.0),
                                   show_progress=False)
            method = self.heads[0] if len(self.heads) == 1 else "hybrid"
        return run_reranking(self.data, scorer, [self.metric])[method][self.metric]


def alignment_metrics(query: np.ndarray, document: np.ndarray, kinds: list[str] | None = None) -> dict[str, float]:
    """Row i of `query`: the query tower's vector of text i; row i of `document`: the cached document vector
    of the same text (cut to the query width, so not of unit length).
    align_cos:        the mean cosine of the pairs (q_i, d_i);
    align_acc:        the share of texts whose query vector scores its own document vector above every other
                      of the slice (score q_i . d_j, as training and retrieval score; a tie counts as a miss);
    align_cos_<kind>: align_cos over the texts of each kind (`kinds`, one per row), when given."""
    q, d = np.asarray(query, np.float64), np.asarray(document, np.float64)
    cos = (q * d).sum(1) / (np.linalg.norm(q, axis=1) * np.linalg.norm(d, axis=1))
    scores = q @ d.T
    own = np.diag(scores).copy()
    np.fill_diagonal(scores, -np.inf)
    out = {"align_cos": float(cos.mean()), "align_acc": float((own > scores.max(1)).mean())}
    for kind in sorted(set(kinds or ())):
        out[f"align_cos_{kind}"] = float(cos[[k == kind for k in kinds]].mean())
    return out


class HeldOutAlignment:
    """alignment_metrics of stage I's held-out slice (`family.heldout`), the query vectors encoded as in
    training (care.training.care_family.CAREFamily.tokenize: prompt, per-kind limits) at `max_length`."""

    def __init__(self, family, max_length: int | None, batch_size: int = 64):
        self.family, self.max_length, self.batch_size = family, max_length, batch_size
        self.texts = list(family.heldout)
        if not self.texts:
            raise ValueError("stage I holds no text out (model.stages.stage1.heldout_texts = 0)")
        self.documents = family.document_module.table[[family.row[t] for t in self.texts]].double().cpu().numpy()
        self.kinds = [family.kind[t] for t in self.texts]

    @torch.no_grad()
    def __call__(self, query_module: torch.nn.Module) -> dict[str, float]:
        """Leaves the module in eval mode (the training step sets train)."""
        query_module.eval()
        device = next(query_module.parameters()).device
        vectors = []
        for s in range(0, len(self.texts), self.batch_size):
            chunk = self.texts[s:s + self.batch_size]
            batch = self.family.tokenize(chunk, ["query"] * len(chunk), self.max_length)
            vectors.append(query_module(**{k: v.to(device) for k, v in batch.items()})["dense"].double().cpu())
        return alignment_metrics(torch.cat(vectors).numpy(), self.documents, self.kinds)


class AlignmentLog:
    """A trainer step callback (care.training.trainer.Trainer's `callbacks`): on the validation schedule
    (every `validation.every_steps` steps and the last step) and once at the start (`at_start=True`), logs
    val/<alignment_metrics> and val/align_seconds of the held-out slice to the run log (metrics.jsonl), main
    process only.  The query vectors use the loop's trainer.query_max_length."""

    def __init__(self):
        self.probe: HeldOutAlignment | None = None

    def __call__(self, trainer, at_start: bool = False) -> None:
        v, step = trainer.cfg.validation, trainer.step
        due = at_start or step % v.every_steps == 0 or step == trainer.total_steps
        if not due or not trainer.accelerator.is_main_process:
            return
        if self.probe is None:
            self.probe = HeldOutAlignment(trainer.family, trainer.cfg.trainer.query_max_length, v.batch_size)
        start = time.perf_counter()
        metrics = self.probe(trainer.unwrapped()[0])
        trainer.log_rows.log(step, {**{f"val/{k}": x for k, x in metrics.items()},
                                    "val/align_seconds": time.perf_counter() - start})
