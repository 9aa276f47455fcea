"""The build stage (data_pipeline/build.py): training examples, the leakage rule, the FlagEmbedding exporter.

Inputs are real subsets of the shared data written in the import stage's layout.  Text ids carry the split
(`...:dev:...` / `...:test:...`), so a text shared by a training and an evaluation split has two ids and
the rule has to find it by its text, as it must across sources.  The checks use a brute-force reference
written here: every (evaluation query, training text) pair compared by normalised text and exact Jaccard.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import random
import unicodedata
from collections import defaultdict
from pathlib import Path

import pytest
from omegaconf import open_dict

from care.config import load_config
from care.data.io import DataError
from data_pipeline import build
from data_pipeline.dedup.minhash import minhash_pairs
from data_pipeline.leakage import EvalSet, LeakageDetector
from data_pipeline.planted import plant, shared_texts

SOURCES = ("cmedqa2_pairs", "kuake_qqr", "kuake_qtr")
NEAR = "请问医生"  # prepended to a test question to plant a near duplicate in the dev training split
# (source, file prefix, the two JSON fields, their roles) of the KUAKE sets used here.
KUAKE = (("kuake_qqr", "cblue_kuake_qqr/KUAKE-QQR", ("query1", "query2"), ("query", "query")),
         ("kuake_qtr", "cblue_kuake_qtr/KUAKE-QTR", ("query", "title"), ("query", "title")))


def norm(text: str) -> str:
    """The leakage normalisation (NFKC, lowercase, no punctuation, collapsed whitespace), redone here."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join("".join(c for c in text if not unicodedata.category(c).startswith("P")).split())


@functools.cache
def grams(text: str) -> frozenset[str]:
    return frozenset({text[i : i + 3] for i in range(len(text) - 2)} if len(text) > 3 else {text})


def jaccard(a: str, b: str) -> float:
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def tid(source: str, role: str, split: str, text: str) -> str:
    return f"{source}:{role}:{split}:{hashlib.md5(text.encode()).hexdigest()[:12]}"


@pytest.fixture(scope="module")
def import_dir(tmp_path_factory, shared) -> Path:
    """cMedQA2 pairs dev + test (trusted questions, 1-2 positives, as the import stage keeps them) with one
    planted near duplicate; KUAKE-QQR train + dev, plus a dev query planted as a training positive; KUAKE-QTR
    train + dev, plus a dev pair planted in train."""
    out = tmp_path_factory.mktemp("import")
    texts, pairs, lists = {}, [], []

    def text(source, role, split, value):
        key = tid(source, role, split, value)
        texts[key] = {"id": key, "text": value, "source": source, "role": role}
        return key

    groups = {}
    for split in ("dev", "test"):
        grouped = defaultdict(list)
        with open(shared / "chineseblue_cmedqa2_pairs" / f"{split}.txt", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh, delimiter="\t"))
        for label, q, a in rows:
            grouped[q.strip()].append((a.strip(), int(label)))
        groups[split] = {q: c for q, c in grouped.items() if 1 <= sum(lab for _, lab in c) <= 2}
    test_only = [q for q in groups["test"] if q not in groups["dev"] and len(norm(q)) >= 20]
    planted = NEAR + test_only[0]
    assert jaccard(norm(planted), norm(test_only[0])) >= 0.8  # a near duplicate by the rule's own measure
    groups["dev"][planted] = groups["dev"][next(iter(groups["dev"]))]
    for split, grouped in groups.items():
        for q, cands in grouped.items():
            qid = text("cmedqa2_pairs", "question", split, q)
            lists.append(
                {
                    "id": f"cmedqa2_pairs:{split}:{qid}",
                    "source": "cmedqa2_pairs",
                    "split": split,
                    "query_id": qid,
                    "candidates": [
                        {"id": text("cmedqa2_pairs", "answer", split, a), "label": lab} for a, lab in cands
                    ],
                }
            )
    for source, folder, (f1, f2), roles in KUAKE:
        for split, limit in (("train", 2000), ("dev", 300)):
            for row in json.loads((shared / f"{folder}_{split}.json").read_text(encoding="utf-8"))[:limit]:
                if source == "kuake_qqr" and split == "dev" and row["id"] == "s9":
                    continue
                pairs.append(
                    {
                        "id": f"{source}:{split}:{row['id']}",
                        "source": source,
                        "split": split,
                        "text1_id": text(source, roles[0], split, row[f1]),
                        "text2_id": text(source, roles[1], split, row[f2]),
                        "label": int(row["label"]),
                    }
                )
    # A KUAKE-QTR dev (query, relevant title) pair planted as a training pair: a relevant-pair leak.
    dev = next(p for p in pairs if p["source"] == "kuake_qtr" and p["split"] == "dev" and p["label"] == 3)
    pairs.append(
        {
            **dev,
            "id": "kuake_qtr:train:planted",
            "split": "train",
            "text1_id": text("kuake_qtr", "query", "train", texts[dev["text1_id"]]["text"]),
            "text2_id": text("kuake_qtr", "title", "train", texts[dev["text2_id"]]["text"]),
        }
    )
    # A KUAKE-QQR dev query planted as the paraphrase (the positive) of a training query: a text leak.
    train = next(p for p in pairs if p["source"] == "kuake_qqr" and p["split"] == "train" and p["label"] == 2)
    dev = next(p for p in pairs if p["source"] == "kuake_qqr" and p["split"] == "dev")
    pairs.append(
        {
            **train,
            "id": "kuake_qqr:train:planted",
            "text2_id": text("kuake_qqr", "query", "train", texts[dev["text1_id"]]["text"]),
        }
    )
    for name, rows in (("texts", texts.values()), ("pairs", pairs), ("candidates", lists)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return out


def compose(import_dir: Path, out: Path, *extra: str):
    """The real build config, its rules and evaluation sets restricted to the sources written above,
    with no max_examples caps (so every clean example must come out)."""
    cfg = load_config("data_pipeline", [f"out_root={out}", f"build.input_dir={import_dir}", *extra])
    with open_dict(cfg):
        cfg.build.rules = [{**r, "max_examples": None} for r in cfg.build.rules if r.source in SOURCES]
        cfg.build.eval_sets = [e for e in cfg.build.eval_sets if e.source in SOURCES]
    return cfg


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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


def test_rerun_skipped_and_caps(import_dir, tmp_path):
    cfg = compose(import_dir, tmp_path)
    first = build.run(cfg)
    again = build.run(cfg)
    assert again["skipped"] and again["fingerprint"] == first["fingerprint"]
    capped = compose(import_dir, tmp_path)
    capped.build.rules[1].max_examples = 5  # kuake_qtr (rules keep the config's order)
    name = capped.build.rules[1].name
    stats = build.run(capped)
    assert "skipped" not in stats and stats["rules"][name]["kept"] == 5
    assert sum(e["rule"] == name for e in rows(tmp_path / "build" / "examples.jsonl")) == 5


def test_bad_inputs(import_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("texts.jsonl", "pairs.jsonl", "candidates.jsonl"):
        (bad / name).write_bytes((import_dir / name).read_bytes())
    pairs = (bad / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    row = json.loads(pairs[2])
    row["text2_id"] = "kuake_qqr:query:train:nope"
    (bad / "pairs.jsonl").write_text(
        "\n".join(pairs[:2] + [json.dumps(row)] + pairs[3:]) + "\n", encoding="utf-8"
    )
    with pytest.raises(DataError, match=r"pairs.jsonl, line 3, field 'text2_id': unknown text id"):
        build.run(compose(bad, tmp_path, f"build.input_dir={bad}"))
    (bad / "pairs.jsonl").write_text("\n".join(pairs) + "\n", encoding="utf-8")
    store = (bad / "texts.jsonl").read_text(encoding="utf-8").splitlines()
    (bad / "texts.jsonl").write_text("\n".join(store + store[:1]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"texts.jsonl, line {len(store) + 1}, field 'id': duplicate id"):
        build.run(compose(bad, tmp_path, f"build.input_dir={bad}"))
    (bad / "texts.jsonl").write_text("\n".join(store) + "\n", encoding="utf-8")
    cfg = compose(bad, tmp_path, f"build.input_dir={bad}")
    for rule in cfg.build.rules:
        rule.min_label = 99
    with pytest.raises(ValueError, match="no training examples"):
        build.run(cfg)
    cfg = compose(bad, tmp_path, f"build.input_dir={bad}")
    cfg.build.eval_sets[0].split = "train2"
    with pytest.raises(ValueError, match="has no queries"):
        build.run(cfg)
    assert not (tmp_path / "build").exists()  # a refused run writes nothing


@pytest.fixture
def flag_files(import_dir, tmp_path) -> tuple[list[dict], Path, Path]:
    """Id-based training rows over the build stage's texts (negatives: other examples' positives), and
    their FlagEmbedding export."""
    build.run(compose(import_dir, tmp_path))
    out = tmp_path / "build"
    examples = rows(out / "examples.jsonl")[:50]
    pool = [p for e in examples for p in e["pos_ids"]]
    train = []
    for i, e in enumerate(examples):
        negs = [p for p in pool[i : i + 12] if p not in e["pos_ids"]][:9]
        train.append(
            {
                "query_id": e["query_id"],
                "pos_ids": e["pos_ids"],
                "neg_ids": negs,
                "neg_scores": [round(0.5 + k / 100, 3) for k in range(len(negs))],
            }
        )
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train), encoding="utf-8")
    n = build.export_flag(tmp_path / "train.jsonl", out / "texts.jsonl", tmp_path / "flag.jsonl")
    assert n == len(train)
    return train, out / "texts.jsonl", tmp_path / "flag.jsonl"


def test_flag_export_round_trip(flag_files, tmp_path):
    """Id-based examples -> FlagEmbedding JSON Lines -> back to ids."""
    train, texts_path, flag_path = flag_files
    flag = rows(flag_path)
    assert len(flag) == len(train) and all(set(f) == {"query", "pos", "neg", "neg_scores"} for f in flag)
    ids_of = defaultdict(set)
    for r in rows(texts_path):
        ids_of[r["text"]].add(r["id"])
    for t, f in zip(train, flag):
        assert t["query_id"] in ids_of[f["query"]] and f["neg_scores"] == t["neg_scores"]
        for side in ("pos", "neg"):
            assert len(f[side]) == len(t[f"{side}_ids"])
            assert all(i in ids_of[x] for i, x in zip(t[f"{side}_ids"], f[side]))
    broken = train[:1] + [{**train[1], "neg_ids": ["nope"]}]
    (tmp_path / "broken.jsonl").write_text("".join(json.dumps(t) + "\n" for t in broken), encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.jsonl, line 2, field 'neg_ids': unknown text id 'nope'"):
        build.export_flag(tmp_path / "broken.jsonl", texts_path, tmp_path / "flag2.jsonl")
    assert not (tmp_path / "flag2.jsonl").exists()


@pytest.mark.slow  # importing FlagEmbedding takes ~15 s here
def test_flagembedding_reads_the_export(flag_files, tmp_path):
    """FlagEmbedding's own training dataset loads the file and samples 1 positive + negatives from it."""
    from FlagEmbedding.abc.finetune.embedder.AbsArguments import AbsEmbedderDataArguments
    from FlagEmbedding.abc.finetune.embedder.AbsDataset import AbsEmbedderTrainDataset

    _, _, flag_path = flag_files
    flag = rows(flag_path)
    args = AbsEmbedderDataArguments(
        train_data=[str(flag_path)], cache_path=str(tmp_path / "hf"), train_group_size=4
    )
    dataset = AbsEmbedderTrainDataset(args, tokenizer=None)
    assert len(dataset) == len(flag)
    for i in (0, 3, len(flag) - 1):
        query, passages, _ = dataset[i]
        assert query == flag[i]["query"] and passages[0] in flag[i]["pos"]
        assert len(passages) == 4 and set(passages[1:]) <= set(flag[i]["neg"])


def test_config_names_what_the_import_stage_reads():
    """Every rule and evaluation set of conf/pipeline/build.yaml names a source and split of conf/data."""
    cfg = load_config("data_pipeline")
    for spec in [*cfg.build.rules, *cfg.build.eval_sets]:
        assert spec.source in cfg.data.sources, spec.name
        source = cfg.data.sources[spec.source]
        assert spec.split in (source.files if "files" in source else source.splits), spec.name
