"""Task runners: retrieval, reranking and STS (the task data: care.data.tasks).

A runner talks to a *scorer* (care.retrieval: `EncoderScorer` for any Encoder, `BM25Scorer` for the
lexical baseline): `scorer.prepare(queries, docs)` returns an object with `search(depth) -> {method:
(indices, scores)}` and `score(method, query_index, doc_indices) -> scores`; its `show_progress`, where it
has one, says whether the runner shows bars (care.progress).  Every runner returns {method: {metric: value}}
on a 0-1 scale and, given `items`, each method's per-query values.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import partial

import numpy as np

from care.data.tasks import TaskData
from care.evaluation.metrics import (
    accuracy_at_n,
    average,
    evaluate_per_query,
    run_from_topk,
    sts_correlations,
)
from care.progress import progress

# ---- runners -------------------------------------------------------------------------------------------

def _finite(scores: np.ndarray, data: TaskData, item: str) -> np.ndarray:
    if not np.isfinite(scores).all():
        raise FloatingPointError(f"{data.path}: the model gave a NaN/inf score for {item}")
    return scores


def shows_progress(scorer) -> bool:
    """Whether the runner shows its bars: the scorer's `show_progress` (EncoderScorer, RerankerScorer: off in
    validation and the mteb adapter); a scorer without one (BM25Scorer) shows them."""
    return getattr(scorer, "show_progress", True)


def _trec(run, data: TaskData, metrics: Sequence[str], method: str, items: dict | None,
          show: bool) -> dict[str, float]:
    """Averaged trec metrics; with `items`, each query's values too (what significance.py resamples)."""
    per_query = evaluate_per_query(run, data.qrels, metrics, show_progress=show)
    if items is not None:
        items[method] = {"per_query": per_query}
    return average(per_query, metrics)


def run_retrieval(data: TaskData, scorer, metrics: Sequence[str], depth: int = 1024, seed: int = 0,
                  items: dict | None = None) -> dict[str, dict[str, float]]:
    """Every query against the whole corpus; trec metrics on the top `depth`, Acc@N (`acc_N`) by sampling
    N - 1 random negatives per (query, positive) pair (care.evaluation.metrics.accuracy_at_n).
    `items`, a dict, receives each method's per-query values; Acc@N is a rate over (query, positive) trials,
    so its items are the trials, under `<query id>#<positive id>` with only `acc_N` (0 or 1): their mean
    is the cell, and a paired bootstrap resamples them (the sampled negatives depend on `seed` alone, so two
    models face the same trials)."""
    qids, dids = list(data.queries), list(data.docs)
    prepared = scorer.prepare([data.queries[q] for q in qids], [data.docs[d] for d in dids], task=data.type)
    trec = [m for m in metrics if not m.startswith("acc_")]
    position = {d: i for i, d in enumerate(dids)}
    relevant = [[position[d] for d, g in data.qrels[q].items() if g >= 1] for q in qids]
    results = {}
    for method, (idx, scores) in prepared.search(depth).items():
        for row, qid in enumerate(qids):
            keep = idx[row] >= 0
            _finite(scores[row][keep], data, f"query {data.queries[qid]!r} ({method})")
        results[method] = (_trec(run_from_topk(qids, dids, idx, scores), data, trec, method, items,
                                 shows_progress(scorer)) if trec else {})
        for m in metrics:
            if m.startswith("acc_"):
                trials: list = []
                results[method][m] = accuracy_at_n(partial(prepared.score, method), relevant, int(m[4:]),
                                                   corpus_size=len(dids), seed=seed, trials_out=trials,
                                                   show_progress=shows_progress(scorer))
                if items is not None:
                    per_item = items.setdefault(method, {"per_query": {}})["per_query"]
                    for q, positive, won in trials:
                        per_item.setdefault(f"{qids[q]}#{dids[positive]}", {})[m] = float(won)
    return results


def run_reranking(data: TaskData, scorer, metrics: Sequence[str], items: dict | None = None) -> dict[str, dict[str, float]]:
    """Score each query's own candidates; trec metrics over that list (MAP@10 divides by all positives).
    `items`, a dict, receives each method's per-query values."""
    qids, dids = list(data.queries), list(data.docs)
    position = {d: i for i, d in enumerate(dids)}
    prepared = scorer.prepare([data.queries[q] for q in qids], [data.docs[d] for d in dids], task=data.type)
    results = {}
    for method in scorer.methods:
        run = {}
        for qi, qid in enumerate(_lists(qids, data, method, shows_progress(scorer))):
            cands = list(data.qrels[qid])
            s = _finite(prepared.score(method, qi, [position[d] for d in cands]), data,
                        f"a candidate of query {data.queries[qid]!r} ({method})")
            run[qid] = dict(zip(cands, s.tolist()))
        results[method] = _trec(run, data, metrics, method, items, shows_progress(scorer))
    return results


def run_sts(data: TaskData, scorer, metrics: Sequence[str] = ("pearson", "spearman"),
            items: dict | None = None) -> dict[str, dict[str, float]]:
    """Similarity of each pair vs the gold score, by cosine; a pair's score is the mean of both directions
    (ColBERT and BM25 are not symmetric).  Both sides are embedded as queries: an STS pair is two texts a
    user types, which an asymmetric model embeds online with its query tower, so that is the table's
    number.  A scorer with two different sides (`asymmetric`) is also scored query tower vs document tower,
    as methods named `<method>/query+document`.  `items`, a dict, receives each method's predicted
    similarities and the gold scores."""
    texts = list(dict.fromkeys(t for pair in data.pairs for t in pair))
    position = {t: i for i, t in enumerate(texts)}
    results = {}
    layouts = [("query", "")] + ([("document", "/query+document")] if getattr(scorer, "asymmetric", False) else [])
    for doc_side, suffix in layouts:
        prepared = scorer.prepare(texts, texts, doc_side=doc_side, cosine=True, task=data.type)
        for method in scorer.methods:
            predicted = np.array([(prepared.score(method, position[a], [position[b]])[0]
                                   + prepared.score(method, position[b], [position[a]])[0]) / 2
                                  for a, b in data.pairs])
            bad = np.flatnonzero(~np.isfinite(predicted))
            if len(bad):
                a, b = data.pairs[bad[0]]
                _finite(predicted, data, f"pair #{bad[0] + 1} ({a!r}, {b!r})")
            corr = sts_correlations(predicted, data.gold)
            results[method + suffix] = {m: corr[m] for m in metrics}
            if items is not None:
                items[method + suffix] = {"predicted": predicted.tolist(), "gold": list(data.gold)}
    return results


#: Candidates are scored in an order fixed by this seed, never the stored one (docs/nano.md s.11: HAKARI
#: hash-shuffles them the same way), so neither the list order nor the telling rank 101 reaches a model.
CANDIDATE_ORDER_SEED = "care-nano-candidates-v1"


def shuffled(qid: str, docs: Sequence[str], seed: str = CANDIDATE_ORDER_SEED) -> list[str]:
    return sorted(docs, key=lambda d: hashlib.sha256(f"{seed}\0{qid}\0{d}".encode()).hexdigest())


def run_candidates(data: TaskData, scorer, metrics: Sequence[str], items: dict | None = None,
                   safeguard: bool = True) -> dict[str, dict[str, float]]:
    """Rerank each query's stored candidate list (a Nano split's `reranking_hybrid`): every candidate is
    scored after a deterministic shuffle, ties keep the shuffled order, and the metrics count every positive
    of the qrels (one the list misses counts as missed).  `safeguard=False` first drops the rank-101
    safeguard positive (HAKARI's `without_safeguard`).  Scores use the whole split corpus, as a retrieval
    run does (BM25's statistics, the cached embeddings)."""
    qids, dids = list(data.queries), list(data.docs)
    position = {d: i for i, d in enumerate(dids)}
    prepared = scorer.prepare([data.queries[q] for q in qids], [data.docs[d] for d in dids], task="retrieval")
    results = {}
    for method in scorer.methods:
        run = {}
        for qi, qid in enumerate(_lists(qids, data, method, shows_progress(scorer))):
            cands = [d for d in data.candidates[qid] if safeguard or d != data.safeguards.get(qid)]
            cands = shuffled(qid, cands)
            s = _finite(prepared.score(method, qi, [position[d] for d in cands]).astype(np.float32), data,
                        f"a candidate of query {data.queries[qid]!r} ({method})")
            order = np.lexsort((np.arange(len(cands)), -s))  # score descending, then the shuffled order
            run[qid] = {cands[i]: float(len(cands) - rank) for rank, i in enumerate(order)}
        results[method] = _trec(run, data, metrics, method, items, shows_progress(scorer))
    return results


def _lists(qids: list[str], data: TaskData, method: str, show: bool):
    """The queries of a candidate-list run, with a progress bar: a cross-encoder scores each list for seconds
    (care.retrieval.rerank), where an encoder's dot products take none and the bar is gone at once."""
    return progress(qids, desc=f"score {data.type} lists ({method})", unit="query", leave=False, enabled=show)


RUNNERS = {"retrieval": run_retrieval, "reranking": run_reranking, "sts": run_sts, "candidates": run_candidates}
