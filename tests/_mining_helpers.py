"""Shared by the mining tests: the top-K, a CSV reader, the real config composed once, a JSON Lines reader,
and the per-example walk the vectorised selection (data_pipeline/negatives.py) must reproduce."""

from __future__ import annotations

import csv
import functools
import json
import math
import random
from collections import defaultdict
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


class ReferenceWalk:
    """data_pipeline/negatives.py's PoolMiner before the selection was vectorised, verbatim but for the
    per-example cap (two conditions, marked): a Python walk down each example's neighbours
    (PoolMiner.mine_all must give exactly its output)."""

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
             max_neg: int, min_neg: int, fallback: list[str], rng: random.Random,
             cap: float = math.inf) -> Mined:
        """Example i, given its neighbours (descending scores; -1 = none) and `all_scores(i)`, its
        similarity to every candidate (only computed when the random fallback is needed).  Scores are
        rounded to 6 decimals before the window test, so the stored score is the one tested.  `cap`: this
        example's positive-aware cap (a score above it is never taken)."""
        window, below, seen = [], [], set()
        for s, j in zip(np.round(scores.astype(np.float64), 6).tolist(), neighbours.tolist()):
            if len(window) >= max_neg or (s < lo and len(window) + len(below) >= min_neg):
                break  # scores only fall from here on: nothing further would be stored
            if j < 0 or s >= hi or s > cap:  # the cap: a score above it is skipped like one >= hi
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
            order = np.flatnonzero((sims < hi) & (sims <= cap)).tolist()  # the cap, in the fallback too
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

    def mine_all(self, scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, rng, cap=None):
        """PoolMiner.mine_all's interface, example by example."""
        caps = [math.inf] * len(scores) if cap is None else cap
        return [self.mine(i, scores[i], neighbours[i], all_scores, lo, hi, max_neg, min_neg, fallback, rng,
                          float(caps[i])) for i in range(len(scores))]


    def count_above(self, scores, neighbours, lo, hi, caps: dict) -> dict:
        """PoolMiner.count_above by the walk: per cap and example, its usable first-seen top-K candidates
        in [lo, hi) scoring above the cap."""
        out = {name: np.zeros(len(scores), np.int64) for name in caps}
        for i in range(len(scores)):
            seen = set()
            for s, j in zip(np.round(scores[i].astype(np.float64), 6).tolist(), neighbours[i].tolist()):
                if j < 0 or not lo <= s < hi:
                    continue
                for tid in self.candidates[j]:
                    if tid not in seen and self.usable(i, tid):
                        seen.add(tid)
                        for name, cap in caps.items():
                            out[name][i] += s > cap[i]
        return out


def as_tuples(mined: list[Mined]) -> list[tuple]:
    return [(m.neg_ids, m.neg_scores, m.fallback, m.in_window) for m in mined]
