"""The build stage (data_pipeline/build.py): reruns and caps, bad input, the FlagEmbedding exporter, config.

Inputs are real subsets of the shared data written in the import stage's layout (the `import_dir` fixture in
conftest.py); the leakage rule has its own tests in test_leakage.py.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from _build_helpers import compose, rows

from care.config import load_config
from care.data.io import DataError
from data_pipeline import build


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
