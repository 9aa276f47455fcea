"""Nano candidate lists: reciprocal rank fusion, the rank-101 safeguard, the audit, candidate quality.

HAKARI's `reranking_hybrid` config fuses a query's BM25 and dense top-500 lists with reciprocal rank
fusion, keeps the top 100 and, when none of those is a positive, appends one seeded-random positive at
rank 101 (docs/nano.md s.7-8).  Every rule here is HAKARI's to the tie-break, because a reranker's score
on the split depends on exactly which 100 or 101 documents it sees:

    fuse               s.7: RRF over the lists, Python-float sums, key (-score, best rank, id), top 100
    safeguard_positive s.8: the seeded choice among the query's positives, appended at rank 101
    hybrid_lists       both for every query, plus the split's `reranking_hybrid` metadata block (s.10)
    list_counts        the candidate-count block of the bm25 and dense configs (s.10)
    audit              s.9: every check on a split's hybrid rows; all failures are collected, then raised
    candidate_quality  s.11: macro nDCG@10 and Recall@100 of any stored list, plus the micro coverage

qrels arguments map a query id to its positive document ids (any iterable); ids are strings throughout.
Pure Python and numpy, so it runs where the lists were written, with no model loaded.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

from care.data.nano import HYBRID_TOP_K  # fused candidates kept before the safeguard (docs/nano.md s.7-8)

RRF_K = 100               # the constant in 1 / (k + rank) (s.7)
SAFEGUARD_SEED = 20260524  # HAKARI's seed for the safeguard choice (s.8)
CONSTRUCTION_POLICY = "RRF top-100 plus optional safeguard positive at rank 101"
SAFEGUARD_REASON = "missing_positive_in_rrf_top_100"
NDCG_K, RECALL_K = 10, 100  # the card's Candidate Quality columns (s.11)

_DISCOUNT = [1.0 / math.log2(i + 2) for i in range(NDCG_K)]
_IDEAL = [sum(_DISCOUNT[:n]) for n in range(NDCG_K + 1)]  # IDCG of n binary positives, n <= 10


def fuse(lists: Iterable[Sequence[str]], corpus: Collection[str], rrf_k: int = RRF_K,
         top_k: int = HYBRID_TOP_K) -> list[str]:
    """One query's RRF ranking of `lists` (BM25 first, then dense), cut at min(top_k, |corpus|).

    `corpus` is tested with `in` for every listed id, so pass a set or a mapping.  Scores are summed in
    Python floats in list order, as HAKARI does: mirrored ranks (a, b) and (b, a) then give bit-equal
    sums and the tie-break (best single-list rank, then id) decides (docs/nano.md s.7).  A document in
    one list only gets one term; there is no fallback rank for the other list.
    """
    score: dict[str, float] = {}
    best_rank: dict[str, int] = {}
    for ranking in lists:
        for i, doc in enumerate(ranking):
            if doc not in corpus:
                continue
            rank = i + 1
            score[doc] = score.get(doc, 0.0) + 1.0 / (rrf_k + rank)
            best_rank[doc] = min(best_rank.get(doc, rank), rank)
    ordered = sorted(score, key=lambda d: (-score[d], best_rank[d], d))
    return ordered[:min(top_k, len(corpus))]


def _misses(ranking: Iterable[str], positives: Collection[str]) -> bool:
    """True when no document of `ranking` is a positive."""
    return not any(doc in positives for doc in ranking)


def _safeguard_choice(positives: Sequence[str], seed: int, split: str, query_id: str) -> str:
    return random.Random(f"{seed}\0{split}\0{query_id}\0positive_safeguard").choice(positives)


def safeguard_positive(ranking: Sequence[str], positives: Iterable[str], corpus_size: int, split: str,
                       query_id: str, seed: int = SAFEGUARD_SEED,
                       top_k: int = HYBRID_TOP_K) -> tuple[list[str], dict | None]:
    """The fused `ranking`, plus one positive at rank min(top_k, corpus_size) + 1 when it holds none.

    `positives` must already be restricted to the corpus (hybrid_lists does it): HAKARI draws from
    `sorted(p for p in qrels[q] if p in corpus)`.  The draw is seeded by split and query id, so it is a
    reproducible *random* positive, not the best-ranked one (docs/nano.md s.8).  Returns the new list and
    the `additions` entry, or the list unchanged and None.
    """
    cut = min(top_k, corpus_size)
    if len(ranking) > cut:
        raise ValueError(f"{split}/{query_id}: the fused ranking has {len(ranking)} candidates, more than "
                         f"min(top_k, corpus size) = {cut}; pass fuse's output")
    pool = sorted(set(positives))
    if not pool or not _misses(ranking, set(pool)):
        return list(ranking), None
    chosen = _safeguard_choice(pool, seed, split, query_id)
    return [*ranking, chosen], {"query_id": query_id, "reason": SAFEGUARD_REASON, "corpus_id": chosen,
                                "rank": cut + 1}


def hybrid_lists(query_ids: Sequence[str], bm25: Mapping[str, Sequence[str]], dense: Mapping[str, Sequence[str]],
                 qrels: Mapping[str, Iterable[str]], corpus: Iterable[str], split: str,
                 seed: int = SAFEGUARD_SEED, rrf_k: int = RRF_K,
                 top_k: int = HYBRID_TOP_K) -> tuple[dict[str, list[str]], dict]:
    """Every query's `reranking_hybrid` row (in `query_ids` order) and the split's metadata block.

    The block has HAKARI's keys (docs/nano.md s.10); coverage counts the final rows, safeguard included,
    over the positives that are in the corpus.  `limited_by_corpus_size_count` counts rows shorter than
    top_k because the corpus has no more documents (s.8).
    """
    corpus_set = frozenset(corpus)
    _check_queries(query_ids, {"bm25": bm25, "dense": dense})
    rows: dict[str, list[str]] = {}
    additions: list[dict] = []
    with_relevance = covered_queries = relevant = covered_relevant = limited = 0
    for qid in query_ids:
        positives = {d for d in qrels.get(qid, ()) if d in corpus_set}
        ranking = fuse((bm25[qid], dense[qid]), corpus_set, rrf_k=rrf_k, top_k=top_k)
        ranking, added = safeguard_positive(ranking, positives, len(corpus_set), split, qid, seed=seed,
                                            top_k=top_k)
        if added is not None:
            additions.append(added)
        rows[qid] = ranking
        if positives:
            covered = len(positives.intersection(ranking))
            with_relevance += 1
            relevant += len(positives)
            covered_queries += covered > 0
            covered_relevant += covered
        limited += len(ranking) < top_k and len(ranking) == len(corpus_set)
    counts = [len(row) for row in rows.values()]
    block = {
        **list_counts(rows),
        "candidate_count_mean": sum(counts) / len(counts) if counts else 0.0,
        "query_with_relevance_count": with_relevance,
        "covered_query_count": covered_queries,
        "query_coverage": covered_queries / with_relevance if with_relevance else 0.0,
        "relevant_count": relevant,
        "covered_relevant_count": covered_relevant,
        "relevant_coverage": covered_relevant / relevant if relevant else 0.0,
        "construction_policy": CONSTRUCTION_POLICY,
        "rrf_top_k": top_k,
        "safeguard_rank": top_k + 1,
        "safeguard_positive_count": len(additions),
        "limited_by_corpus_size_count": limited,
        "additions": additions,
    }
    return rows, block


def _check_queries(query_ids: Sequence[str], sources: Mapping[str, Mapping[str, Sequence[str]]]) -> None:
    if len(set(query_ids)) != len(query_ids):
        raise ValueError("query_ids has duplicates: a split has one candidate row per query")
    for name, lists in sources.items():
        missing = [qid for qid in query_ids if qid not in lists]
        if missing:
            raise ValueError(f"{len(missing)} queries have no {name} list (first: {missing[:5]})")


def list_counts(lists: Mapping[str, Sequence[str]]) -> dict:
    """`candidate_count_min` / `_max` over a config's rows (0 and 0 when there is none)."""
    counts = [len(row) for row in lists.values()]
    return {"candidate_count_min": min(counts, default=0), "candidate_count_max": max(counts, default=0)}


class NanoAuditError(ValueError):
    """A split's hybrid rows broke the rules of docs/nano.md s.9; `failures` holds one line per check."""

    def __init__(self, split: str, failures: Sequence[str]):
        self.split, self.failures = split, list(failures)
        super().__init__(f"Nano audit of split {split!r}: {len(self.failures)} failed check(s)\n  "
                         + "\n  ".join(self.failures))


def audit(split: str, query_ids: Sequence[str], corpus_ids: Iterable[str], qrels: Mapping[str, Iterable[str]],
          hybrid: Mapping[str, Sequence[str]], top_k: int = HYBRID_TOP_K) -> None:
    """Raise NanoAuditError listing every failed check of docs/nano.md s.9 (each line names the query).

    Checked: the rows' query ids equal `query_ids`, in order; per row, no duplicate, every candidate in
    the corpus, top_k or top_k + 1 candidates (exactly |corpus| when the corpus is smaller), a
    candidate at rank top_k + 1 is a positive and comes only when the first top_k hold none, a row with
    no positive in its first top_k has that safeguard, a query with positives has one in its row; and
    the split's query coverage is 1.0.
    """
    corpus = frozenset(corpus_ids)
    failures: list[str] = []
    wanted = set(query_ids)
    failures += [f"{qid}: missing row (query has no hybrid row)" for qid in query_ids if qid not in hybrid]
    failures += [f"{qid}: extra row (not a query of the split)" for qid in hybrid if qid not in wanted]
    if not failures and list(hybrid) != list(query_ids):
        failures.append("row order: hybrid rows are not in query-table order")
    with_relevance = covered = 0
    for qid in query_ids:
        if qid not in hybrid:
            continue
        row = list(hybrid[qid])
        positives = {d for d in qrels.get(qid, ()) if d in corpus}
        failures += _audit_row(qid, row, positives, corpus, top_k)
        if positives:
            with_relevance += 1
            covered += not _misses(row, positives)
    coverage = covered / with_relevance if with_relevance else 0.0
    if coverage != 1.0:
        failures.append(f"query coverage: {coverage} ({covered} of {with_relevance} queries with a positive "
                        f"have one in their row), not 1.0")
    if failures:
        raise NanoAuditError(split, failures)


def _audit_row(qid: str, row: list[str], positives: set[str], corpus: frozenset[str], top_k: int) -> list[str]:
    out = []
    duplicates = sorted(d for d, n in Counter(row).items() if n > 1)
    if duplicates:
        out.append(f"{qid}: duplicate candidate {duplicates[:3]}")
    outside = [d for d in row if d not in corpus]
    if outside:
        out.append(f"{qid}: candidate not in corpus {outside[:3]}")
    allowed = (len(corpus),) if len(corpus) < top_k else (top_k, top_k + 1)
    if len(row) not in allowed:
        out.append(f"{qid}: row length {len(row)}, expected {' or '.join(map(str, allowed))}")
    head_has_positive = not _misses(row[:top_k], positives)
    if len(row) > top_k:
        if row[top_k] not in positives:
            out.append(f"{qid}: rank {top_k + 1} candidate {row[top_k]!r} is not a positive")
        if head_has_positive:
            out.append(f"{qid}: rank {top_k + 1} safeguard while a positive is already in the top {top_k}")
    elif positives and not head_has_positive:
        out.append(f"{qid}: missing safeguard (no positive in the top {top_k} and no rank {top_k + 1})")
    if positives and _misses(row, positives):
        out.append(f"{qid}: no positive in the row")
    return out


def candidate_quality(lists: Mapping[str, Sequence[str]], qrels: Mapping[str, Iterable[str]]) -> dict:
    """nDCG@10 and Recall@100 of stored lists read as rankings, the card's way (docs/nano.md s.11).

    Binary gains; macro means over the qrels queries with at least one positive, a query without a row
    scoring 0; a document repeated in a row counts once.  Recall@100 reads `ranking[:100]`, so a rank-101
    safeguard never counts.  `relevant_coverage_at_100` is the micro version (sum covered / sum relevant),
    named apart because the two differ on splits with several positives per query.
    """
    per_query: dict[str, dict[str, float]] = {}
    relevant = covered_total = 0
    for qid, docs in qrels.items():
        positives = set(docs)
        if not positives:
            continue
        ranking = _unique(lists.get(qid, ()))
        dcg = sum(_DISCOUNT[i] for i, doc in enumerate(ranking[:NDCG_K]) if doc in positives)
        covered = len(positives.intersection(ranking[:RECALL_K]))
        per_query[qid] = {"ndcg_at_10": dcg / _IDEAL[min(len(positives), NDCG_K)],
                          "recall_at_100": covered / len(positives)}
        relevant += len(positives)
        covered_total += covered
    n = len(per_query)
    return {
        "ndcg_at_10": sum(v["ndcg_at_10"] for v in per_query.values()) / n if n else 0.0,
        "recall_at_100": sum(v["recall_at_100"] for v in per_query.values()) / n if n else 0.0,
        "relevant_coverage_at_100": covered_total / relevant if relevant else 0.0,
        "queries": n,
        "per_query": per_query,
    }


def _unique(ranking: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ranking))
