"""Which neighbours become a training example's hard negatives (the selection of stage "mine").

With `similarity: question` a candidate's similarity is that of its own question (the query of the example
whose positive it is) to the query; with `document` it is the query's to the candidate itself.  Negatives
are mined within a pool (build.rules' `pool`: answers, titles, questions), so an answer's negatives are
answers.  Never a negative: a positive of the example, any positive of an example asking the same question
(same id, same normalised text or same dedup cluster), a member of a positive's dedup cluster, a text equal
to a positive after normalisation, a text dedup removed.  Up to max_negatives are stored, most similar
first, with their scores (rounded to 6 decimals before the window test, so a stored score is exactly the
one tested).  Examples with fewer than min_negatives in the window are filled up by the fallback (nearest
candidates below lo, then random ones below hi), and the number filled is stored per example.
"""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from data_pipeline.dedup.normalize import Normalizer


@dataclass
class Mined:
    neg_ids: list[str]
    neg_scores: list[float]
    fallback: int       # how many of the trailing negatives came from the fallback
    in_window: int      # negatives found in the window (the first of neg_ids)


class PoolMiner:
    """Mines one pool.  `candidates[j]` is what neighbour j of the FAISS search offers: in question mode
    neighbour j is example j's query and offers its positives; in document mode it is one text."""

    def __init__(self, examples: list[dict], texts: dict[str, str], cluster_of: dict[str, int],
                 removed: set[str], similarity: str):
        norm = Normalizer()
        self.norm = {tid: norm(texts[tid]) for ex in examples for tid in [ex["query_id"], *ex["pos_ids"]]}
        self.removed = removed
        # Examples asking the same question: same query id, same normalised text, or same dedup cluster.
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, ex in enumerate(examples):
            q = ex["query_id"]
            for key in (("id", q), ("text", self.norm[q]), ("cluster", cluster_of.get(q))):
                if key[1] is not None:
                    groups[key].append(i)
        same_question = [set() for _ in examples]
        for members in groups.values():
            for i in members:
                same_question[i].update(members)
        members_of = defaultdict(set)
        for tid, c in cluster_of.items():
            members_of[c].add(tid)
        # Per example, what may never be its negative: every positive of an example asking the same
        # question (its own included), every member of a positive's cluster, and their normalised texts.
        self.excluded, self.excluded_text = [], []
        for i, ex in enumerate(examples):
            ids = {p for j in same_question[i] for p in examples[j]["pos_ids"]}
            for p in ex["pos_ids"]:
                ids |= members_of.get(cluster_of.get(p), set())
            self.excluded.append(ids)
            self.excluded_text.append({self.norm[p] for p in ids if p in self.norm})
        if similarity == "question":
            self.candidates = [ex["pos_ids"] for ex in examples]
        else:
            self.docs = list(dict.fromkeys(p for ex in examples for p in ex["pos_ids"] if p not in removed))
            self.candidates = [[d] for d in self.docs]

    def usable(self, i: int, tid: str) -> bool:
        return (tid not in self.excluded[i] and tid not in self.removed
                and self.norm.get(tid) not in self.excluded_text[i])

    def mine(self, i: int, scores: np.ndarray, neighbours: np.ndarray, all_scores, lo: float, hi: float,
             max_neg: int, min_neg: int, fallback: list[str], rng: random.Random) -> Mined:
        """Example i, given its neighbours (descending scores; -1 = none) and `all_scores(i)`, its
        similarity to every candidate (only computed when the random fallback is needed).  Scores are
        rounded to 6 decimals before the window test, so the stored score is the one tested."""
        window, below, seen = [], [], set()
        for s, j in zip(np.round(scores.astype(np.float64), 6).tolist(), neighbours.tolist()):
            if len(window) >= max_neg or (s < lo and len(window) + len(below) >= min_neg):
                break  # scores only fall from here on: nothing further would be stored
            if j < 0 or s >= hi:
                continue
            for tid in self.candidates[j]:
                if tid not in seen and self.usable(i, tid) and len(window) < max_neg:
                    seen.add(tid)
                    (window if s >= lo else below).append((tid, s))
        negs, in_window = window, len(window)
        filled = 0
        if len(negs) < min_neg and "below" in fallback:
            extra = below[:min_neg - len(negs)]
            negs, filled = negs + extra, filled + len(extra)
        if len(negs) < min_neg and "random" in fallback:
            sims = np.round(all_scores(i).astype(np.float64), 6)
            order = np.flatnonzero(sims < hi).tolist()
            rng.shuffle(order)
            for j in order:
                if len(negs) >= min_neg:
                    break
                for tid in self.candidates[j]:
                    if len(negs) < min_neg and tid not in seen and self.usable(i, tid):
                        seen.add(tid)
                        negs.append((tid, float(sims[j])))
                        filled += 1
        return Mined([t for t, _ in negs], [s for _, s in negs], filled, in_window)
