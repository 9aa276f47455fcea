"""One pool's candidates and what may never be each example's negative, as integers, for the selection
of hard negatives (data_pipeline/negatives.py, whose PoolMiner builds on PoolCandidates).

Never a negative of an example: one of its positives, any positive of an example asking the same question
(same id, same normalised text or same dedup cluster), a member of a positive's dedup cluster, a text equal
to a positive after normalisation, a text dedup removed.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from data_pipeline.dedup.normalize import Normalizer

# The exclusion test reads a boolean (example x normalised text) table, built for this many cells at a
# time (16 MiB), so a large pool never needs the whole quadratic table.
_TABLE_CELLS = 1 << 24


class PoolCandidates:
    """One pool's candidates and exclusions.  `candidates[j]` is what neighbour j of the FAISS search offers:
    in question mode neighbour j is example j's query and offers its positives; in document mode it is one
    text (`docs[j]`).

    The exclusions become integers once, here: every candidate occurrence is a "slot" (slot_ptr[j] to
    slot_ptr[j + 1] are neighbour j's), every distinct candidate id a number (`names`), every normalised
    candidate text a number, and example i's excluded texts the sorted numbers
    excl_nid[excl_ptr[i]:excl_ptr[i + 1]].  A candidate is usable for example i unless its normalised text
    is excluded for i or dedup removed it: an excluded id is a candidate's own text, so testing the text
    covers the id too."""

    def __init__(self, examples: list[dict], texts: dict[str, str], cluster_of: dict[str, int],
                 removed: set[str], similarity: str):
        norm = Normalizer()
        normed = {tid: norm(texts[tid]) for ex in examples for tid in [ex["query_id"], *ex["pos_ids"]]}
        # Examples asking the same question: same query id, same normalised text, or same dedup cluster.
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, ex in enumerate(examples):
            q = ex["query_id"]
            for key in (("id", q), ("text", normed[q]), ("cluster", cluster_of.get(q))):
                if key[1] is not None:
                    groups[key].append(i)
        same_question = [set() for _ in examples]
        for members in groups.values():
            for i in members:
                same_question[i].update(members)
        members_of = defaultdict(set)
        for tid, c in cluster_of.items():
            members_of[c].add(tid)
        if similarity == "question":
            self.candidates = [ex["pos_ids"] for ex in examples]
        else:
            self.docs = list(dict.fromkeys(p for ex in examples for p in ex["pos_ids"] if p not in removed))
            self.candidates = [[d] for d in self.docs]

        flat = [t for c in self.candidates for t in c]
        self.names = list(dict.fromkeys(flat))
        self.name_array = np.array(self.names, dtype=object)
        number = {t: n for n, t in enumerate(self.names)}
        text_no: dict[str, int] = {}
        tid_nid = np.array([text_no.setdefault(normed[t], len(text_no)) for t in self.names], np.int64)
        self.n_texts = len(text_no)  # a removed candidate gets text number n_texts: excluded for everyone
        slot_tid = np.array([number[t] for t in flat], np.int64)
        tid_removed = np.array([t in removed for t in self.names], bool)
        self.slot_tid = slot_tid
        self.slot_nid = np.where(tid_removed[slot_tid], self.n_texts, tid_nid[slot_tid]) if len(flat) else slot_tid
        self.slot_count = np.array([len(c) for c in self.candidates], np.int64)
        self.slot_ptr = np.concatenate([[0], np.cumsum(self.slot_count)]).astype(np.int64)
        self.one_slot_each = bool(len(flat)) and bool((self.slot_count == 1).all())
        # An id offered by two slots can come twice along one row: only those need the dedup pass.
        self.slot_shared = (np.bincount(slot_tid, minlength=len(self.names))[slot_tid] > 1
                            if len(flat) else np.zeros(0, bool))
        # Per example, what may never be its negative: every positive of an example asking the same
        # question (its own included), every member of a positive's cluster, and their normalised texts.
        excl, lens = [], []
        for i, ex in enumerate(examples):
            ids = {p for j in same_question[i] for p in examples[j]["pos_ids"]}
            for p in ex["pos_ids"]:
                ids |= members_of.get(cluster_of.get(p), set())
            nids = sorted({text_no[t] for t in {normed[p] for p in ids if p in normed} if t in text_no})
            excl.extend(nids)
            lens.append(len(nids))
        self.excl_nid = np.array(excl, np.int64)
        self.excl_ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

    # ---- the exclusion test ---------------------------------------------------------------------------
    def excluded(self, rows: np.ndarray, nid: np.ndarray) -> np.ndarray:
        """Whether text nid[t] may not be a negative of example rows[t] (rows ascending): a lookup in a
        boolean table of (example, text) marked from the exclusion lists, built a block of examples at a
        time and cleared again after each block."""
        out = np.zeros(len(rows), bool)
        if not len(rows):
            return out
        width = self.n_texts + 1  # the last column: dedup-removed, excluded for every example
        block = max(1, _TABLE_CELLS // width)
        table = np.zeros((min(block, int(rows[-1]) - int(rows[0]) + 1), width), bool)
        table[:, -1] = True
        first = int(rows[0])
        while first <= rows[-1]:
            last = first + len(table)
            a, b = np.searchsorted(rows, [first, last])
            if a < b:
                lens = np.diff(self.excl_ptr[first:last + 1])
                local = np.repeat(np.arange(len(lens)), lens)
                marked = self.excl_nid[self.excl_ptr[first]:self.excl_ptr[first + len(lens)]]
                table[local, marked] = True
                out[a:b] = table.ravel()[(rows[a:b] - first) * width + nid[a:b]]
                table[local, marked] = False
            first = int(rows[b]) if b < len(rows) else last
        return out
