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
import unicodedata
from collections import defaultdict
from pathlib import Path

import pytest
from omegaconf import open_dict

from care.config import load_config
from data_pipeline import build
from data_pipeline.io import DataError

SOURCES = ("cmedqa2_pairs", "kuake_qqr", "kuake_qtr")
NEAR = "请问医生"  # prepended to a test question to plant a near duplicate in the dev training split


def norm(text: str) -> str:
    """The leakage normalisation (NFKC, lowercase, no punctuation, collapsed whitespace), redone here."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join("".join(c for c in text if not unicodedata.category(c).startswith("P")).split())


@functools.cache
def grams(text: str) -> frozenset[str]:
    return frozenset({text[i:i + 3] for i in range(len(text) - 2)} if len(text) > 3 else {text})


def jaccard(a: str, b: str) -> float:
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def tid(source: str, role: str, split: str, text: str) -> str:
    return f"{source}:{role}:{split}:{hashlib.md5(text.encode()).hexdigest()[:12]}"


@pytest.fixture(scope="module")
def import_dir(tmp_path_factory, shared) -> Path:
    """cMedQA2 pairs dev + test (trusted questions, 1-2 positives, as the import stage keeps them) with one
    planted near duplicate; KUAKE-QQR train (label 2) + dev; KUAKE-QTR train (label 3) + dev: real rows."""
    out = tmp_path_factory.mktemp("import")
    texts, pairs, lists = {}, [], []

    def text(source, role, split, value):
        key = tid(source, role, split, value)
        texts[key] = {"id": key, "text": value, "source": source, "role": role}
        return key

    groups = {}
    for split in ("dev", "test"):
        rows = csv.reader(open(shared / "chineseblue_cmedqa2_pairs" / f"{split}.txt", encoding="utf-8"), delimiter="\t")
        grouped = defaultdict(list)
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
            lists.append({"id": f"cmedqa2_pairs:{split}:{qid}", "source": "cmedqa2_pairs", "split": split,
                          "query_id": qid, "candidates": [{"id": text("cmedqa2_pairs", "answer", split, a), "label": lab}
                                                          for a, lab in cands]})
    for source, folder, (f1, f2), roles, n in (
            ("kuake_qqr", "cblue_kuake_qqr/KUAKE-QQR", ("query1", "query2"), ("query", "query"), {"train": 2000, "dev": 300}),
            ("kuake_qtr", "cblue_kuake_qtr/KUAKE-QTR", ("query", "title"), ("query", "title"), {"train": 2000, "dev": 300})):
        for split, limit in n.items():
            for row in json.load(open(shared / f"{folder}_{split}.json", encoding="utf-8"))[:limit]:
                if source == "kuake_qqr" and split == "dev" and row["id"] == "s9":
                    continue
                pairs.append({"id": f"{source}:{split}:{row['id']}", "source": source, "split": split,
                              "text1_id": text(source, roles[0], split, row[f1]),
                              "text2_id": text(source, roles[1], split, row[f2]), "label": int(row["label"])})
    for name, rows in (("texts", texts.values()), ("pairs", pairs), ("candidates", lists)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return out


@functools.cache
def wiring() -> list[str]:
    """`+pipeline@build=build` until conf/data_pipeline.yaml composes the build group itself."""
    return [] if "build" in load_config("data_pipeline") else ["+pipeline@build=build"]


def compose(import_dir: Path, out: Path, *extra: str):
    """The real build config, its rules and evaluation sets restricted to the sources written above,
    with no max_examples caps (so every clean example must come out)."""
    cfg = load_config("data_pipeline", [*wiring(), f"out_root={out}", f"build.input_dir={import_dir}", *extra])
    with open_dict(cfg):
        cfg.build.rules = [{**r, "max_examples": None} for r in cfg.build.rules if r.source in SOURCES]
        cfg.build.eval_sets = [e for e in cfg.build.eval_sets if e.source in SOURCES]
    return cfg


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def brute_force(import_dir: Path, cfg) -> tuple[dict, dict]:
    """Eval set name -> normalised queries, and the training examples before any rule (query -> positives)."""
    texts = {r["id"]: r["text"] for r in rows(import_dir / "texts.jsonl")}
    pairs, lists = rows(import_dir / "pairs.jsonl"), rows(import_dir / "candidates.jsonl")
    queries = defaultdict(set)  # eval set name -> normalised queries
    for e in cfg.build.eval_sets:
        for p in pairs:
            if (p["source"], p["split"]) == (e.source, e.split):
                queries[e.name] |= {norm(texts[p[f"text{k + 1}_id"]]) for k, role in enumerate(e.roles) if role == "query"}
        for c in lists:
            if (c["source"], c["split"]) == (e.source, e.split):
                queries[e.name].add(norm(texts[c["query_id"]]))
    examples = defaultdict(list)
    for r in cfg.build.rules:
        for p in pairs:
            if (p["source"], p["split"]) == (r.source, r.split) and p["label"] >= r.min_label:
                examples[(r.name, p["text1_id"])].append(p["text2_id"])
        for c in lists:
            if (c["source"], c["split"]) == (r.source, r.split):
                examples[(r.name, c["query_id"])] += [d["id"] for d in c["candidates"] if d["label"] >= r.min_label]
    return ({k: frozenset(v) for k, v in queries.items()},
            {k: (texts[k[1]], [texts[p] for p in v if p != k[1]]) for k, v in examples.items()})


@functools.cache
def by_length(evals: frozenset[str]) -> dict[int, list[str]]:
    table = defaultdict(list)
    for e in evals:
        table[len(e)].append(e)
    return table


def leaks(text: str, evals: frozenset[str]) -> bool:
    """Exact after normalisation, or trigram Jaccard >= 0.8 with some evaluation query.  Only lengths
    that can reach 0.8 are compared (Jaccard <= smaller set / larger set), which changes no answer."""
    t = norm(text)
    if t in evals:
        return True
    table = by_length(evals)
    return any(jaccard(t, e) >= 0.8 for n in range(int(0.8 * len(t)) - 3, int(len(t) / 0.8) + 4)
               for e in table.get(n, ()))


def test_leakage_rule_against_brute_force(import_dir, tmp_path):
    cfg = compose(import_dir, tmp_path)
    stats = build.run(cfg)
    out = tmp_path / "build"
    report = json.loads((out / "leakage.json").read_text(encoding="utf-8"))
    evals, before = brute_force(import_dir, cfg)
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
    # Nothing clean was removed: every example whose query and positives are all clean is kept whole
    # (the rules' max_examples caps are far above these subsets).
    clean = {(name, q): pos for (name, _), (q, pos) in before.items()
             if pos and not leaks(q, every_eval) and not any(leaks(p, every_eval) for p in pos)}
    got = {(e["rule"], texts[e["query_id"]]): [texts[p] for p in e["pos_ids"]] for e in kept}
    for key, pos in clean.items():
        assert got.get(key) == list(dict.fromkeys(pos)), key
    assert stats["examples"] == len(kept) and stats["leakage_removed"] == report["removed"]


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
    entry = json.loads((out / "leakage.json").read_text(encoding="utf-8"))["eval_sets"]["cmed_v2 (cMedQA2 test)"]
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
    (bad / "pairs.jsonl").write_text("\n".join(pairs[:2] + [json.dumps(row)] + pairs[3:]) + "\n", encoding="utf-8")
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


def test_flag_export_round_trip(import_dir, tmp_path):
    """Id-based examples -> FlagEmbedding JSON Lines -> back to ids; and FlagEmbedding's own training
    dataset reads the file and samples its passages from pos and neg."""
    from FlagEmbedding.abc.finetune.embedder.AbsArguments import AbsEmbedderDataArguments
    from FlagEmbedding.abc.finetune.embedder.AbsDataset import AbsEmbedderTrainDataset

    build.run(compose(import_dir, tmp_path))
    out = tmp_path / "build"
    examples = rows(out / "examples.jsonl")[:50]
    pool = [p for e in examples for p in e["pos_ids"]]
    train = [{"query_id": e["query_id"], "pos_ids": e["pos_ids"],
              "neg_ids": [p for p in pool[i:i + 12] if p not in e["pos_ids"]][:9],
              "neg_scores": [round(0.5 + k / 100, 3) for k in range(len([p for p in pool[i:i + 12] if p not in e["pos_ids"]][:9]))]}
             for i, e in enumerate(examples)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train), encoding="utf-8")
    n = build.export_flag(tmp_path / "train.jsonl", out / "texts.jsonl", tmp_path / "flag.jsonl")
    flag = rows(tmp_path / "flag.jsonl")
    assert n == len(flag) == len(train)
    ids_of = defaultdict(set)
    for r in rows(out / "texts.jsonl"):
        ids_of[r["text"]].add(r["id"])
    for t, f in zip(train, flag):
        assert t["query_id"] in ids_of[f["query"]] and f["neg_scores"] == t["neg_scores"]
        for side in ("pos", "neg"):
            assert len(f[side]) == len(t[f"{side}_ids"])
            assert all(i in ids_of[x] for i, x in zip(t[f"{side}_ids"], f[side]))
    args = AbsEmbedderDataArguments(train_data=[str(tmp_path / "flag.jsonl")], cache_path=str(tmp_path / "hf"),
                                    train_group_size=4)
    dataset = AbsEmbedderTrainDataset(args, tokenizer=None)
    assert len(dataset) == len(flag)
    query, passages, _ = dataset[3]
    assert query == flag[3]["query"] and passages[0] in flag[3]["pos"] and set(passages[1:]) <= set(flag[3]["neg"])
    broken = train[:1] + [{**train[1], "neg_ids": ["nope"]}]
    (tmp_path / "broken.jsonl").write_text("".join(json.dumps(t) + "\n" for t in broken), encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.jsonl, line 2, field 'neg_ids': unknown text id 'nope'"):
        build.export_flag(tmp_path / "broken.jsonl", out / "texts.jsonl", tmp_path / "flag2.jsonl")
