"""Positive-aware filtering of stage "mine" (mine.relative_margin / absolute_margin / max_score,
conf/mine/default.yaml) and train.jsonl's `pos_scores`, on the real subset of conftest.py's `build_dir`
(cEpilepsyQA answers, cMedQQ questions, planted duplicates and dedup cluster) with the `spread_bert` encoder.

The reference here is brute force and independent of the stage: the encoder's own encode_queries /
encode_documents normalised in numpy (float64), every (query, candidate) cosine of the pool (the stage
searches a top-K covering the whole pool, so no k-th neighbour boundary), the exclusions redone from the
rules of data_pipeline/negatives.py's docstring, and the rules from the yaml's text.  Its cosines differ
from the stage's float32 FAISS ones by ~1e-7, so an example with a candidate within 1e-5 of lo, hi or its
cap is checked loosely, and such examples are asserted to be few (a planted copy ties its original exactly:
either may come first).  The stage's own
numbers are also checked exactly against each other: no stored score above the cap its row's pos_scores
give.  With every rule off, the stage's rows equal those of the stage with the selection restated from
its documented rules (tests/_mining_helpers.py ReferenceSelection) in place of PoolMiner."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from _mining_helpers import ReferenceSelection, compose, load_rows, read_build
from omegaconf import OmegaConf

from care.data.stage_cache import fingerprint
from care.encoders import build_encoder
from care.encoders.prompts import legacy_keyed
from care.models.hub import weights_digest
from data_pipeline import mining
from data_pipeline.distributed.search import SEARCH_KEYS
from data_pipeline.mining_window import rule_thresholds

TOP_ALL = 1000  # more than any pool holds: the stage's top-K is the whole pool, as the reference's
FUZZ = 1e-5
RULES = ("relative_margin", "absolute_margin", "max_score")
HEAD_KEYS = {"query_id", "pos_ids", "neg_ids", "neg_scores", "rule", "pool", "fallback"}  # before pos_scores


def norm(text: str) -> str:
    """The normalisation mining uses for "same text" (NFKC, lowercase, collapsed whitespace), redone here."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def thresholds(rules: dict, pos: list[float]) -> dict[str, float]:
    """conf/mine/default.yaml's rules, redone: p = the least similar positive; drop s > threshold."""
    p = min(pos)
    out = {}
    if "relative_margin" in rules:
        out["relative_margin"] = p - abs(p) * rules["relative_margin"]
    if "absolute_margin" in rules:
        out["absolute_margin"] = p - rules["absolute_margin"]
    if "max_score" in rules:
        out["max_score"] = rules["max_score"]
    return out


@pytest.fixture(scope="module")
def brute(build_dir, spread_bert, tmp_path_factory) -> dict:
    """Per example and similarity mode: its usable candidates [(id, cosine)], most similar first (an id
    offered twice counts at its best score), and its positives' cosines (query vs positive as a document,
    a dedup-removed positive included)."""
    cfg = compose(build_dir, tmp_path_factory.mktemp("ref"), spread_bert)
    enc = build_encoder(cfg.model)
    texts, examples, cluster, removed = read_build(build_dir)
    q = unit(enc.encode_queries([texts[e["query_id"]] for e in examples]).dense)
    doc_ids = list(dict.fromkeys(p for e in examples for p in e["pos_ids"]))
    dvec = dict(zip(doc_ids, unit(enc.encode_documents([texts[d] for d in doc_ids]).dense)))
    out = {"question": [], "document": [], "pos": [], "examples": examples, "texts": texts}
    for a, e in enumerate(examples):
        pool = [b for b, f in enumerate(examples) if f["pool"] == e["pool"]]
        qa = e["query_id"]
        same = [b for b in pool if examples[b]["query_id"] == qa or norm(texts[examples[b]["query_id"]]) ==
                norm(texts[qa]) or examples[b]["query_id"] in cluster.get(qa, ())]
        banned = removed | {p for b in same for p in examples[b]["pos_ids"]}
        for p in e["pos_ids"]:
            banned |= cluster.get(p, set())
        banned_text = {norm(texts[t]) for t in banned}

        def usable(d, banned=banned, banned_text=banned_text):
            return d not in banned and norm(texts[d]) not in banned_text

        best: dict[str, float] = {}
        for b in pool:  # question mode: neighbour b offers its positives at cos(query a, query b)
            for d in examples[b]["pos_ids"]:
                if usable(d):
                    best[d] = max(best.get(d, -2.0), float(q[a] @ q[b]))
        out["question"].append(sorted(best.items(), key=lambda x: -x[1]))
        docs = {d for b in pool for d in examples[b]["pos_ids"] if d not in removed}
        out["document"].append(sorted(((d, float(q[a] @ dvec[d])) for d in docs if usable(d)),
                                      key=lambda x: -x[1]))
        out["pos"].append([float(q[a] @ dvec[p]) for p in e["pos_ids"]])
    sims = np.array([s for c in out["document"] for _, s in c])
    out["doc_window"] = (round(float(np.quantile(sims, 0.45)), 3), round(float(np.quantile(sims, 0.97)), 3))
    out["doc_max_score"] = round(float(np.quantile(sims, 0.8)), 3)
    return out


def run_stage(build_dir, spread_bert, out: Path, similarity: str, window, rules: dict,
              fallback: list[str] = ("below", "random")):
    cfg = compose(build_dir, out, spread_bert, f"mine.window=[{window[0]},{window[1]}]",
                  f"mine.similarity={similarity}", f"mine.top_k={TOP_ALL}",
                  f"mine.fallback=[{','.join(fallback)}]", *(f"mine.{k}={v}" for k, v in rules.items()))
    stats = mining.run(cfg)
    train = out / "train"
    return {"rows": load_rows(train / "train.jsonl"), "stats": stats, "cfg": cfg, "out": train}


def cases(brute, window) -> dict:
    """name -> (similarity, window, rules, fallback): each rule alone and all three in document mode (one
    with the random fallback alone, so that it has to draw under the cap), max_score in question mode."""
    d_win, d_max = brute["doc_window"], brute["doc_max_score"]
    both, rand = ["below", "random"], ["random"]
    every = {"relative_margin": 0.05, "absolute_margin": 0.03, "max_score": d_max}
    return {"relative": ("document", d_win, {"relative_margin": 0.05}, both),
            "absolute": ("document", d_win, {"absolute_margin": 0.03}, both),
            "max_doc": ("document", d_win, {"max_score": d_max}, both),
            "all": ("document", d_win, every, both),
            "relative_random": ("document", d_win, {"relative_margin": 0.05}, rand),
            "max_question": ("question", window, {"max_score": round((window[0] + window[1]) / 2, 3)}, both),
            "off_document": ("document", d_win, {}, both)}


@pytest.fixture(scope="module")
def runs(build_dir, spread_bert, window, brute, tmp_path_factory) -> dict:
    return {name: run_stage(build_dir, spread_bert, tmp_path_factory.mktemp(name), *case)
            for name, case in cases(brute, window).items()}


def first_n(got: list[str], items: list, n: int) -> set:
    """Asserts that `got` is the first n of `items` (most similar first) up to exact ties at the cut (a text
    and its planted copy score the same, in either order); returns the ids surely among the first n."""
    n = min(n, len(items))
    surely_in = {d for d, s in items[:n] if n == len(items) or s - items[n][1] >= FUZZ}
    surely_out = {d for d, s in items[n:] if items[n - 1][1] - s >= FUZZ}
    assert len(got) == n and surely_in <= set(got) and not set(got) & surely_out
    assert set(got) <= {d for d, _ in items}
    return surely_in


def check_example(row: dict, cands: list, pos: list[float], lo: float, hi: float, rules: dict,
                  fallback: list[str], max_neg: int = 99, min_neg: int = 9) -> bool:
    """Row against the reference: its window negatives are the usable candidates in [lo, hi) not above the
    cap, most similar first, up to max_neg.  Short of min_neg, the walk goes on below lo (never above the
    cap) through the nearest ones until min_neg are in hand: stored with `below`, and never drawn by
    `random`, which fills up with other candidates below hi and not above the cap.  False (checked loosely)
    when a reference cosine lies within FUZZ of lo, hi or the cap, where float differences may flip it."""
    cap = min(thresholds(rules, [round(p, 6) for p in pos]).values(), default=np.inf)
    score = dict(cands)
    window = [(d, s) for d, s in cands if lo <= s < hi and s <= cap]
    below = [(d, s) for d, s in cands if s < lo and s <= cap]
    n_window = len(row["neg_ids"]) - row["fallback"]
    negs = list(zip(row["neg_ids"], row["neg_scores"]))
    for d, s in negs:  # whatever else: a candidate the reference knows, at the reference's cosine
        assert d in score and s == pytest.approx(score[d], abs=FUZZ), d
    assert len(set(row["neg_ids"])) == len(negs)
    if any(min(abs(s - lo), abs(s - hi), abs(s - cap)) < FUZZ for _, s in cands):
        return False
    take = min(len(window), max_neg)
    n_walked = min(max(min_neg - take, 0), len(below)) if take < max_neg else 0
    need = n_walked if "below" in fallback else 0
    first_n(row["neg_ids"][:n_window], window, take)
    walked = first_n(row["neg_ids"][n_window:n_window + need], below, n_walked) if need else {
        d for d, s in below[:n_walked] if n_walked == len(below) or s - below[n_walked][1] >= FUZZ}
    for part in (row["neg_scores"][:n_window], row["neg_scores"][n_window:n_window + need]):
        assert part == sorted(part, reverse=True)
    rest = sum(s < hi and s <= cap for _, s in cands) - take - n_walked  # what `random` may draw
    n_random = max(min(min_neg - take - need, rest), 0) if "random" in fallback else 0
    assert len(negs) == take + need + n_random
    for d, _ in negs[n_window + need:]:  # the random fallback: below hi, not above the cap, not walked
        assert score[d] < hi and score[d] <= cap and d not in walked
    return True


@pytest.mark.parametrize("name", ["relative", "absolute", "max_doc", "all", "relative_random", "max_question",
                                  "off_document"])
def test_rule_matches_brute_force(runs, brute, window, name):
    similarity, (lo, hi), rules, fallback = cases(brute, window)[name]
    run = runs[name]
    rows, stats = run["rows"], run["stats"]
    examples = brute["examples"]
    assert [r["query_id"] for r in rows] == [e["query_id"] for e in examples]
    exact = changed = 0
    for i, row in enumerate(rows):
        pos = brute["pos"][i] if similarity == "document" else [1.0] * len(row["pos_ids"])
        certain = check_example(row, brute[similarity][i], pos, lo, hi, rules, fallback)
        exact += certain
        # Exact, on the stage's own numbers: nothing stored at or above hi, nor above its row's cap.
        cap = min(thresholds(rules, row["pos_scores"]).values(), default=np.inf)
        assert all(s < hi and s <= cap for s in row["neg_scores"]), i
        free = [d for d, s in brute[similarity][i] if lo <= s < hi]
        changed += certain and len(free) > len(row["neg_ids"]) - row["fallback"]
    assert exact >= 0.95 * len(rows)  # few examples near a boundary: the comparison above is the rule
    assert stats["examples_with_fallback"] > 0
    assert (changed > 0) == bool(rules)  # a rule took candidates out of the window of some examples
    if rules:  # ... but not out of every example's
        assert stats["positive_aware"]["examples_affected"] < len(rows)


def test_rules_change_the_selection(runs):
    """The same window with and without the rules: fewer window negatives, more fallback."""
    off, on = runs["off_document"]["rows"], runs["all"]["rows"]
    in_window = [sum(len(r["neg_ids"]) - r["fallback"] for r in rows) for rows in (off, on)]
    assert in_window[1] < in_window[0]
    assert sum(r["fallback"] for r in on) > sum(r["fallback"] for r in off)
    assert runs["off_document"]["stats"]["fingerprint"] != runs["all"]["stats"]["fingerprint"]


@pytest.mark.parametrize("name", ["relative", "absolute", "max_doc", "all", "max_question"])
def test_stats_count_what_each_rule_removed(runs, brute, window, name):
    """stats.json positive_aware: per rule, the (example, candidate) pairs in [lo, hi) it alone drops;
    removed_any and examples_affected for all together; rules that are off are null."""
    similarity, (lo, hi), rules, _ = cases(brute, window)[name]
    got = runs[name]["stats"]["positive_aware"]
    want = {k: 0 for k in (*rules, "removed_any")}
    fuzzy = affected = 0
    per_example = []
    for i, cands in enumerate(brute[similarity]):
        pos = [round(p, 6) for p in brute["pos"][i]] if similarity == "document" else [1.0]
        th = thresholds(rules, pos)
        cap = min(th.values())
        in_window = [s for _, s in cands if lo <= s < hi]
        for k, t in th.items():
            want[k] += sum(s > t for s in in_window)
        n_any = sum(s > cap for s in in_window)
        want["removed_any"] += n_any
        affected += n_any > 0
        edges = [lo, hi, *th.values()]
        near = sum(min(abs(s - e) for e in edges) < FUZZ for s in in_window)
        fuzzy += near
        per_example.append(near)
    assert set(got) == {*RULES, "removed_any", "examples_affected"}
    for k in RULES:
        if k in rules:
            assert got[k]["value"] == rules[k]
            assert abs(got[k]["removed"] - want[k]) <= fuzzy, k
            assert 0 < got[k]["removed"] <= got["removed_any"], k
        else:
            assert got[k] == {"value": None, "removed": None}
    assert abs(got["removed_any"] - want["removed_any"]) <= fuzzy
    most = max(got[k]["removed"] for k in rules)
    assert got["removed_any"] == most if len(rules) == 1 else most <= got["removed_any"] < sum(
        got[k]["removed"] for k in rules)
    assert abs(got["examples_affected"] - affected) <= sum(n > 0 for n in per_example)
    assert 0 < got["examples_affected"] <= got["removed_any"]
    assert fuzzy <= 20  # the comparison is close to exact


def test_rule_thresholds():
    """The thresholds from an example's least similar positive; the relative margin comes off |p|, so a
    negative positive similarity still puts the threshold below the positive, not above."""
    pos = np.array([0.8, 0.5, -0.5])
    got = rule_thresholds({"relative_margin": 0.1, "absolute_margin": 0.05, "max_score": 0.7}, pos)
    assert got["relative_margin"] == pytest.approx([0.72, 0.45, -0.55])
    assert got["absolute_margin"] == pytest.approx([0.75, 0.45, -0.55])
    assert got["max_score"].tolist() == [0.7] * 3
    assert rule_thresholds({}, pos) == {}


def test_options_off_stats(runs):
    assert runs["off_document"]["stats"]["positive_aware"] == {
        **{k: {"value": None, "removed": None} for k in RULES}, "removed_any": 0, "examples_affected": 0}


def test_pos_scores_are_the_mining_similarity(runs, brute):
    """pos_scores, aligned with pos_ids: cos(query, positive) in document mode (a dedup-removed positive
    too, though it is nobody's candidate), the query with itself (1.0) in question mode."""
    rows = runs["off_document"]["rows"]
    for row, pos in zip(rows, brute["pos"]):
        assert len(row["pos_scores"]) == len(row["pos_ids"])
        assert row["pos_scores"] == pytest.approx(pos, abs=FUZZ)
        assert all(s == round(s, 6) for s in row["pos_scores"])
    p0 = brute["examples"][0]["pos_ids"][0]  # removed by dedup: encoded on its own for its score
    assert rows[0]["pos_ids"][0] == p0
    assert rows[0]["pos_scores"][0] == pytest.approx(brute["pos"][0][0], abs=FUZZ)
    assert len({s for r in rows for s in r["pos_scores"]}) > len(rows) // 2  # real cosines, not a constant
    for row in runs["max_question"]["rows"]:
        assert row["pos_scores"] == [1.0] * len(row["pos_ids"])


@pytest.mark.parametrize("similarity", ["question", "document"])
def test_options_off_same_rows_as_the_walk(build_dir, spread_bert, window, tmp_path, monkeypatch, similarity):
    """Every rule off: the stage's train.jsonl equals, row by row, the stage's with the selection restated
    from its documented rules (tests/_mining_helpers.py ReferenceSelection, no cap) in PoolMiner's place,
    and its keys are those of before plus pos_scores; the FlagEmbedding export is identical too."""

    class Walk(ReferenceSelection):
        def mine_all(self, *args, cap=None):
            assert cap is None  # no rule: mining passes no cap
            return super().mine_all(*args)

    new = run_stage(build_dir, spread_bert, tmp_path / "new", similarity, window, {})
    monkeypatch.setattr(mining, "PoolMiner", Walk)
    old = run_stage(build_dir, spread_bert, tmp_path / "walk", similarity, window, {})
    assert new["rows"] == old["rows"]
    assert all(set(r) == HEAD_KEYS | {"pos_scores"} for r in new["rows"])
    assert sum(len(r["neg_ids"]) for r in new["rows"]) > 5 * len(new["rows"])
    assert any(r["fallback"] for r in new["rows"]) and any(not r["fallback"] for r in new["rows"])
    for name in ("texts.jsonl", "flag_train.jsonl"):
        assert (new["out"] / name).read_bytes() == (old["out"] / name).read_bytes(), name


def test_fingerprint_leaves_rules_that_are_off_out_and_marks_the_format(runs):
    """A rule that is off is not part of the stage fingerprint (only the three keys' absence differs from a
    config without them); a rule that is set is; and the file format is, so outputs mined before train.jsonl
    had pos_scores are mined again rather than kept as up to date."""
    run = runs["off_document"]
    cfg = run["cfg"]
    opts = OmegaConf.to_container(cfg.mine, resolve=True)
    assert all(opts[k] is None for k in RULES) and opts["judge"] is None
    # the mine stage's judge (data_pipeline/judge.py) is off: its three keys are left out too, and so are the
    # keys of how the search runs (mine.engine, ...: data_pipeline/distributed/search.py SEARCH_KEYS)
    before = {k: v for k, v in opts.items()
              if k not in (*RULES, "judge", "judge_rule", "judge_margin", *SEARCH_KEYS)}
    window = run["stats"]["window"]
    build = Path(opts["input_dir"])
    inputs = [build / "examples.jsonl", build / "texts.jsonl", build / "leakage.json",
              Path(opts["dedup_clusters"])]
    model = legacy_keyed(OmegaConf.to_container(cfg.model, resolve=True))  # as the stage hashes it
    config = {"mine": before, "window": window, "model": model, "weights": weights_digest(model["path"])}
    assert run["stats"]["fingerprint"] == fingerprint(inputs, {**config, "format": mining.FORMAT})
    assert run["stats"]["fingerprint"] != fingerprint(inputs, config)  # what the stage wrote before: mined again
    assert runs["max_doc"]["stats"]["fingerprint"] != fingerprint(inputs, {**config, "format": mining.FORMAT})


@pytest.mark.parametrize(("overrides", "message"), [
    (["mine.relative_margin=0.05"], (r"mine.relative_margin needs mine.similarity=document: in question mode "
                                     r".*use mine.max_score or the window's hi")),
    (["mine.absolute_margin=0.02", "mine.max_score=0.8"],
     r"mine.absolute_margin needs mine.similarity=document"),
    (["mine.similarity=document", "mine.relative_margin=1.0"],
     r"mine.relative_margin must lie in \[0, 1\), not 1.0"),
    (["mine.similarity=document", "mine.absolute_margin=-0.1"], r"mine.absolute_margin must lie in \[0, 1\)"),
    (["mine.max_score=1.5"], r"mine.max_score must lie in \[-1, 1\]"),
    (["mine.max_score=high"], r"mine.max_score must be a number or null, not 'high'"),
    (["mine.similarity=document", "mine.relative_margin=true"],
     r"mine.relative_margin must be a number or null"),
])
def test_rules_refused(build_dir, spread_bert, window, tmp_path, overrides, message):
    """Question mode refuses the margins (the positive's similarity is the query's with itself), and bad
    values are refused, in one line, before anything is read or written."""
    cfg = compose(build_dir, tmp_path, spread_bert, f"mine.window=[{window[0]},{window[1]}]", *overrides)
    with pytest.raises(ValueError, match=message) as err:
        mining.run(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "train").exists()


def test_max_score_valid_in_question_mode(runs, window):
    """max_score alone in question mode is accepted and caps every example, the fallback included."""
    run = runs["max_question"]
    cap = json.loads((run["out"] / "stats.json").read_text(encoding="utf-8"))["positive_aware"]["max_score"]
    assert cap["value"] == round((window[0] + window[1]) / 2, 3) and cap["removed"] > 0
    assert all(s <= cap["value"] for r in run["rows"] for s in r["neg_scores"])
