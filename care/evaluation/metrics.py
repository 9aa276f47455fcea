"""Retrieval metrics with trec_eval's conventions, Acc@N, and STS correlations.

A run is `{qid: {docid: score}}`, qrels are `{qid: {docid: int relevance}}` (graded).  Every metric is
computed per query and then averaged.  The conventions below were checked against pytrec-eval-terrier
0.5.11 (trec_eval's own code) in tests/test_metrics.py:

- Ranking.  trec_eval keeps scores as C `float` (TEXT_RESULTS.sim), so scores are rounded to float32
  first; then it sorts by score descending and breaks ties by docid descending in byte order (`strcmp`,
  which for UTF-8 equals Python's code-point order).  The run's own rank column plays no part.
- Relevance.  A document counts as relevant for the binary metrics (MAP, MRR, success, recall) when its
  grade is >= `relevance_level` (trec's default 1).  nDCG ignores that threshold: its gain is the grade
  itself (linear), every grade > 0 contributes, and rank r is discounted by log2(r + 1).  Documents the
  run returns that the qrels do not judge are non-relevant with gain 0.
- Names.  `ndcg_cut_k`, `map_cut_k` (average precision over the top k divided by ALL R relevant docs),
  `success_k` (Hit@k), `recall_k` as trec_eval calls them; `mrr_k` is trec's `recip_rank` on the run cut
  at k; `map_min_r_k` divides by min(R, k) instead (sentence-transformers' MAP@k), kept under its own
  name because the two conventions give different numbers.
- Which queries.  trec_eval evaluates every query that has qrels, even one whose judgements are all
  non-relevant (it scores 0 everywhere), and ignores run queries absent from the qrels.  A qrels query
  missing from the run is skipped by plain trec_eval (and by pytrec_eval, BEIR and mteb, which average
  only what pytrec_eval returns) but counts as 0 under `trec_eval -c`.  Our default is `complete=True`
  (`-c`): a retriever that drops a query must not score higher for it.  `complete=False` gives the
  other convention.  Queries with no relevant document are kept, as trec_eval keeps them; a benchmark
  that does not want them must drop them (and count them) when it builds its qrels.

The metrics are written here rather than taken from pytrec_eval because it has neither the min(R, k)
MAP nor an MRR cut at k (and Acc@N is no trec measure); both run at the same speed (~3 s for 1,585
queries x 1,000 docs on 2 cores), and the tests hold every shared metric equal to pytrec_eval's.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import numpy as np

from care.progress import progress

Run = Mapping[str, Mapping[str, float]]
Qrels = Mapping[str, Mapping[str, int]]

FAMILIES = ("ndcg_cut", "map_cut", "map_min_r", "mrr", "success", "recall")
DEFAULT_METRICS = ("ndcg_cut_10", "map_cut_10", "mrr_10", "success_1", "success_10", "success_1000",
                   "recall_100")
_METRIC = re.compile(rf"^({'|'.join(FAMILIES)})_([1-9][0-9]*)$")
_BLOCK = 1024  # queries scored together: bounds the queries x depth arrays for 10K-query sets


def parse_metric(name: str) -> tuple[str, int]:
    """'ndcg_cut_10' -> ('ndcg_cut', 10)."""
    match = _METRIC.match(name)
    if not match:
        raise ValueError(f"unknown metric {name!r}: expected <family>_<k> with k >= 1 and family one of "
                         f"{', '.join(FAMILIES)} (e.g. ndcg_cut_10, map_min_r_10)")
    return match.group(1), int(match.group(2))


def trec_order(doc_scores: Mapping[str, float]) -> list[str]:
    """Docids in trec_eval's rank order: float32 score descending, ties by docid descending."""
    ids = np.array(list(doc_scores), dtype=str)
    with np.errstate(over="ignore"):  # beyond float32 range becomes inf, as in trec_eval's C cast
        scores = np.fromiter(doc_scores.values(), dtype=np.float64, count=len(doc_scores)).astype(np.float32)
    if np.isnan(scores).any():
        raise ValueError("a score is NaN: the ranking would be undefined")
    # lexsort sorts by the last key first, ascending; reversing gives score desc, then docid desc.
    return ids[np.lexsort((ids, scores))[::-1]].tolist()


def evaluate_per_query(run: Run, qrels: Qrels, metrics: Sequence[str] = DEFAULT_METRICS, *,
                       relevance_level: int = 1, complete: bool = True,
                       show_progress: bool = True) -> dict[str, dict[str, float]]:
    """`{qid: {metric: value}}` for every qrels query (complete=True) or those also in the run."""
    if relevance_level < 1:
        raise ValueError(f"relevance_level must be >= 1 (as in trec_eval), got {relevance_level}")
    parsed = [parse_metric(name) for name in metrics]
    if not parsed:
        raise ValueError("no metric requested")
    qids = [qid for qid in qrels if complete or qid in run]
    if not qids:
        raise ValueError("no query to evaluate: the run and the qrels share no query id")
    depth = max(k for _, k in parsed)
    out: dict[str, dict[str, float]] = {}
    with progress(total=len(qids), desc="metrics", unit="query", leave=False, enabled=show_progress) as bar:
        for start in range(0, len(qids), _BLOCK):
            block = qids[start:start + _BLOCK]
            values = _score_block(block, run, qrels, parsed, depth, relevance_level)
            for row, qid in enumerate(block):
                out[qid] = {name: float(values[name][row]) for name in metrics}
            bar.update(len(block))
    return out


def average(per_query: Mapping[str, Mapping[str, float]], metrics: Sequence[str]) -> dict[str, float]:
    """Plain mean over the queries `evaluate_per_query` returned (trec_eval's "all" line)."""
    return {name: float(np.mean([values[name] for values in per_query.values()])) for name in metrics}


def evaluate(run: Run, qrels: Qrels, metrics: Sequence[str] = DEFAULT_METRICS, *,
             relevance_level: int = 1, complete: bool = True, show_progress: bool = True) -> dict[str, float]:
    """Averaged metrics, `{metric: value}` on a 0-1 scale."""
    per_query = evaluate_per_query(run, qrels, metrics, relevance_level=relevance_level, complete=complete,
                                   show_progress=show_progress)
    return average(per_query, metrics)


def _score_block(qids: Sequence[str], run: Run, qrels: Qrels, parsed: Sequence[tuple[str, int]],
                 depth: int, relevance_level: int) -> dict[str, np.ndarray]:
    """All metrics for a block of queries at once, from queries x depth arrays of the top of each list."""
    gains = np.zeros((len(qids), depth))       # grade of the doc at each rank (0 if unjudged or < 0)
    ideal = np.zeros((len(qids), depth))       # grades > 0 of the query's judged docs, best first
    relevant = np.zeros((len(qids), depth), dtype=bool)
    num_rel = np.zeros(len(qids))
    for row, qid in enumerate(qids):
        judged = qrels[qid]
        grades = np.array([judged.get(doc, 0) for doc in trec_order(run.get(qid, {}))[:depth]], dtype=float)
        gains[row, :len(grades)] = np.maximum(grades, 0)
        relevant[row, :len(grades)] = grades >= relevance_level
        best = sorted((g for g in judged.values() if g > 0), reverse=True)[:depth]
        ideal[row, :len(best)] = best
        num_rel[row] = sum(g >= relevance_level for g in judged.values())

    ranks = np.arange(1, depth + 1)
    discount = 1.0 / np.log2(ranks + 1)
    dcg = np.cumsum(gains * discount, axis=1)
    idcg = np.cumsum(ideal * discount, axis=1)
    hits = np.cumsum(relevant, axis=1)
    precision_sum = np.cumsum(np.where(relevant, hits / ranks, 0.0), axis=1)
    first_hit = np.argmax(relevant, axis=1) + 1  # rank of the first relevant doc (if there is one)

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.divide(num, den, out=np.zeros(len(qids)), where=den > 0)

    values = {}
    for family, k in parsed:
        found = hits[:, k - 1]  # relevant docs in the top k
        if family == "ndcg_cut":
            value = ratio(dcg[:, k - 1], idcg[:, k - 1])
        elif family == "map_cut":
            value = ratio(precision_sum[:, k - 1], num_rel)
        elif family == "map_min_r":
            value = ratio(precision_sum[:, k - 1], np.minimum(num_rel, k))
        elif family == "mrr":
            value = np.where(found > 0, 1.0 / first_hit, 0.0)
        elif family == "success":
            value = (found > 0).astype(float)
        else:  # recall
            value = ratio(found.astype(float), num_rel)
        values[f"{family}_{k}"] = value
    return values


def run_from_topk(query_ids: Sequence[str], doc_ids: Sequence[str], indices: np.ndarray,
                  scores: np.ndarray) -> dict[str, dict[str, float]]:
    """FAISS `index.search` output (queries x k indices into `doc_ids`, and their scores) -> a run.

    FAISS pads with index -1 when it finds fewer than k documents; those slots are skipped."""
    indices, scores = np.asarray(indices), np.asarray(scores)
    if indices.ndim != 2 or indices.shape != scores.shape or len(indices) != len(query_ids):
        raise ValueError(f"expected indices and scores of shape ({len(query_ids)}, k), "
                         f"got {indices.shape} and {scores.shape}")
    if indices.size and indices.max() >= len(doc_ids):
        raise ValueError(f"index {indices.max()} is out of range for {len(doc_ids)} document ids")
    run = {}
    for qid, row, row_scores in zip(query_ids, indices, scores):
        keep = row >= 0
        run[qid] = {doc_ids[j]: s for j, s in zip(row[keep].tolist(), row_scores[keep].tolist())}
        if len(run[qid]) != keep.sum():
            raise ValueError(f"query {qid!r}: the same document appears twice in its top k")
    return run


def sample_acc_trials(relevant: Sequence[Collection[int]], n: int, corpus_size: int,
                      seed: int = 0) -> Iterator[tuple[int, int, np.ndarray]]:
    """Acc@N trials `(query, positive, negatives)`: one per (query, relevant doc) pair, each with N - 1
    distinct negatives drawn uniformly from the corpus minus that query's relevant docs."""
    if n < 2:
        raise ValueError(f"Acc@N needs N >= 2 (one positive and at least one negative), got {n}")
    rng = np.random.default_rng(seed)
    for query, docs in enumerate(relevant):
        positives = np.array(sorted(set(docs)), dtype=np.int64)
        if len(positives) and corpus_size - len(positives) < n - 1:
            raise ValueError(f"query {query}: only {corpus_size - len(positives)} non-relevant documents "
                             f"for {n - 1} negatives")
        for positive in positives.tolist():
            # A random ordered sample without replacement, relevant docs struck out: the first N - 1 left
            # are a uniform sample of the allowed docs, with no N x corpus mask or rejection loop.
            draw = rng.choice(corpus_size, size=n - 1 + len(positives), replace=False)
            yield query, positive, draw[~np.isin(draw, positives)][: n - 1]


def accuracy_at_n(scores: np.ndarray | Callable[[int, np.ndarray], np.ndarray],
                  relevant: Sequence[Collection[int]], n: int, *, corpus_size: int | None = None,
                  seed: int = 0, trials_out: list | None = None, show_progress: bool = True) -> float:
    """Acc@N: the fraction of (query, positive) trials in which the positive scores strictly higher than
    all N - 1 sampled negatives.  A tie with any negative is a failure (a model that scores everything
    alike must not get credit).  Queries with no relevant doc contribute no trial.

    `scores` is a queries x corpus matrix, or `fn(query_index, doc_indices) -> scores` so the full matrix
    never has to exist, e.g. `lambda q, docs: doc_emb[docs] @ query_emb[q]`; then pass `corpus_size`.
    `trials_out`, a list, receives each trial as `(query index, positive index, won)`: Acc@N's items (its
    value is their mean), what a paired bootstrap of two models resamples."""
    if callable(scores):
        if corpus_size is None:
            raise ValueError("pass corpus_size with a scoring function")
        score_fn = scores
    else:
        matrix = np.asarray(scores)
        if matrix.ndim != 2 or len(matrix) != len(relevant):
            raise ValueError(f"expected a {len(relevant)} x corpus score matrix, got shape {matrix.shape}")
        corpus_size = matrix.shape[1]

        def score_fn(query: int, docs: np.ndarray) -> np.ndarray:
            return matrix[query, docs]

    wins = trials = 0
    total = sum(len(set(r)) for r in relevant)
    for query, positive, negatives in progress(sample_acc_trials(relevant, n, corpus_size, seed), total=total,
                                               desc=f"Acc@{n}", unit="trial", leave=False, enabled=show_progress):
        candidate_scores = np.asarray(score_fn(query, np.concatenate(([positive], negatives))))
        won = bool(candidate_scores[0] > candidate_scores[1:].max())
        wins += won
        trials += 1
        if trials_out is not None:
            trials_out.append((query, positive, won))
    if not trials:
        raise ValueError("no query has a relevant document: Acc@N is undefined")
    return wins / trials


def sts_correlations(predicted: Sequence[float], gold: Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman correlation (scipy) between predicted similarities and gold scores, 0-1 scale.
    Constant input gives NaN (scipy warns), which stays visible in any average it enters."""
    from scipy import stats  # imported here: the CLI and the ranking metrics do not need scipy

    predicted, gold = np.asarray(predicted, dtype=float), np.asarray(gold, dtype=float)
    if predicted.shape != gold.shape or predicted.ndim != 1 or len(predicted) < 2:
        raise ValueError(f"need two equal-length 1-D score lists of >= 2 pairs, got {predicted.shape} "
                         f"and {gold.shape}")
    return {"pearson": float(stats.pearsonr(predicted, gold).statistic),
            "spearman": float(stats.spearmanr(predicted, gold).statistic)}
