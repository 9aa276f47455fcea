"""PoolMiner.mine_all (data_pipeline/negatives.py, the selection vectorised over the top-K matrix) gives
exactly the Mined of the selection restated from its documented rules, _mining_helpers.ReferenceSelection
(written independently of PoolMiner and of the walk it replaced): same ids,
scores, fallback counts and in-window counts, and the same draws from the shared rng, with and without
per-example caps (the positive-aware rules).  On the real subset of
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
from _mining_helpers import TOP_K, ReferenceSelection, as_tuples, compose
from omegaconf import OmegaConf

from care.data.io import read_text_store
from care.encoders import build_encoder
from data_pipeline import mining, negatives
from data_pipeline.negatives import PoolMiner


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


def mixed_caps(scores: np.ndarray) -> np.ndarray:
    """Per-example caps of every kind: one of the row's own (rounded) scores (a tie at the cap is kept),
    just under one, +inf (no cap) and -1 (nothing usable, not even by the fallback)."""
    R = np.round(scores.astype(np.float64), 6)
    rng = np.random.default_rng(0)
    cap = R[np.arange(len(R)), rng.integers(0, R.shape[1], len(R))]
    kind = rng.integers(0, 5, len(R))
    return np.select([kind == 1, kind == 2, kind == 3], [cap - 5e-7, np.inf, -1.0], cap)


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize(("slack", "rows"), [(negatives._SLACK, negatives._ROWS), (0, 7)])
@pytest.mark.parametrize("similarity", ["question", "document"])
def test_mine_all_equals_the_walk(pools, window, similarity, slack, rows, capped, monkeypatch):
    """slack 0: the first band ends where an example with no exclusion would be settled, so every
    exclusion inside it sends the example to the second scan; rows 7: a pool goes in many blocks of
    examples, the random fallback's draws continuing from one block to the next; capped: per-example
    caps (the positive-aware rules) of every kind."""
    monkeypatch.setattr(negatives, "_SLACK", slack)
    monkeypatch.setattr(negatives, "_ROWS", rows)
    scans = []
    real_scan = PoolMiner._scan
    monkeypatch.setattr(PoolMiner, "_scan", lambda self, *a: scans.append(len(a[3])) or real_scan(self, *a))
    draws = fallbacks = calls = trimmed = counted = 0
    for (mode, pool), p in pools.items():
        if mode != similarity:
            continue
        args = (p["examples"], p["texts"], p["cluster_of"], p["removed"], similarity)
        ref, new = ReferenceSelection(*args), PoolMiner(*args)
        assert new.slot_shared.any() == (similarity == "question" and pool == "answers, shared positives")

        def all_scores(i, q=p["q"], c=p["c"]):
            return c @ q[i]

        for topk in ("topk", "padded"):
            scores, neighbours = p[topk]
            assert (neighbours < 0).any() == (topk == "padded")
            cap = mixed_caps(scores) if capped else None
            for lo, hi, max_neg, min_neg, fallback in limits(window):
                r_ref, r_new = random.Random(0), random.Random(0)
                want = ref.mine_all(scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, r_ref,
                                    cap=cap)
                calls += 1
                got = new.mine_all(scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback, r_new,
                                   cap=cap)
                case = f"{pool} {topk} [{lo}, {hi}) max {max_neg} min {min_neg} {fallback} capped {capped}"
                assert as_tuples(got) == as_tuples(want), case
                if capped:
                    assert all(s <= c for m, c in zip(got, cap) for s in m.neg_scores), case
                    counts = {"cap": cap, "half": np.where(np.arange(len(cap)) % 2, cap, np.inf)}
                    above = new.count_above(scores, neighbours, lo, hi, counts)
                    want_above = ref.count_above(scores, neighbours, lo, hi, counts)
                    assert {k: v.tolist() for k, v in above.items()} == {
                        k: v.tolist() for k, v in want_above.items()}, case
                    counted += int(above["cap"].sum())
                    free = new.mine_all(scores, neighbours, all_scores, lo, hi, max_neg, min_neg, fallback,
                                        random.Random(0))
                    trimmed += sum(a.neg_ids != b.neg_ids for a, b in zip(got, free))
                assert r_new.getstate() == r_ref.getstate(), case  # the same draws, in the same order
                draws += r_ref.getstate() != random.Random(0).getstate()
                fallbacks += sum(m.fallback for m in want)
    assert draws and fallbacks  # the random fallback ran, and fallbacks were stored
    assert bool(trimmed) == capped  # the caps changed some examples' negatives
    assert bool(counted) == capped  # ... and count_above found candidates above them
    if slack == 0:
        assert len(scans) > calls  # some examples were not settled by the first band: a second scan ran


def test_mine_pool_equals_the_walk(build_dir, spread_bert, window, tmp_path, monkeypatch):
    """mine_pool (encode, search, positive scores, caps, mine_all, the rules' counts) against the same
    stage with the walk in its place: without rules, and with rules that bite in either mode."""
    texts = read_text_store(build_dir / "texts.jsonl")
    examples = mining.read_examples(build_dir / "examples.jsonl", texts)
    cluster_of, removed = mining.read_clusters(build_dir / "clusters.jsonl")
    cfg = compose(build_dir, tmp_path, spread_bert)
    encoder = build_encoder(cfg.model)
    lo, hi = window
    cases = [("question", (lo, hi), {}), ("document", (hi - 0.01, hi), {}),
             ("question", (lo, hi), {"max_score": round((lo + hi) / 2, 3)}),
             ("document", (lo - 0.07, hi), {"relative_margin": 0.05, "absolute_margin": 0.02,
                                            "max_score": round(hi - 0.05, 3)})]
    removed_any = 0
    for similarity, (w_lo, w_hi), rules in cases:
        opts = {**OmegaConf.to_container(cfg.mine, resolve=True), "similarity": similarity,
                "cache": None, **rules}
        for pool in ("answers", "questions"):
            exs = [e for e in examples if e["pool"] == pool]
            runs = []
            for miner in (PoolMiner, ReferenceSelection):
                monkeypatch.setattr(mining, "PoolMiner", miner)
                timing = {"encode": 0.0, "search": 0.0, "select": 0.0}
                runs.append(mining.mine_pool(exs, texts, encoder, cluster_of, removed, opts,
                                             {"lo": w_lo, "hi": w_hi}, None, timing))
            got, want = runs
            case = (similarity, pool, rules)
            assert as_tuples(got.mined) == as_tuples(want.mined), case
            assert np.array_equal(got.neighbour_sims, want.neighbour_sims), case
            assert got.pos_scores == want.pos_scores and got.removed == want.removed, case
            assert set(got.removed) == (set(rules) | {"removed_any", "examples_affected"} if rules else set())
            removed_any += got.removed.get("removed_any", 0)
            if similarity == "document" and not rules:
                assert any(m.fallback for m in want.mined)  # the narrow window: fallbacks were stored
    assert removed_any  # the rules removed candidates: their counts were compared, not only zeros


def test_scores_must_descend(pools):
    p = pools["document", "answers"]
    miner = PoolMiner(p["examples"], p["texts"], p["cluster_of"], p["removed"], "document")
    scores, neighbours = p["topk"]
    with pytest.raises(ValueError, match="descending order"):
        miner.mine_all(scores[:, ::-1], neighbours[:, ::-1], None, 0.5, 0.8, 9, 3, [], random.Random(0))
