"""Hard-negative mining (data_pipeline/mining.py) on a real subset of cEpilepsyQA and cMedQQ with a tiny
encoder, checked against a brute-force numpy top-K written here from the rules in the module docstring.
The subset, the encoder and the similarity window are the `build_dir`, `spread_bert` and `window` fixtures
in conftest.py."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
import pytest
from _mining_helpers import TOP_K, compose, load_rows, read_build

from care.encoders import build_encoder
from data_pipeline import mining


def norm(text: str) -> str:
    """The normalisation mining uses for "same text" (NFKC, lowercase, collapsed whitespace), redone here."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def reference(build_dir: Path, cfg, lo: float, hi: float, similarity: str):
    """Per example: the window negatives a brute-force search finds ({id: score}), ids within 1e-5 of a
    boundary (lo, hi or the k-th neighbour's score, where float differences may flip them), and the ids
    that may never be its negatives."""
    enc = build_encoder(cfg.model)
    texts, examples, cluster, removed = read_build(build_dir)
    out = {}
    for pool in {e["pool"] for e in examples}:
        idx = [i for i, e in enumerate(examples) if e["pool"] == pool]
        ex = [examples[i] for i in idx]
        q = enc.encode_queries([texts[e["query_id"]] for e in ex]).dense
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        if similarity == "question":
            cands, offers = q, [e["pos_ids"] for e in ex]
        else:
            docs = list(dict.fromkeys(p for e in ex for p in e["pos_ids"] if p not in removed))
            cands = enc.encode_documents([texts[d] for d in docs]).dense
            cands /= np.linalg.norm(cands, axis=1, keepdims=True)
            offers = [[d] for d in docs]
        sims = q @ cands.T
        for a, e in enumerate(ex):
            qa = e["query_id"]
            same = {
                b
                for b, f in enumerate(ex)
                if f["query_id"] == qa
                or norm(texts[f["query_id"]]) == norm(texts[qa])
                or (qa in cluster and f["query_id"] in cluster[qa])
            }
            banned = set(removed) | {p for b in same for p in ex[b]["pos_ids"]}
            for p in e["pos_ids"]:
                banned |= cluster.get(p, set())
            banned_text = {norm(texts[t]) for t in banned}
            k = TOP_K + (similarity == "question")
            kth = np.sort(sims[a])[::-1][k - 1]  # the k-th best score: ties there may go either way
            found, fuzzy = {}, set()
            for b in np.argsort(-sims[a], kind="stable"):
                s = float(sims[a, b])
                if s < kth - 1e-5:
                    break
                if similarity == "question" and b in same:
                    continue
                for d in offers[b]:
                    if d in banned or norm(texts[d]) in banned_text:
                        continue
                    if min(abs(s - lo), abs(s - hi), abs(s - kth)) < 1e-5:
                        fuzzy.add(d)
                    elif lo <= s < hi and d not in found:
                        found[d] = s
            out[idx[a]] = {
                "found": found,
                "fuzzy": fuzzy,
                "banned": banned,
                "pool_texts": {p for f in ex for p in f["pos_ids"]},
            }
    return examples, texts, out


@pytest.mark.parametrize("similarity", ["question", "document"])
def test_mined_negatives_match_brute_force(build_dir, spread_bert, window, tmp_path, similarity):
    lo, hi = window
    cfg = compose(
        build_dir, tmp_path, spread_bert, f"mine.window=[{lo},{hi}]", f"mine.similarity={similarity}"
    )
    stats = mining.run(cfg)
    rows = load_rows(tmp_path / "train" / "train.jsonl")
    examples, texts, ref = reference(build_dir, cfg, lo, hi, similarity)
    assert [r["query_id"] for r in rows] == [e["query_id"] for e in examples]
    surely_short = maybe_short = 0
    for i, r in enumerate(rows):
        n_window = len(r["neg_ids"]) - r["fallback"]
        window_ids = r["neg_ids"][:n_window]
        want = ref[i]
        # The window part is exactly the brute-force set (up to float ties at a boundary), most similar first.
        assert set(window_ids) - want["fuzzy"] == set(want["found"]) - want["fuzzy"], f"example {i}"
        for d, s in zip(window_ids, r["neg_scores"]):
            assert lo <= s < hi
            if d in want["found"]:
                assert s == pytest.approx(want["found"][d], abs=1e-5)
        assert r["neg_scores"][:n_window] == sorted(r["neg_scores"][:n_window], reverse=True)
        # Never a positive, a same-question answer, a positive's cluster member or a dedup-removed text;
        # always a text of the example's own pool.
        assert not set(r["neg_ids"]) & want["banned"]
        assert not {norm(texts[d]) for d in r["neg_ids"]} & {norm(texts[p]) for p in want["banned"]}
        assert set(r["neg_ids"]) <= want["pool_texts"]
        assert len(set(r["neg_ids"])) == len(r["neg_ids"])
        assert all(s < hi for s in r["neg_scores"])  # the fallback never crosses hi either
        if len(want["found"]) + len(want["fuzzy"]) < 9:  # short: filled up to 9 (the pools are big enough)
            surely_short += 1
            assert len(r["neg_ids"]) == 9 and r["fallback"] == 9 - n_window
        elif len(want["found"]) >= 9:
            assert r["fallback"] == 0
        else:
            maybe_short += 1
    assert surely_short <= stats["examples_short_before_fallback"] <= surely_short + maybe_short
    assert surely_short > 0  # the window leaves some examples short, so the fallback was exercised
    # The planted cases by name: the duplicate question's answer is never example 0's negative, and Y (in
    # P0's cluster) never example 0's; P0 and Z, removed by dedup, are nobody's.
    p0, y = examples[0]["pos_ids"][0], examples[7]["pos_ids"][0]
    dup = next(r for r in rows if r["query_id"] == "dup:question")
    assert dup["pos_ids"][0] not in rows[0]["neg_ids"]
    assert y not in rows[0]["neg_ids"]
    assert not any({p0, "dedup:Z"} & set(r["neg_ids"]) for r in rows)
    assert stats["window"] == {
        "lo": lo,
        "hi": hi,
        "source": "explicit override (mine.window)",
        "calibrated_for": None,
    }
    assert stats["encoder"]["fingerprint"] == build_encoder(cfg.model).fingerprint


def test_fallback_fills_from_below_then_random(build_dir, spread_bert, window, tmp_path):
    """A window so narrow that most examples need the fallback: nearest below lo first, flagged."""
    hi = window[1]
    cfg = compose(
        build_dir, tmp_path, spread_bert, f"mine.window=[{hi - 0.01},{hi}]", "mine.fallback=[below]"
    )
    stats = mining.run(cfg)
    rows = load_rows(tmp_path / "train" / "train.jsonl")
    assert stats["examples_with_fallback"] > len(rows) // 2
    for r in rows:
        n_window = len(r["neg_ids"]) - r["fallback"]
        below = r["neg_scores"][n_window:]
        assert all(s < hi - 0.01 for s in below) and below == sorted(below, reverse=True)
    cfg = compose(build_dir, tmp_path, spread_bert, "mine.window=[0.999,0.9999]", "mine.fallback=[random]")
    stats = mining.run(cfg)  # nothing in the window and no `below`: random candidates under hi
    rows = load_rows(tmp_path / "train" / "train.jsonl")
    assert stats["examples_short_after_fallback"] == 0
    for r in rows:
        n_window = len(r["neg_ids"]) - r["fallback"]
        assert len(r["neg_ids"]) == 9 and all(0.999 <= s < 0.9999 for s in r["neg_scores"][:n_window])
        assert all(s < 0.9999 for s in r["neg_scores"][n_window:])
    assert sum(r["fallback"] for r in rows) > 8 * len(rows)
