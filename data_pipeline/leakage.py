"""The build stage's leakage rule: no evaluation query in the training data, as a query or as a positive.

A training text leaks when its normalised text is an evaluation query's (exact) or a near duplicate of
one: the dedup stage's MinHash recipe (data_pipeline.dedup.minhash.similar_pairs: the same shingles, hash,
seed, bands x rows rule and exact Jaccard verification), joined evaluation queries x training texts.  An
evaluation (query, relevant document) pair must not be a training (query, positive) pair either; every
such pair holds an evaluation query, so removing leaking texts removes it, and the count after proves it.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from care.data.records import Example
from data_pipeline.dedup.minhash import similar_pairs
from data_pipeline.dedup.minhash_reference import SEED, shingles
from data_pipeline.dedup.normalize import Normalizer


@dataclass
class EvalSet:
    name: str
    queries: set[str] = field(default_factory=set)                 # text ids on the query side
    relevant: set[tuple[str, str]] = field(default_factory=set)    # (query id, relevant document id)


class LeakageDetector:
    """Finds evaluation queries among training texts: exact (normalised) or near-duplicate matches.
    A text's matches are computed once and remembered, so the check after cleaning costs little."""

    def __init__(self, eval_sets: list[EvalSet], texts: dict[str, str], opts: dict):
        self.normalizer = Normalizer(**opts["normalize"])
        self.texts, self.opts = texts, opts
        self.normalised: dict[str, str] = {}  # text id -> normalised text
        self.owner: dict[str, set[str]] = defaultdict(set)  # normalised eval query -> eval set names
        for es in eval_sets:
            for qid in es.queries:
                self.owner[self.norm(qid)].add(es.name)
        # {normalised query, normalised relevant document} -> eval set names
        self.relevant: dict[frozenset, set[str]] = defaultdict(set)
        for es in eval_sets:
            for q, d in es.relevant:
                self.relevant[frozenset((self.norm(q), self.norm(d)))].add(es.name)
        self.hits: dict[str, dict[str, tuple[str, str, float]]] = {}  # see `match`
        self.evals = list(self.owner)
        self.eval_grams = [shingles(t, opts["ngram"]) for t in self.evals]

    def norm(self, tid: str) -> str:
        if tid not in self.normalised:
            self.normalised[tid] = self.normalizer(self.texts[tid])
        return self.normalised[tid]

    def match(self, normalised: set[str]) -> dict[str, dict[str, tuple[str, str, float]]]:
        """Leaking training texts (normalised) -> {eval set: (how, matched eval text, similarity)}."""
        new = sorted(t for t in normalised if t not in self.hits)
        for t in new:
            self.hits[t] = {name: ("exact", t, 1.0) for name in self.owner.get(t, ())}
        o, threshold = self.opts, self.opts["threshold"]
        sizes = [len(s) for s in self.eval_grams]
        # Jaccard(A, B) <= min(|A|,|B|) / max(|A|,|B|): a text with more than max/threshold shingles (a long
        # answer) cannot reach the threshold against any evaluation query, so it never enters MinHash.
        lo, hi = min(sizes, default=0) * threshold, max(sizes, default=0) / threshold
        rest, rest_sets = [], []
        for t in new:
            if lo <= len(grams := shingles(t, o["ngram"])) <= hi:
                rest.append(t), rest_sets.append(grams)
        if not rest:
            return {t: self.hits[t] for t in normalised if self.hits[t]}
        near = similar_pairs(self.eval_grams, rest_sets, threshold, o["num_perm"], o["target_recall"],
                             seed=o.get("seed", SEED), desc="leakage: near duplicates")
        for i, j, sim in zip(near.rows.tolist(), near.cols.tolist(), near.sims.tolist()):
            found = self.hits[rest[j]]
            for name in self.owner[self.evals[i]]:
                if name not in found or found[name][2] < sim:  # an exact match (1.0) is never replaced
                    found[name] = ("near", self.evals[i], sim)
        return {t: self.hits[t] for t in normalised if self.hits[t]}

    def report(self, examples: list[Example]) -> tuple[dict, dict, set]:
        """Per eval set counts of leaks in `examples`, a few matches to show, and the leaking texts."""
        norm = {tid: self.norm(tid) for ex in examples for tid in [ex.query_id, *ex.pos_ids]}
        hits = self.match(set(norm.values()))
        counts: dict[str, dict] = defaultdict(lambda: defaultdict(int))
        shown: dict[str, list] = defaultdict(list)
        for side, ids in (("as_query", dict.fromkeys(ex.query_id for ex in examples)),
                          ("as_text", dict.fromkeys(p for ex in examples for p in ex.pos_ids))):
            for tid in ids:
                for name, (how, eval_text, sim) in hits.get(norm[tid], {}).items():
                    counts[name][side] += 1
                    counts[name][how] += 1
                    if len(shown[name]) < self.opts["examples_shown"]:
                        shown[name].append({"eval": eval_text, "train": norm[tid], "how": how,
                                            "jaccard": round(sim, 4)})
        for ex in examples:
            for p in ex.pos_ids:
                for name in self.relevant.get(frozenset((norm[ex.query_id], norm[p])), ()):
                    counts[name]["relevant_pairs"] += 1
        return counts, shown, set(hits)

    def clean(self, examples: list[Example]) -> tuple[list[Example], dict, dict]:
        """Examples with every leaking text removed, and what was removed.  Every relevant pair of an
        evaluation set holds one of its queries, so this removes those pairs too (`report` counts them
        again afterwards to prove it)."""
        counts, shown, leaked = self.report(examples)
        kept, removed = [], defaultdict(int)
        for ex in examples:
            if self.norm(ex.query_id) in leaked:
                removed["examples_query_leaked"] += 1
                removed["training_pairs"] += len(ex.pos_ids)
                continue
            pos = [p for p in ex.pos_ids if self.norm(p) not in leaked]
            removed["training_pairs"] += len(ex.pos_ids) - len(pos)
            if not pos:
                removed["examples_no_positive_left"] += 1
                continue
            kept.append(dataclasses.replace(ex, pos_ids=pos))
        return kept, {"counts": counts, "shown": shown}, dict(removed)


def apply_leakage_rule(examples: list[Example], eval_sets: list[EvalSet], texts: dict[str, str],
                       opts: dict) -> tuple[list[Example], dict]:
    detector = LeakageDetector(eval_sets, texts, opts)
    kept, before, removed = detector.clean(examples)
    after_counts, _, _ = detector.report(kept)  # counted again on what is kept
    zero = {"as_query": 0, "as_text": 0, "exact": 0, "near": 0, "relevant_pairs": 0}
    per_set = {}
    for es in eval_sets:
        per_set[es.name] = {"queries": len(es.queries), "relevant_pairs": len(es.relevant),
                            "before": {**zero, **before["counts"].get(es.name, {})},
                            "after": {**zero, **after_counts.get(es.name, {})},
                            "matches_shown": before["shown"].get(es.name, [])}
    leaks_after = sum(sum(v["after"].values()) for v in per_set.values())
    if leaks_after:
        raise RuntimeError(f"leakage rule failed: {leaks_after} leaks remain after cleaning: {per_set}")
    report = {"rule": "no evaluation query in training (as query or text; exact after normalisation or near "
                      "duplicate by MinHash + exact Jaccard); no evaluation (query, relevant document) pair "
                      "as a training pair", "options": opts, "eval_sets": per_set,
              "removed": {"training_pairs": 0, "examples_query_leaked": 0, "examples_no_positive_left": 0,
                          **removed}}
    return kept, report


def admitted_texts(eval_sets: list[EvalSet], texts: dict[str, str], ids: list[str], opts: dict) -> list[str]:
    """The ids among `ids` whose text the leakage rule admits to training on its own (an unlabelled text,
    e.g. a same-text pair of CARE's stage I): neither an evaluation query nor a near duplicate of one.
    Texts an evaluation set uses only as candidates or corpus entries stay, as for training pairs."""
    detector = LeakageDetector(eval_sets, texts, opts)
    leaked = detector.match({detector.norm(t) for t in ids})
    return [t for t in ids if detector.norm(t) not in leaked]
