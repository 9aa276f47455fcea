"""Shared by the mining tests: the top-K, a CSV reader, the real config composed once, a JSON Lines reader,
and the selection of hard negatives (data_pipeline/negatives.py) restated from its documented rules, which
the vectorised PoolMiner must reproduce exactly."""

from __future__ import annotations

import csv
import functools
import json
import math
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from care.config import load_config
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.negatives import Mined

TOP_K = 30


def read_csv(path: Path, header: bool = True, **kw) -> list:
    """Rows of a CSV/TSV file: dicts by the header, or lists without one."""
    with open(path, encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh, **kw) if header else csv.reader(fh, **kw))


@functools.cache
def base_config(build_dir: Path, model_dir: Path):
    return load_config("data_pipeline", [
        "model=tiny_bert", f"model.path={model_dir}", "model.max_length=64", f"mine.input_dir={build_dir}",
        f"mine.dedup_clusters={build_dir}/clusters.jsonl", f"mine.top_k={TOP_K}",
        f"mine.cache={build_dir}/embedding-cache"])


def compose(build_dir: Path, out: Path, model_dir: Path, *extra: str):
    """The real config (composed once: Hydra takes ~1 s a call here) with `key=value` overrides."""
    return OmegaConf.merge(base_config(build_dir, model_dir), OmegaConf.from_dotlist([f"data_dir={out}", *extra]))


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_build(build_dir: Path) -> tuple[dict, list[dict], dict[str, set], set]:
    """The build stage's texts and examples and the dedup clusters beside them, read independently of the
    stage: (texts, examples, text id -> its cluster's members, ids dedup removed)."""
    texts = {r["id"]: r["text"] for r in load_rows(build_dir / "texts.jsonl")}
    examples = load_rows(build_dir / "examples.jsonl")
    edges = load_rows(build_dir / "clusters.jsonl")
    cluster: dict[str, set] = {}
    for e in edges:  # the planted chain is one cluster
        members = {e["kept_id"], *e["removed_ids"]}
        for m in list(members):
            members |= cluster.get(m, set())
        for m in members:
            cluster[m] = members
    removed = {r for e in edges for r in e["removed_ids"]}
    return texts, examples, cluster, removed


class ReferenceSelection:
    """The selection of hard negatives stated from the rules in the docstrings of data_pipeline/negatives.py
    and pool_candidates.py, as list operations on one example at a time; written independently of PoolMiner
    (no walk, no slots or integer tables), so that a slip in its loop is not repeated here.

    Exclusions (pool_candidates.py): never a negative of example i: a positive of any example asking the
    same question as i (same query id, same normalised query text, or query in the same dedup cluster; i
    itself included), a member of the dedup cluster of one of i's positives, a text equal after
    normalisation to any of these, a text dedup removed.  Selection (negatives.py): along the example's
    top-K row (scores rounded to 6 decimals, descending), neighbours scoring >= hi or above the example's cap
    are skipped; the usable candidates of the rest, each id at its first offer, are taken in row order:
    the first max_negatives of those in [lo, hi); when the window holds fewer than max_negatives and
    fewer than min_negatives, the walk goes on below lo neighbour by neighbour until the two together
    reach min_negatives, and (`below` fallback) those first ones below lo fill up to min_negatives; then
    (`random` fallback) one rng.shuffle of the indices of every candidate below hi and not above the cap,
    taken in that order, usable and not yet met, fill up to min_negatives."""

    def __init__(self, examples: list[dict], texts: dict[str, str], cluster_of: dict[str, int],
                 removed: set[str], similarity: str):
        norm = Normalizer()
        self.text_of = functools.cache(lambda tid: norm(texts[tid]) if tid in texts else None)
        self.removed = removed
        queries = [ex["query_id"] for ex in examples]

        def same_question(a: str, b: str) -> bool:
            return (a == b or self.text_of(a) is not None and self.text_of(a) == self.text_of(b)
                    or (cluster_of.get(a) is not None and cluster_of.get(a) == cluster_of.get(b)))

        self.excluded, self.excluded_text = [], []
        for ex in examples:
            ids = {p for other, q in zip(examples, queries) if same_question(ex["query_id"], q)
                   for p in other["pos_ids"]}
            ids |= {t for p in ex["pos_ids"] if cluster_of.get(p) is not None
                    for t, c in cluster_of.items() if c == cluster_of[p]}
            self.excluded.append(ids)
            self.excluded_text.append({self.text_of(t) for t in ids} - {None})
        if similarity == "question":  # neighbour j is example j's query and offers its positives
            self.candidates = [list(ex["pos_ids"]) for ex in examples]
        else:  # neighbour j is the pool's j-th distinct positive that dedup kept
            self.docs = list(dict.fromkeys(p for ex in examples for p in ex["pos_ids"] if p not in removed))
            self.candidates = [[d] for d in self.docs]

    def usable(self, i: int, tid: str) -> bool:
        return (tid not in self.removed and tid not in self.excluded[i]
                and self.text_of(tid) not in self.excluded_text[i])

    def _offers(self, i: int, scores, neighbours, keep) -> list[tuple[int, str, float]]:
        """(position, id, rounded score) of every usable candidate at the positions of row i whose score
        passes `keep`, each id at its first offer, in row order."""
        rounded = np.round(np.asarray(scores, np.float64), 6).tolist()
        offers = [(pos, tid, s) for pos, (s, j) in enumerate(zip(rounded, np.asarray(neighbours).tolist()))
                  if j >= 0 and keep(s) for tid in self.candidates[j] if self.usable(i, tid)]
        first = {}
        for pos, tid, s in offers:
            first.setdefault(tid, (pos, tid, s))
        return list(first.values())

    def select(self, i, scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, rng,
               cap=math.inf) -> Mined:
        offers = self._offers(i, scores, neighbours, lambda s: s < hi and s <= cap)
        window = [o for o in offers if o[2] >= lo]
        below = [o for o in offers if o[2] < lo]
        taken = window[:max(max_neg, 0)]
        met = {tid for _, tid, _ in taken}
        if len(window) < max_neg and len(window) < min_neg:
            short = min_neg - len(window)  # the walk below lo stops at the first neighbour reached with
            met |= {tid for pos, tid, _ in below if sum(o[0] < pos for o in below) < short}  # enough met
            if "below" in fallback:
                taken = taken + below[:short]
        negs = [(tid, s) for _, tid, s in taken]
        in_window, filled = min(len(window), max(max_neg, 0)), len(taken) - min(len(window), max(max_neg, 0))
        if len(negs) < min_neg and "random" in fallback:
            sims = np.round(np.asarray(all_scores(i), np.float64), 6)
            order = [j for j in range(len(sims)) if sims[j] < hi and sims[j] <= cap]
            rng.shuffle(order)
            drawn = [(tid, float(sims[j])) for j in order for tid in self.candidates[j]
                     if tid not in met and self.usable(i, tid)]
            first: dict[str, float] = {}
            for tid, s in drawn:  # each id at its first draw
                first.setdefault(tid, s)
            extra = list(first.items())[:min_neg - len(negs)]
            negs, filled = negs + extra, filled + len(extra)
        return Mined([t for t, _ in negs], [s for _, s in negs], filled, in_window)

    def mine_all(self, scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, rng, cap=None):
        """PoolMiner.mine_all's interface: every example in row order (the random fallback draws from the
        shared rng example by example)."""
        caps = [math.inf] * len(scores) if cap is None else cap
        return [self.select(i, scores[i], neighbours[i], all_scores, lo, hi, max_neg, min_neg, fallback, rng,
                            float(caps[i])) for i in range(len(scores))]

    def count_above(self, scores, neighbours, lo, hi, caps: dict) -> dict:
        """PoolMiner.count_above's interface: per cap and example, its usable candidates in [lo, hi) (each id
        at its first offer there) scoring above the cap."""
        out = {}
        for name, cap in caps.items():
            out[name] = np.array([sum(s > cap[i] for _, _, s in self._offers(
                i, scores[i], neighbours[i], lambda s: lo <= s < hi)) for i in range(len(scores))], np.int64)
        return out


def as_tuples(mined: list[Mined]) -> list[tuple]:
    return [(m.neg_ids, m.neg_scores, m.fallback, m.in_window) for m in mined]
