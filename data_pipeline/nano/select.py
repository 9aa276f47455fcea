"""Stage A of a Nano split: at most 200 queries and a 10,000-document corpus out of a SourceTask, exactly as
HAKARI selects them (docs/nano.md s.3-4), with HAKARI's counters for metadata/<split>.json.

HAKARI's recipe, the default:
- queries (s.3): walk the source order; skip a query with no positive qrel (score > 0), a repeated id, or a
  stripped text already taken; stop at `query_limit`;
- corpus (s.4): the kept positives (qrels order), then the selected queries' non-positive qrels taken
  round-robin over the *sorted* query ids, then fill from the first max(3 * doc_limit, doc_limit + |wanted|)
  source rows; stop at `doc_limit`; skip an id already in and an exact duplicate text (the first copy wins,
  even over a later positive);
- post-filter (s.4 step 5): keep qrels whose query and document survived, drop queries left with none, cap
  the positives per query at `qrels_cap`.

Two documented options depart from it, both off by default:
- `query_selection="random"`: source order inherits any bias of the source (e.g. rows sorted by topic or
  date), so the query order is first shuffled with random.Random(seed) and the same walk runs; the fill is
  then a seeded random sample of the corpus rows, kept in sample order, so that stopping at doc_limit still
  leaves a uniform sample rather than its earliest rows (shared docs/nano.md pitfall 2);
- `corpus_order="hashed"`: HAKARI writes the corpus as selected, positives first, so any tie broken by
  corpus position (BM25 ties, torch.topk, a stable sort) favours positives.  Hashed order sorts by
  sha256(f"{seed}\\0{doc_id}"): deterministic and independent of content and selection (pitfall 1).

Everything is one pass over the qrels and one over the corpus: O(corpus + qrels).
"""
from __future__ import annotations

import hashlib
import random
import warnings
from dataclasses import dataclass

from data_pipeline.nano.sources import SourceTask

QUERY_SELECTION = ("first", "random")
CORPUS_ORDER = ("as_selected", "hashed")


@dataclass
class Selection:
    queries: dict[str, str]  # selected, in selection order (the query table order)
    corpus: dict[str, str]  # in the written row order (see corpus_order)
    qrels: dict[str, list[str]]  # positive doc ids per query (query table order) after post-filter and cap,
    # each list in qrels order
    metadata: dict  # HAKARI's metadata/<split>.json fields


def _grouped(task: SourceTask) -> tuple[list[tuple[str, str]], dict[str, list[str]], dict[str, list[str]],
                                       dict]:
    """Split the qrels into positives (score > 0) and non-positives; a (qid, did) pair repeated within a
    group is dropped (docs/nano.md s.2).  Returns the positives in qrels order, both groups by query."""
    positives: list[tuple[str, str]] = []
    pos_by_query: dict[str, list[str]] = {}
    neg_by_query: dict[str, list[str]] = {}
    seen: tuple[set, set] = (set(), set())
    dup = {"positive": 0, "non_positive": 0}
    for qid, did, score in task.qrels:
        positive = score > 0
        group = seen[0] if positive else seen[1]
        if (qid, did) in group:
            dup["positive" if positive else "non_positive"] += 1
            continue
        group.add((qid, did))
        if positive:
            positives.append((qid, did))
            pos_by_query.setdefault(qid, []).append(did)
        else:
            neg_by_query.setdefault(qid, []).append(did)
    return positives, pos_by_query, neg_by_query, dup


def _select_queries(task: SourceTask, has_positive, limit: int, policy: str, seed: int, dedupe: bool
                    ) -> tuple[dict[str, str], dict]:
    order = list(task.queries)
    if policy == "random":
        random.Random(seed).shuffle(order)
    selected: dict[str, str] = {}
    texts: set[str] = set()
    counts = {"skipped_queries_without_positive_qrels": 0, "skipped_duplicate_query_ids": 0,
              "skipped_duplicate_query_texts": 0}
    for qid, text in order:
        if len(selected) >= limit:
            break
        if qid not in has_positive:
            counts["skipped_queries_without_positive_qrels"] += 1
        elif qid in selected:
            counts["skipped_duplicate_query_ids"] += 1
        elif dedupe and text.strip() in texts:
            counts["skipped_duplicate_query_texts"] += 1
        else:
            selected[qid] = text
            texts.add(text.strip())
    return selected, counts


def _round_robin(queries, neg_by_query: dict[str, list[str]]) -> list[str]:
    """Every sorted query's 1st non-positive, then every 2nd, ...; each query's duplicates dropped (the
    grouping already did), a doc listed by two queries kept at its first turn."""
    turns: list[list[str]] = []  # turns[i]: every query's (i+1)-th, in sorted query order: O(qrels) in all
    for q in sorted(queries):
        for i, did in enumerate(neg_by_query.get(q, [])):
            if i == len(turns):
                turns.append([])
            turns[i].append(did)
    return list(dict.fromkeys(did for turn in turns for did in turn))


def _fill_rows(task: SourceTask, limit: int, policy: str, seed: int) -> list[tuple[str, str]]:
    """HAKARI: the first `limit` source rows.  random: a seeded sample of `limit` rows, in sample order."""
    if policy == "random":
        rng = random.Random(f"{seed}\0fill")
        return [task.corpus[i] for i in rng.sample(range(len(task.corpus)), min(limit, len(task.corpus)))]
    return task.corpus[:limit]


def _hash_order(ids, seed: int) -> list[str]:
    return sorted(ids, key=lambda d: (hashlib.sha256(f"{seed}\0{d}".encode()).hexdigest(), d))


def select(task: SourceTask, query_limit: int = 200, doc_limit: int = 10_000, query_selection: str = "first",
           seed: int = 20260524, corpus_order: str = "as_selected", dedupe_query_texts: bool = True,
           dedupe_doc_texts: bool = True, qrels_cap: int = 500) -> Selection:
    """The Nano split of `task` (see the module docstring); raises ValueError when no query survives."""
    if query_selection not in QUERY_SELECTION:
        raise ValueError(f"query_selection must be one of {QUERY_SELECTION}, got {query_selection!r}")
    if corpus_order not in CORPUS_ORDER:
        raise ValueError(f"corpus_order must be one of {CORPUS_ORDER}, got {corpus_order!r}")
    if min(query_limit, doc_limit, qrels_cap) < 1:
        raise ValueError(f"query_limit, doc_limit and qrels_cap must be >= 1, got {query_limit}, "
                         f"{doc_limit}, {qrels_cap}")

    positives, pos_by_query, neg_by_query, duplicate_qrels = _grouped(task)
    queries, query_counts = _select_queries(task, pos_by_query, query_limit, query_selection, seed,
                                            dedupe_query_texts)
    if not queries:
        raise ValueError(f"task {task.name!r}: no query selected out of {len(task.queries)} ({query_counts})")
    selected = len(queries)
    corpus, corpus_meta = _select_corpus(task, queries, positives, neg_by_query, doc_limit, query_selection,
                                         seed, dedupe_doc_texts)
    qrels, qrels_meta = _post_filter(task, queries, corpus, pos_by_query, qrels_cap, corpus_meta)
    qrels_meta.update({"duplicate_positive_qrels_removed": duplicate_qrels["positive"],
                       "duplicate_non_positive_qrels_removed": duplicate_qrels["non_positive"]})
    if corpus_order == "hashed":
        corpus = {d: corpus[d] for d in _hash_order(corpus, seed)}
    corpus_meta.update({"corpus_below_doc_limit": len(corpus) < doc_limit, "corpus_order": corpus_order,
                        **({"corpus_order_key": f"sha256(f'{{seed}}\\0{{doc_id}}'), seed {seed}"}
                           if corpus_order == "hashed" else {})})
    metadata = {
        "split_name": task.name,
        "queries": len(queries),
        "corpus": len(corpus),
        "qrels": sum(map(len, qrels.values())),
        "source_positive_qrels": len(positives),
        "source_non_positive_qrels": sum(map(len, neg_by_query.values())),
        "query_limit": query_limit,
        "doc_limit": doc_limit,
        "dedupe_query_texts": dedupe_query_texts,
        "dedupe_doc_texts": dedupe_doc_texts,
        "qrels_score_policy": "score > 0 is positive",
        "query_selection": {"policy": query_selection,  # first: source order (HAKARI); random: seeded shuffle
                            **({"seed": seed} if query_selection == "random" else {}),
                            "source_queries": len(task.queries), "selected_before_corpus_filter": selected,
                            **query_counts},
        "corpus_selection": corpus_meta,
        "qrels_selection": qrels_meta,
        "source": dict(task.provenance),
    }
    _unmatched_qrels(task, metadata)
    return Selection(queries, corpus, qrels, metadata)


def _select_corpus(task: SourceTask, queries: dict[str, str], positives: list[tuple[str, str]],
                   neg_by_query: dict[str, list[str]], doc_limit: int, policy: str, seed: int,
                   dedupe: bool) -> tuple[dict[str, str], dict]:
    """docs/nano.md s.4 steps 1-4: the selected queries' positives, their hard negatives round-robin, then
    fill rows, until doc_limit; with HAKARI's corpus_selection counters (the order fields added by select)."""
    positive_ids = list(dict.fromkeys(d for q, d in positives if q in queries))
    hard_ids = _round_robin(queries, neg_by_query)
    wanted = set(positive_ids) | set(hard_ids)
    rows: dict[str, str] = {}  # steps 1-3: what is wanted, in one pass over the corpus
    for did, text in task.corpus:
        if did in wanted and did not in rows:
            rows[did] = text
    fill_limit = max(3 * doc_limit, doc_limit + len(wanted))
    fill = _fill_rows(task, fill_limit, policy, seed)

    corpus: dict[str, str] = {}
    texts: set[str] = set()
    duplicates: set[str] = set()  # ids left out for a text already in: each counted once, though a hard
    # negative can come round again as fill
    counts = {"missing_positive_docs": 0, "kept_hard_negative_docs": 0, "missing_hard_negative_docs": 0,
              "fill_docs": 0}

    def add(did: str, text: str) -> bool:
        if len(corpus) >= doc_limit or did in corpus:
            return False
        if dedupe and text in texts:
            duplicates.add(did)
            return False
        corpus[did] = text
        texts.add(text)
        return True

    for did in positive_ids:
        if did not in rows:
            counts["missing_positive_docs"] += 1
        else:
            add(did, rows[did])
    for did in hard_ids:
        if did not in rows:
            counts["missing_hard_negative_docs"] += 1
        elif add(did, rows[did]):
            counts["kept_hard_negative_docs"] += 1
    for did, text in fill:
        if len(corpus) >= doc_limit:
            break
        counts["fill_docs"] += add(did, text)
    return corpus, {
        "positive_doc_count": len(positive_ids),
        "source_hard_negative_doc_candidates": len(hard_ids),
        "kept_hard_negative_docs": counts["kept_hard_negative_docs"],
        "missing_positive_docs": counts["missing_positive_docs"],
        "missing_hard_negative_docs": counts["missing_hard_negative_docs"],
        "duplicate_doc_texts_removed": len(duplicates),
        "hard_negative_sampling_policy": "query_round_robin",
        "fill_policy": "source_order_first" if policy == "first" else "seeded_random_sample",
        "fill_candidate_limit": fill_limit,
        "fill_candidates": len(fill),
        "fill_docs": counts["fill_docs"],
        "source_corpus_rows": len(task.corpus),
    }


def _post_filter(task: SourceTask, queries: dict[str, str], corpus: dict[str, str],
                 pos_by_query: dict[str, list[str]], cap: int, corpus_meta: dict
                 ) -> tuple[dict[str, list[str]], dict]:
    """docs/nano.md s.4 step 5: keep the positives whose document survived, drop (from `queries`, in place)
    a query left with none, cap each query's positives; raises ValueError when no query is left."""
    qrels: dict[str, list[str]] = {}
    removed_queries = removed_docs = over_cap = 0
    for qid in list(queries):
        kept = [d for d in pos_by_query[qid] if d in corpus]
        removed_docs += len(pos_by_query[qid]) - len(kept)
        if not kept:
            removed_queries += 1
            del queries[qid]
            continue
        over_cap += max(0, len(kept) - cap)
        qrels[qid] = kept[:cap]
    if not queries:
        raise ValueError(f"task {task.name!r}: every selected query lost its positives to the corpus filter "
                         f"({removed_queries} removed; {corpus_meta})")
    return qrels, {"removed_queries_after_corpus_filter": removed_queries,
                   "removed_qrels_after_corpus_filter": removed_docs,
                   "qrels_per_query_cap": cap,
                   "removed_qrels_over_cap": over_cap}


class NanoSourceWarning(UserWarning):
    """qrels of a source task that name a query or document the task does not have."""


def _qrels_file(task: SourceTask) -> str:
    prov = task.provenance
    where = prov.get("qrels_file") or prov.get("qrels_config") or ""
    return "/".join(str(p) for p in (prov.get("path"), where) if p) or task.name


def _unmatched_qrels(task: SourceTask, metadata: dict) -> None:
    """Count, in metadata["qrels_selection"], the qrels whose query id is not among the task's queries or
    whose document id is not in its corpus (no Nano split can use them), and warn once naming the file."""
    query_ids = {q for q, _ in task.queries}
    doc_ids = {d for d, _ in task.corpus}
    unknown = {"positive_qrels_unknown_query": 0, "non_positive_qrels_unknown_query": 0,
               "positive_qrels_unknown_doc": 0, "non_positive_qrels_unknown_doc": 0}
    for qid, did, score in task.qrels:
        kind = "positive" if score > 0 else "non_positive"
        unknown[f"{kind}_qrels_unknown_query"] += qid not in query_ids
        unknown[f"{kind}_qrels_unknown_doc"] += did not in doc_ids
    metadata["qrels_selection"].update(unknown)
    queries = unknown["positive_qrels_unknown_query"] + unknown["non_positive_qrels_unknown_query"]
    docs = unknown["positive_qrels_unknown_doc"] + unknown["non_positive_qrels_unknown_doc"]
    if queries or docs:
        parts = [f"{n} qrels whose {what} id is not in the {where}" for n, what, where in
                 ((queries, "query", "queries"), (docs, "corpus", "corpus")) if n]
        warnings.warn(f"{_qrels_file(task)}: {' and '.join(parts)} (task {task.name}); they are left out "
                      f"(counts in metadata/{task.name}.json qrels_selection)", NanoSourceWarning, stacklevel=3)
