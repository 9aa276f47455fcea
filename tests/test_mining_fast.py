"""PoolMiner.mine_all (data_pipeline/negatives.py, the selection vectorised over the top-K matrix) gives
exactly the Mined of the per-example walk it replaced, kept below as `_ReferenceMiner`: same ids, scores,
fallback counts and in-window counts, and the same draws from the shared rng.  On the real subset of
conftest.py's `build_dir` (cEpilepsyQA answers and cMedQQ questions, with its planted dedup cluster and
removed texts, a duplicate question, multi-positive and shared-positive examples), in both similarity
modes, over windows and limits that leave the window full, trigger the `below` and the `random` fallback,
and with the first band narrowed to nothing so the second scan runs."""

from __future__ import annotations

import random
from collections import defaultdict

import faiss
import numpy as np
import pytest
from _mining_helpers import TOP_K, compose
from omegaconf import OmegaConf

from care.data.io import read_text_store
from care.encoders import build_encoder
from data_pipeline import mining, negatives
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.negatives import Mined, PoolMiner


class _ReferenceMiner:
    """data_pipeline/negatives.py's PoolMiner before the selection was vectorised, verbatim: a Python walk
    down each example's neighbours (PoolMiner.mine_all must give exactly its output)."""

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


def as_tuples(mined: list[Mined]) -> list[tuple]:
    return [(m.neg_ids, m.neg_scores, m.fallback, m.in_window) for m in mined]


@pytest.fixture(scope="module")
def pools(build_dir, spread_bert, tmp_path_factory):
    """Per similarity mode and pool: the examples and the vectors and FAISS top-K mine_pool would search,
    plus the top-K padded past the pool's size (FAISS fills that with -1 neighbours)."""
    cfg = compose(build_dir, tmp_path_factory.mktemp("mine"), spread_bert)
    encoder = build_encoder(cfg.model)
    texts = read_text_store(build_dir / "texts.jsonl")
    examples = mining.read_examples(build_dir / "examples.jsonl", texts)
    cluster_of, removed = mining.read_clusters(build_dir / "clusters.jsonl")
    assert removed and cluster_of
    by_pool = defaultdict(list)
    for ex in examples:
        by_pool[ex["pool"]].append(ex)
    # A variant where examples 30-39 also list example 70-79's answer as a positive: in question mode that
    # answer is then offered by two neighbours, the case of the first-occurrence dedup.
    shared = [dict(ex, pos_ids=list(ex["pos_ids"])) for ex in by_pool["answers"]]
    for k in range(30, 40):
        shared[k]["pos_ids"].append(shared[k + 40]["pos_ids"][0])
    by_pool["answers, shared positives"] = shared
    out = {}
    for similarity in ("question", "document"):
        for pool, exs in by_pool.items():
            miner = PoolMiner(exs, texts, cluster_of, removed, similarity)
            q = mining.encode(encoder, [texts[e["query_id"]] for e in exs], "query", 64, None)
            c = q if similarity == "question" else mining.encode(
                encoder, [texts[d] for d in miner.docs], "document", 64, None)
            index = faiss.IndexFlatIP(c.shape[1])
            index.add(c)
            k = min(TOP_K + (similarity == "question"), len(c))
            out[similarity, pool] = {"examples": exs, "texts": texts, "cluster_of": cluster_of,
                                     "removed": removed, "q": q, "c": c, "topk": index.search(q, k),
                                     "padded": index.search(q, len(c) + 3)}
    return out


def limits(window):
    """(lo, hi, max_negatives, min_negatives, fallback): the fixture's window, narrow windows that leave
    most examples to the `below` or the `random` fallback (with and without `below` first), and limits
    that cap the window (max below min, max 0) or ask for more than the top-K holds."""
    lo, hi = window
    return [(lo, hi, 99, 9, ["below", "random"]), (hi - 0.01, hi, 99, 9, ["below", "random"]),
            (hi - 0.01, hi, 99, 9, ["random"]), (hi - 0.01, hi, 99, 9, ["below"]),
            (0.999, 0.9999, 99, 9, ["random"]), (lo, hi, 5, 9, ["below", "random"]), (lo, hi, 4, 2, ["below"]),
            (lo, hi, 99, 40, []), (lo, hi, 0, 3, ["below", "random"]), (lo - 0.2, hi, 7, 9, ["random"])]


@pytest.mark.parametrize(("slack", "rows"), [(negatives._SLACK, negatives._ROWS), (0, 7)])
@pytest.mark.parametrize("similarity", ["question", "document"])
def test_mine_all_equals_the_walk(pools, window, similarity, slack, rows, monkeypatch):
    """slack 0: the first band ends where an example with no exclusion would be settled, so every
    exclusion inside it sends the example to the second scan; rows 7: a pool goes in many blocks of
    examples, the random fallback's draws continuing from one block to the next."""
    monkeypatch.setattr(negatives, "_SLACK", slack)
    monkeypatch.setattr(negatives, "_ROWS", rows)
    scans = []
    real_scan = PoolMiner._scan
    monkeypatch.setattr(PoolMiner, "_scan", lambda self, *a: scans.append(len(a[3])) or real_scan(self, *a))
    draws = fallbacks = calls = 0
    for (mode, pool), p in pools.items():
        if mode != similarity:
            continue
        args = (p["examples"], p["texts"], p["cluster_of"], p["removed"], similarity)
        ref, new = _ReferenceMiner(*args), PoolMiner(*args)
        assert new.slot_shared.any() == (similarity == "question" and pool == "answers, shared positives")

        def all_scores(i, q=p["q"], c=p["c"]):
            return c @ q[i]

        for topk in ("topk", "padded"):
            scores, neighbours = p[topk]
            assert (neighbours < 0).any() == (topk == "padded")
            for lo, hi, max_neg, min_neg, fallback in limits(window):
                r_ref, r_new = random.Random(0), random.Random(0)
                want = [ref.mine(i, scores[i], neighbours[i], all_scores, lo, hi, max_neg, min_neg, fallback,
                                 r_ref) for i in range(len(scores))]
                calls += 1
                got = new.mine_all(scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, r_new)
                case = f"{pool} {topk} [{lo}, {hi}) max {max_neg} min {min_neg} {fallback}"
                assert as_tuples(got) == as_tuples(want), case
                assert r_new.getstate() == r_ref.getstate(), case  # the same draws, in the same order
                draws += r_ref.getstate() != random.Random(0).getstate()
                fallbacks += sum(m.fallback for m in want)
    assert draws and fallbacks  # the random fallback ran, and fallbacks were stored
    if slack == 0:
        assert len(scans) > calls  # some examples were not settled by the first band: a second scan ran


def test_mine_pool_equals_the_walk(build_dir, spread_bert, window, tmp_path, monkeypatch):
    """mine_pool (encode, search, mine_all) against the same stage with the walk in its place."""

    class Walk(_ReferenceMiner):
        def mine_all(self, scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, rng):
            return [self.mine(i, scores[i], neighbours[i], all_scores, lo, hi, max_neg, min_neg, fallback, rng)
                    for i in range(len(scores))]

    texts = read_text_store(build_dir / "texts.jsonl")
    examples = mining.read_examples(build_dir / "examples.jsonl", texts)
    cluster_of, removed = mining.read_clusters(build_dir / "clusters.jsonl")
    cfg = compose(build_dir, tmp_path, spread_bert)
    encoder = build_encoder(cfg.model)
    lo, hi = window
    for similarity, (w_lo, w_hi) in [("question", (lo, hi)), ("document", (hi - 0.01, hi))]:
        opts = {**OmegaConf.to_container(cfg.mine, resolve=True), "similarity": similarity,
                "cache": None}
        for pool in ("answers", "questions"):
            exs = [e for e in examples if e["pool"] == pool]
            runs = []
            for miner in (PoolMiner, Walk):
                monkeypatch.setattr(mining, "PoolMiner", miner)
                timing = {"encode": 0.0, "search": 0.0, "select": 0.0}
                runs.append(mining.mine_pool(exs, texts, encoder, cluster_of, removed, opts,
                                             {"lo": w_lo, "hi": w_hi}, None, timing))
            (got, sims_got), (want, sims_want) = runs
            assert as_tuples(got) == as_tuples(want), (similarity, pool)
            assert np.array_equal(sims_got, sims_want)
            if similarity == "document":
                assert any(m.fallback for m in want)  # the narrow window: fallbacks were stored


def test_scores_must_descend(pools):
    p = pools["document", "answers"]
    miner = PoolMiner(p["examples"], p["texts"], p["cluster_of"], p["removed"], "document")
    scores, neighbours = p["topk"]
    with pytest.raises(ValueError, match="descending order"):
        miner.mine_all(scores[:, ::-1], neighbours[:, ::-1], None, 0.5, 0.8, 9, 3, [], random.Random(0))
