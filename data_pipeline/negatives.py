"""Which neighbours become a training example's hard negatives (the selection of stage "mine").

With `similarity: question` a candidate's similarity is that of its own question (the query of the example
whose positive it is) to the query; with `document` it is the query's to the candidate itself.  Negatives
are mined within a pool (build.rules' `pool`: answers, titles, questions), so an answer's negatives are
answers.  What may never be a negative (an example's positives, their duplicates, texts dedup removed)
is data_pipeline/pool_candidates.py.  Up to max_negatives are stored, most similar first, with their
scores (rounded to 6 decimals before the window test, so a stored score is exactly the one tested).
Examples with fewer than min_negatives in the window are filled up by the fallback (nearest candidates
below lo, then random ones below hi), and the number filled is stored per example.

An optional per-example cap (stage "mine"'s positive-aware rules, data_pipeline/mining_window.py: a
margin below the example's positive, or a fixed max_score) lowers the window's top for that example: a
candidate is usable for example i only when its score is < hi and <= cap[i], in the window and in both
fallbacks.

The rule, read as a walk down one example's neighbours in descending score order: skip a neighbour scoring
>= hi (or above the example's cap); take each usable candidate it offers (not excluded, not yet taken)
until max_negatives lie in the window; stop at the first neighbour below lo once the window and the
candidates taken below lo together reach min_negatives.  `PoolMiner.mine_all` computes that walk for every
example at once on the top-K matrix (numpy), because a Python loop over every neighbour cost about as much
again as the FAISS search itself (bench/mining_bench.py, `mining_over_raw_search`).  Because the scores
fall along a row, the walk's outcome is a prefix of the row's usable candidates: the first min(in window,
max_negatives) in the window, then (only when the window holds fewer than min_negatives) the first ones
below lo.  Only the random fallback, rare, stays a per-example loop, since it consumes one shared
random.Random in example order.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data_pipeline.pool_candidates import PoolCandidates

# Positions scanned per example beyond max_negatives (or beyond the window plus min_negatives) on the
# first pass: room for the excluded candidates among them.  An example whose outcome is not settled within
# that band is scanned again to the end of its row, so this only trades speed, never the result.
_SLACK = 32
# Examples selected at once: bounds the temporaries (a few arrays of this many rows of the top-K).
_ROWS = 8192


@dataclass
class Mined:
    neg_ids: list[str]
    neg_scores: list[float]
    fallback: int       # how many of the trailing negatives came from the fallback
    in_window: int      # negatives found in the window (the first of neg_ids)


@dataclass
class _Items:
    """The usable candidates of some examples' scanned positions, in walk order (example, then position,
    then the neighbour's own order of candidates).  `row` numbers the examples of the scan (0..n-1)."""
    row: np.ndarray
    pos: np.ndarray
    slot: np.ndarray
    score: np.ndarray


class PoolMiner(PoolCandidates):
    """Mines one pool: the walk of the module docstring over the candidates and exclusions of
    PoolCandidates (data_pipeline/pool_candidates.py)."""

    # ---- one scan of a band of positions --------------------------------------------------------------
    def _scan(self, R: np.ndarray, N: np.ndarray, r0: int, rows: np.ndarray, start: np.ndarray,
              stop: np.ndarray) -> _Items:
        """The usable, first-seen candidates at positions [start, stop) of the given rows of R and N
        (examples r0 + rows; every score there < hi), in walk order."""
        k = R.shape[1]
        lens = stop - start
        total = int(lens.sum())
        local = np.repeat(np.arange(len(rows)), lens)
        pos = np.arange(total) - np.repeat(np.cumsum(lens) - lens - start, lens)
        flat = rows[local] * k + pos
        j = N.ravel()[flat]
        keep = j >= 0
        local, pos, flat, j = local[keep], pos[keep], flat[keep], j[keep]
        if self.one_slot_each:
            slot = j  # one candidate per neighbour (document mode, or single positives): slot j is j's
        else:
            rep = self.slot_count[j]
            local, pos, flat = np.repeat(local, rep), np.repeat(pos, rep), np.repeat(flat, rep)
            base = np.repeat(self.slot_ptr[j] - (np.cumsum(rep) - rep), rep)
            slot = base + np.arange(len(base))
        ok = ~self.excluded(r0 + rows[local], self.slot_nid[slot])
        shared = np.flatnonzero(ok & self.slot_shared[slot])
        if len(shared):  # an id offered again further down the row: only its first occurrence counts
            key = local[shared] * len(self.names) + self.slot_tid[slot[shared]]
            first = np.zeros(len(shared), bool)
            first[np.unique(key, return_index=True)[1]] = True
            ok[shared[~first]] = False
        return _Items(local[ok], pos[ok], slot[ok], R.ravel()[flat[ok]])

    # ---- the selection for all examples ---------------------------------------------------------------
    def mine_all(self, scores: np.ndarray, neighbours: np.ndarray, all_scores: Callable[[int], np.ndarray],
                 lo: float, hi: float, max_neg: int, min_neg: int, fallback: list[str],
                 rng: random.Random, cap: np.ndarray | None = None) -> list[Mined]:
        """Every example's negatives, given the FAISS top-K (`scores`, `neighbours`: row i is example i's,
        descending scores, -1 = none) and `all_scores(i)`, example i's similarity to every candidate (only
        computed when the random fallback is needed).  Scores are rounded to 6 decimals before the window
        test, so the stored score is the one tested.  `cap` (one float per example, None: none) lowers an
        example's top: a score above cap[i] is skipped like one >= hi, by the fallback too.  The random
        fallback draws from `rng` example by example in row order, so a run is reproducible from the seed.
        Rows go _ROWS at a time, so the temporaries stay a few times the size of that many rows of the
        top-K, whatever the pool's size."""
        S = np.asarray(scores)
        N = np.asarray(neighbours, np.int64)
        C = np.full(len(S), np.inf) if cap is None else np.asarray(cap, np.float64)
        if C.shape != (len(S),):
            raise ValueError(f"mine_all needs one cap per example: {C.shape} for {len(S)} examples")
        out: list[Mined] = []
        for r0 in range(0, len(S), _ROWS):
            out += self._mine_rows(r0, S[r0:r0 + _ROWS], N[r0:r0 + _ROWS], all_scores, lo, hi, max_neg,
                                   min_neg, fallback, rng, C[r0:r0 + _ROWS])
        return out

    def count_above(self, scores: np.ndarray, neighbours: np.ndarray, lo: float, hi: float,
                    caps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per cap (name -> one float per example) and example: how many of its usable top-K candidates in
        [lo, hi) score above the cap, i.e. what that cap alone removes from the window (stats.json).
        Usable as in mine_all: not excluded, an id counted once per example."""
        S, N = np.asarray(scores), np.asarray(neighbours, np.int64)
        out = {name: np.zeros(len(S), np.int64) for name in caps}
        for r0 in range(0, len(S), _ROWS):
            R = np.round(S[r0:r0 + _ROWS].astype(np.float64), 6)
            n = len(R)
            items = self._scan(R, N[r0:r0 + _ROWS], r0, np.arange(n), (R >= hi).sum(1), (R >= lo).sum(1))
            for name, cap in caps.items():
                above = items.score > np.asarray(cap, np.float64)[r0 + items.row]
                out[name][r0:r0 + n] = np.bincount(items.row[above], minlength=n)
        return out

    def _mine_rows(self, r0: int, S: np.ndarray, N: np.ndarray, all_scores, lo: float, hi: float,
                   max_neg: int, min_neg: int, fallback: list[str], rng: random.Random,
                   cap: np.ndarray) -> list[Mined]:
        """mine_all for examples r0, r0 + 1, ... (the rows of S and N, cap).  First a band of each row, from
        its first usable score (below hi, not above the cap) to where an example with few exclusions is
        settled (_SLACK); the rows it did not settle are scanned again to their end."""
        n, k = S.shape
        if k > 1 and (S[:, 1:] > S[:, :-1]).any():
            raise ValueError("mine_all needs each row's scores in descending order (as a FAISS k-NN search "
                             "returns them)")
        R = np.round(S.astype(np.float64), 6)
        # Positions [0, a) score >= hi or above the row's cap: skipped (both a prefix, as scores descend).
        a = np.maximum((R >= hi).sum(1), (R > cap[:, None]).sum(1))
        b = np.maximum((R >= lo).sum(1), a)  # positions [a, b): the window (empty when the cap is below lo)
        stop = np.minimum(k, np.minimum(a + max(max_neg, 0) + _SLACK, b + max(min_neg, 0) + _SLACK))
        first = self._pick(self._scan(R, N, r0, np.arange(n), a, stop), n, lo, max_neg, min_neg, fallback)
        # Settled within the band: the window is full, or it was scanned whole and either enough below lo
        # followed it or the row ended.
        n_w, n_b = first["n_w"], first["n_b"]
        settled = (n_w >= max_neg) | ((stop >= b) & ((n_w + n_b >= min_neg) | (stop == k)))
        again = np.flatnonzero(~settled)
        second = (self._pick(self._scan(R, N, r0, again, a[again], np.full(len(again), k)), len(again), lo,
                             max_neg, min_neg, fallback) if len(again) else None)
        out = self._assemble(first)
        if second is not None:
            for r, m in zip(again.tolist(), self._assemble(second)):
                out[r] = m
        if "random" in fallback:
            where = np.full(n, -1)
            where[again] = np.arange(len(again))
            for r in [r for r, m in enumerate(out) if len(m.neg_ids) < min_neg]:
                # In row order: the shared rng makes the same draws as a walk example by example.
                p, at = (first, r) if where[r] < 0 else (second, int(where[r]))
                self._random_fill(r0 + r, out[r], p, at, all_scores, hi, float(cap[r]), max_neg, min_neg,
                                  rng)
        return out

    def _assemble(self, p: dict) -> list[Mined]:
        """One Mined per row of a _pick, its lists sliced from the flat selection."""
        ids = self.name_array[self.slot_tid[p["sel_slot"]]].tolist()
        scores = p["sel_score"].tolist()
        ends = np.cumsum(p["count"])
        return [Mined(ids[a:b], scores[a:b], f, w) for a, b, f, w in
                zip((ends - p["count"]).tolist(), ends.tolist(), (p["count"] - p["in_window"]).tolist(),
                    p["in_window"].tolist())]

    def _pick(self, items: _Items, n: int, lo: float, max_neg: int, min_neg: int,
              fallback: list[str]) -> dict:
        """The walk's outcome per row from its usable candidates: the first min(in window, max_negatives)
        window ones, then, for a row short of min_negatives and with "below" in the fallback, the first
        ones below lo (the walk never reaches below lo once the window is full)."""
        w = items.score >= lo
        n_all = np.bincount(items.row, minlength=n)
        n_w = np.bincount(items.row[w], minlength=n)
        in_window = np.minimum(n_w, max(max_neg, 0))
        need = np.where(n_w < max_neg, np.maximum(min_neg - in_window, 0), 0)
        extra = np.minimum(need, n_all - n_w) if "below" in fallback else np.zeros(n, np.int64)
        rank = np.arange(len(w)) - np.repeat(np.cumsum(n_all) - n_all, n_all)
        r_w, r_x = n_w[items.row], extra[items.row]
        sel = (rank < in_window[items.row]) | ((rank >= r_w) & (rank < r_w + r_x))
        return {"items": items, "n_w": n_w, "n_b": n_all - n_w, "in_window": in_window,
                "count": in_window + extra, "start": np.cumsum(n_all) - n_all,
                "sel_slot": items.slot[sel], "sel_score": items.score[sel]}

    @functools.cached_property
    def _slot_lists(self) -> tuple[list, list, list]:
        """slot_ptr, slot_tid and slot_nid as plain lists: the random fill reads them one element at a time."""
        return self.slot_ptr.tolist(), self.slot_tid.tolist(), self.slot_nid.tolist()

    def _random_fill(self, i: int, mined: Mined, p: dict, r: int, all_scores, hi: float, cap: float,
                     max_neg: int, min_neg: int, rng: random.Random) -> None:
        """Fill example i up to min_negatives with random candidates below hi and not above its cap, never
        one the walk took (window or below lo, stored or not) nor an excluded one; the draws are one
        rng.shuffle of the candidates' indices, as in the walk this replaces."""
        items, start = p["items"], int(p["start"][r])
        names, slots = self.names, items.slot[start:start + int(p["n_w"][r] + p["n_b"][r])]
        tids = self.slot_tid[slots].tolist()
        n_w = int(p["n_w"][r])
        seen = set(tids[:int(p["in_window"][r])])
        if n_w < max_neg:  # the walk went on below lo, one neighbour at a time, while short of min_negatives
            below_pos = items.pos[start + n_w:start + len(tids)].tolist()
            taken, current = len(seen), None
            for t, q in zip(tids[n_w:], below_pos):
                if q != current:
                    if taken >= min_neg:
                        break
                    current = q
                seen.add(t)
                taken += 1
        excluded = set(self.excl_nid[self.excl_ptr[i]:self.excl_ptr[i + 1]].tolist()) | {self.n_texts}
        sims = np.round(all_scores(i).astype(np.float64), 6)
        order = np.flatnonzero((sims < hi) & (sims <= cap)).tolist()
        rng.shuffle(order)
        ptr, slot_tid, slot_nid = self._slot_lists
        for j in order:
            if len(mined.neg_ids) >= min_neg:
                break
            for slot in range(ptr[j], ptr[j + 1]):
                tid = slot_tid[slot]
                if len(mined.neg_ids) < min_neg and tid not in seen and slot_nid[slot] not in excluded:
                    seen.add(tid)
                    mined.neg_ids.append(names[tid])
                    mined.neg_scores.append(float(sims[j]))
                    mined.fallback += 1
