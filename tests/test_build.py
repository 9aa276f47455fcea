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


def training_rows(import_dir, tmp_path, teacher: bool) -> tuple[list[dict], Path]:
    """Id-based training rows over the build stage's texts (negatives: other examples' positives) as the
    mine stage writes them (the miner's pos_scores / neg_scores), with the teacher-scoring stage's
    teacher_pos_scores / teacher_neg_scores when `teacher`; and the text store."""
    out = tmp_path / "build"
    if not (out / "examples.jsonl").exists():
        build.run(compose(import_dir, tmp_path))
    examples = rows(out / "examples.jsonl")[:50]
    pool = [p for e in examples for p in e["pos_ids"]]
    train = []
    for i, e in enumerate(examples):
        negs = [p for p in pool[i : i + 12] if p not in e["pos_ids"]][:9]
        row = {"query_id": e["query_id"], "pos_ids": e["pos_ids"], "pos_scores": [0.9] * len(e["pos_ids"]),
               "neg_ids": negs, "neg_scores": [round(0.5 + k / 100, 3) for k in range(len(negs))]}
        if teacher:  # distinct per position, unlike the miner's, so a mix-up shows
            row["teacher_pos_scores"] = [round(9.0 + i / 100 + k / 1000, 4) for k in range(len(e["pos_ids"]))]
            row["teacher_neg_scores"] = [round(-1.0 - i / 100 - k / 1000, 4) for k in range(len(negs))]
        train.append(row)
    return train, out / "texts.jsonl"


def write_train(path: Path, train: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in train), encoding="utf-8")
    return path


@pytest.fixture(params=[False, True], ids=["miner", "teacher"])
def flag_files(import_dir, tmp_path, request) -> tuple[list[dict], Path, Path]:
    """Training rows (without and with teacher scores) and their FlagEmbedding export."""
    train, texts_path = training_rows(import_dir, tmp_path, request.param)
    n = build.export_flag(write_train(tmp_path / "train.jsonl", train), texts_path, tmp_path / "flag.jsonl")
    assert n == len(train)
    return train, texts_path, tmp_path / "flag.jsonl"


def test_flag_export_round_trip(flag_files, tmp_path):
    """Id-based examples -> FlagEmbedding JSON Lines -> back to ids.  FlagEmbedding's pos_scores /
    neg_scores (teacher scores to it) come from the teacher fields only, never from the miner's."""
    train, texts_path, flag_path = flag_files
    flag = rows(flag_path)
    teacher = "teacher_neg_scores" in train[0]
    keys = {"query", "pos", "neg"} | ({"pos_scores", "neg_scores"} if teacher else set())
    assert len(flag) == len(train) and all(set(f) == keys for f in flag)
    ids_of = defaultdict(set)
    for r in rows(texts_path):
        ids_of[r["text"]].add(r["id"])
    for t, f in zip(train, flag):
        assert t["query_id"] in ids_of[f["query"]]
        if teacher:
            assert f["pos_scores"] == t["teacher_pos_scores"] and f["neg_scores"] == t["teacher_neg_scores"]
        for side in ("pos", "neg"):
            assert len(f[side]) == len(t[f"{side}_ids"])
            assert all(i in ids_of[x] for i, x in zip(t[f"{side}_ids"], f[side]))
    broken = train[:1] + [{**train[1], "neg_ids": ["nope"]}]
    (tmp_path / "broken.jsonl").write_text("".join(json.dumps(t) + "\n" for t in broken), encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.jsonl, line 2, field 'neg_ids': unknown text id 'nope'"):
        build.export_flag(tmp_path / "broken.jsonl", texts_path, tmp_path / "flag2.jsonl")
    assert not (tmp_path / "flag2.jsonl").exists()


def test_flag_export_teacher_fields_checked(import_dir, tmp_path):
    """Teacher scores: one per id, numbers, on every line or on none; else a DataError naming file, line
    and field, and no export."""
    train, texts_path = training_rows(import_dir, tmp_path, teacher=True)
    plain = [{k: v for k, v in t.items() if not k.startswith("teacher_")} for t in train]
    n_pos = len(train[0]["pos_ids"])
    cases = {
        "short": (train[:2] + [{**train[2], "teacher_neg_scores": train[2]["teacher_neg_scores"][:-1]}],
                  r"short.jsonl, line 3, field 'teacher_neg_scores': 8 teacher scores for 9 neg_ids"),
        "pos": ([{**train[0], "teacher_pos_scores": [1.0, 2.0, 3.0]}],
                rf"pos.jsonl, line 1, field 'teacher_pos_scores': 3 teacher scores for {n_pos} pos_ids"),
        "text": (train[:1] + [{**train[1], "teacher_pos_scores": ["high"] * len(train[1]["pos_ids"])}],
                 r"text.jsonl, line 2, field 'teacher_pos_scores': teacher scores must be finite"),
        "later_missing": (train[:3] + plain[3:5],
                          r"later_missing.jsonl, line 4, field 'teacher_pos_scores': missing: the first"),
        "half": (train[:1] + [{k: v for k, v in train[1].items() if k != "teacher_neg_scores"}],
                 r"half.jsonl, line 2, field 'teacher_neg_scores': missing"),
        "later_present": (plain[:2] + train[2:3],
                          r"later_present.jsonl, line 3, field 'teacher_pos_scores': teacher scores on some"),
    }
    for name, (lines, message) in cases.items():
        path = write_train(tmp_path / f"{name}.jsonl", lines)
        with pytest.raises(DataError, match=message):
            build.export_flag(path, texts_path, tmp_path / f"{name}.flag.jsonl")
        assert not (tmp_path / f"{name}.flag.jsonl").exists(), name


@pytest.mark.slow  # importing FlagEmbedding takes ~15 s here
def test_flagembedding_reads_the_export(flag_files, tiny_bert_dir, tmp_path):
    """FlagEmbedding's own training dataset loads the file and samples 1 positive + negatives from it;
    with teacher fields, under knowledge_distillation=True, the teacher scores it hands the trainer (per
    item, and batched by its collator) are the exported ones of the passages drawn.  Without teacher
    fields distillation refuses the file: the miner's similarities are not teacher scores."""
    from FlagEmbedding.abc.finetune.embedder.AbsArguments import AbsEmbedderDataArguments
    from FlagEmbedding.abc.finetune.embedder.AbsDataset import AbsEmbedderCollator, AbsEmbedderTrainDataset
    from transformers import AutoTokenizer

    train, _, flag_path = flag_files
    teacher = "teacher_neg_scores" in train[0]
    flag = rows(flag_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)

    def dataset(distil: bool):
        args = AbsEmbedderDataArguments(train_data=[str(flag_path)], train_group_size=4,
                                        cache_path=str(tmp_path / f"hf-{distil}"),
                                        knowledge_distillation=distil)
        return AbsEmbedderTrainDataset(args, tokenizer=tokenizer)

    if not teacher:
        with pytest.raises(ValueError, match="`pos_scores` and `neg_scores` not found"):
            dataset(True)
    data = dataset(teacher)
    assert len(data) == len(flag)
    picked = (0, 3, len(flag) - 1)
    items = [data[i] for i in picked]
    for i, (query, passages, scores) in zip(picked, items):
        assert query == flag[i]["query"] and passages[0] in flag[i]["pos"]
        assert len(passages) == 4 and set(passages[1:]) <= set(flag[i]["neg"])
        if not teacher:
            assert scores is None
            continue
        score_of = {**dict(zip(flag[i]["neg"], train[i]["teacher_neg_scores"])),
                    **dict(zip(flag[i]["pos"], train[i]["teacher_pos_scores"]))}
        assert scores == [score_of[p] for p in passages]
    collator = AbsEmbedderCollator(tokenizer=tokenizer, query_max_len=16, passage_max_len=32,
                                   padding="max_length")
    batch = collator(items)
    assert batch["teacher_scores"] == ([s for _, _, item in items for s in item] if teacher else None)


def test_config_names_what_the_import_stage_reads():
    """Every rule and evaluation set of conf/build/default.yaml names a source and split of conf/data."""
    cfg = load_config("data_pipeline")
    for spec in [*cfg.build.rules, *cfg.build.eval_sets]:
        assert spec.source in cfg.data.sources, spec.name
        source = cfg.data.sources[spec.source]
        assert spec.split in (source.files if "files" in source else source.splits), spec.name
