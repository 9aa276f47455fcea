"""The build stage's leakage rule (data_pipeline/leakage.py) against a brute-force reference.

Inputs are real subsets of the shared data written in the import stage's layout (the `import_dir` fixture in
conftest.py).  Text ids carry the split (`...:dev:...` / `...:test:...`), so a text shared by a training and
an evaluation split has two ids and the rule has to find it by its text, as it must across sources.  The
checks use a brute-force reference written here: every (evaluation query, training text) pair compared by
normalised text and exact Jaccard.
"""

from __future__ import annotations

import functools
import json
import random
from collections import defaultdict
from pathlib import Path

import pytest
from _build_helpers import NEAR, compose, grams, jaccard, norm, rows

from care.config import load_config
from data_pipeline import build
from data_pipeline.dedup.minhash import minhash_pairs
from data_pipeline.leakage import EvalSet, LeakageDetector
from data_pipeline.planted import plant, shared_texts


def brute_force(import_dir: Path, cfg) -> tuple[dict, dict, dict]:
    """Per eval set its normalised queries and relevant pairs, and the training examples before the
    leakage rule: (rule, query id) -> (query text, positive texts)."""
    texts = {r["id"]: r["text"] for r in rows(import_dir / "texts.jsonl")}
    pairs, lists = rows(import_dir / "pairs.jsonl"), rows(import_dir / "candidates.jsonl")
    queries = defaultdict(set)  # eval set name -> normalised queries
    relevant = defaultdict(set)  # eval set name -> {normalised query, normalised relevant document}
    for e in cfg.build.eval_sets:
        least = e.relevant_min_label if e.relevant_min_label is not None else float("-inf")
        for p in pairs:
            if (p["source"], p["split"]) == (e.source, e.split):
                queries[e.name] |= {
                    norm(texts[p[f"text{k + 1}_id"]]) for k, role in enumerate(e.roles) if role == "query"
                }
                if p["label"] >= least:
                    relevant[e.name].add(frozenset((norm(texts[p["text1_id"]]), norm(texts[p["text2_id"]]))))
        for c in lists:
            if (c["source"], c["split"]) == (e.source, e.split):
                queries[e.name].add(norm(texts[c["query_id"]]))
                relevant[e.name] |= {
                    frozenset((norm(texts[c["query_id"]]), norm(texts[d["id"]])))
                    for d in c["candidates"]
                    if d["label"] >= least
                }
    examples = defaultdict(list)
    for r in cfg.build.rules:
        for p in pairs:
            if (p["source"], p["split"]) == (r.source, r.split) and p["label"] >= r.min_label:
                examples[(r.name, p["text1_id"])].append(p["text2_id"])
        for c in lists:
            if (c["source"], c["split"]) == (r.source, r.split):
                examples[(r.name, c["query_id"])] += [
                    d["id"] for d in c["candidates"] if d["label"] >= r.min_label
                ]
    return (
        {k: frozenset(v) for k, v in queries.items()},
        relevant,
        {k: (texts[k[1]], [texts[p] for p in dict.fromkeys(v) if p != k[1]]) for k, v in examples.items()},
    )


@functools.cache
def gram_index(evals: frozenset[str]) -> dict[str, list[str]]:
    table = defaultdict(list)
    for e in evals:
        for g in grams(e):
            table[g].append(e)
    return table


@functools.cache
def leaks(text: str, evals: frozenset[str]) -> bool:
    """Exact after normalisation, or trigram Jaccard >= 0.8 with some evaluation query.  Only queries
    sharing a trigram are compared (Jaccard 0 otherwise), which changes no answer."""
    t = norm(text)
    table = gram_index(evals)
    return t in evals or any(jaccard(t, e) >= 0.8 for e in {e for g in grams(t) for e in table.get(g, ())})


def test_leakage_rule_against_brute_force(import_dir, tmp_path):
    cfg = compose(import_dir, tmp_path)
    stats = build.run(cfg)
    out = tmp_path / "build"
    report = json.loads((out / "leakage.json").read_text(encoding="utf-8"))
    evals, relevant, before = brute_force(import_dir, cfg)
    every_eval = frozenset().union(*evals.values())
    texts = {r["id"]: r["text"] for r in rows(out / "texts.jsonl")}
    kept = rows(out / "examples.jsonl")
    # After: no evaluation query anywhere in the training files, exact or near (brute force), and the
    # report says 0 for every set and every kind of leak.
    assert not [t for t in texts.values() if leaks(t, every_eval)]
    for name, entry in report["eval_sets"].items():
        assert set(entry["after"].values()) == {0}, name
    # Before: the report's per-set counts of leaking training queries are the brute-force counts.
    for name, queries in evals.items():
        expected = sum(leaks(q, queries) for q, _ in before.values())
        assert report["eval_sets"][name]["before"]["as_query"] == expected, name
        pairs = sum(
            frozenset((norm(q), norm(p))) in relevant[name] for q, pos in before.values() for p in pos
        )
        assert report["eval_sets"][name]["before"]["relevant_pairs"] == pairs, name
    for kind in ("as_query", "as_text", "near", "relevant_pairs"):  # the planted cases: every kind occurs
        assert sum(e["before"][kind] for e in report["eval_sets"].values()) > 0, kind
    # Nothing clean was removed: every example whose query and positives are all clean is kept whole
    # (the rules' max_examples caps are far above these subsets).
    clean = {
        (name, q): pos
        for (name, _), (q, pos) in before.items()
        if pos and not leaks(q, every_eval) and not any(leaks(p, every_eval) for p in pos)
    }
    got = {(e["rule"], texts[e["query_id"]]): [texts[p] for p in e["pos_ids"]] for e in kept}
    for key, pos in clean.items():
        assert got.get(key) == list(dict.fromkeys(pos)), key
    assert stats["examples"] == len(kept) and stats["leakage_removed"] == report["removed"]


def test_unlabelled_texts_are_every_other_text_the_rule_admits(import_dir, tmp_path):
    """build/unlabelled_texts.jsonl (CARE's stage I texts): every imported text that is neither a training
    text nor an evaluation query or a near duplicate of one (brute force), and nothing else."""
    cfg = compose(import_dir, tmp_path)
    stats = build.run(cfg)
    out = tmp_path / "build"
    evals, _, _ = brute_force(import_dir, cfg)
    every_eval = frozenset().union(*evals.values())
    training = {r["id"] for r in rows(out / "texts.jsonl")}
    expected = [r["id"] for r in rows(import_dir / "texts.jsonl")
                if r["id"] not in training and not leaks(r["text"], every_eval)]
    got = [r["id"] for r in rows(out / "unlabelled_texts.jsonl")]
    assert got == expected and stats["unlabelled_texts"] == len(got) > 0
    assert len(expected) < sum(1 for r in rows(import_dir / "texts.jsonl") if r["id"] not in training)  # some refused


def test_leakage_rule_and_dedup_share_one_minhash_recipe(shared):
    """The leakage rule's join (evaluation queries x training texts) finds exactly the pairs the dedup
    stage's self-join over both lists finds between them, with the same exact Jaccard.  A low target
    recall makes LSH miss many true pairs, and which ones depends on the hash function, seed, num_perm
    and banding: give either side another recipe and the two sets differ."""
    sample = [t for t in shared_texts() if 8 <= len(t) <= 80]
    rows, pairs = plant(random.Random(5).sample(sample, 600), n_exact=0, n_variant=0, n_near=400, ngram=3,
                        near_range=(0.75, 1.0), seed=3)
    opts = {**load_config("data_pipeline").build.leakage, "target_recall": 0.5}
    by_id = {r["id"]: r["text"] for r in rows}
    originals = {p.original for p in pairs}
    # One evaluation set per query, so the detector reports every (query, text) pair it finds.
    detector = LeakageDetector([EvalSet(i, {i}) for i in sorted(originals)], by_id, opts)
    evals = list(dict.fromkeys(detector.norm(i) for i in sorted(originals)))
    train = list(dict.fromkeys(detector.norm(r["id"]) for r in rows if r["id"] not in originals))
    train = [t for t in train if t not in set(evals)]  # no exact matches: near duplicates only
    hits = detector.match(set(train))
    leak = {(e, t): sim for t, found in hits.items() for how, e, sim in found.values() if how == "near"}
    res = minhash_pairs(evals + train, opts["ngram"], opts["threshold"], opts["num_perm"], opts["target_recall"],
                        show_progress=False)
    both = evals + train
    dedup = {(both[a], both[b]): s for a, b, s in zip(res.rows.tolist(), res.cols.tolist(), res.sims.tolist())
             if a < len(evals) <= b}
    truth = {(e, t) for e in evals for t in train if jaccard(e, t) >= opts["threshold"]}
    planted = {(detector.norm(p.original), detector.norm(p.copy)) for p in pairs} & truth
    assert len(planted) > 50 and set(leak) <= truth  # precision 1.0
    assert 0 < len(leak) < len(truth)  # the low target recall missed some true pairs: the test can tell
    assert leak == dedup  # the same pairs, the same exact Jaccard
    assert all(s == pytest.approx(jaccard(e, t)) for (e, t), s in leak.items())
    assert planted & set(leak)


def test_dev_test_shared_questions_caught(import_dir, tmp_path):
    """cMedQA2 dev and test share questions (the data README: 892 of ~896); the rule removes every trusted
    dev question that is a trusted test question (14 in the real files), and the planted near duplicate."""
    cfg = compose(import_dir, tmp_path)
    build.run(cfg)
    out = tmp_path / "build"
    texts = {r["id"]: r["text"] for r in rows(out / "texts.jsonl")}
    dev = {texts[e["query_id"]] for e in rows(out / "examples.jsonl") if e["rule"] == "cmedqa2_dev"}
    lists = rows(import_dir / "candidates.jsonl")
    store = {r["id"]: r["text"] for r in rows(import_dir / "texts.jsonl")}
    test_q = {norm(store[c["query_id"]]) for c in lists if c["split"] == "test"}
    dev_q = [store[c["query_id"]] for c in lists if c["split"] == "dev"]
    shared = [q for q in dev_q if norm(q) in test_q]
    assert len(shared) >= 14
    assert not {norm(q) for q in dev} & test_q
    assert not [q for q in dev if q.startswith(NEAR)]
    assert len(dev) == len(dev_q) - len(shared) - 1  # exactly those, and nothing else, went
    entry = json.loads((out / "leakage.json").read_text(encoding="utf-8"))["eval_sets"][
        "cmed_v2 (cMedQA2 test)"
    ]
    assert entry["before"]["as_query"] == len(shared) + 1 and entry["before"]["near"] >= 1
