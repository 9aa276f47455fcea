"""The training data: id-referenced files, pool prefixes, seeded epoch sampling, short-negative fallbacks."""
from __future__ import annotations

import json

import pytest
from _training_helpers import make_training_files, train_config
from torch.utils.data import DataLoader

from care.data.io import DataError, read_jsonl, write_jsonl
from care.training.data import TrainingGroups, collate_groups
from care.training.samplers import EpochSampler
from care.training.trainer import Trainer


@pytest.fixture()
def train_files(tmp_path, shared):
    return make_training_files(tmp_path, shared)


# ---------------------------------------------------------------- data

def test_unknown_id_names_file_line_and_field(train_files):
    texts, train = train_files
    lines = train.read_text(encoding="utf-8").splitlines()
    bad = json.loads(lines[2])
    bad["neg_ids"][1] = "no-such-id"
    # a blank line before the bad row: the reported line must be the file's line, not the row count
    train.write_text("\n".join(lines[:2] + ["", json.dumps(bad)] + lines[3:]) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        TrainingGroups(texts, train, group_size=4)
    assert err.value.path == str(train) and err.value.line == 4 and err.value.field == "neg_ids"
    assert "no-such-id" in str(err.value) and str(train) in str(err.value)

    bad = json.loads(lines[0])
    bad["query_id"] = "q-missing"
    train.write_text("\n".join([json.dumps(bad)] + lines[1:]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"line 1, field 'query_id'.*q-missing"):
        TrainingGroups(texts, train)


def test_passages_of_query_side_pools_get_the_query_prefix(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    rows = list(read_jsonl(train))
    write_jsonl(train, [{**r, "pool": "questions" if i % 2 else "answers"} for i, r in enumerate(rows)])
    cfg = train_config(tmp_path, texts, train, "run", "model.prompts.query='Q: '", "model.prompts.document='D: '",
                       "trainer.query_side_pools=[questions]")
    trainer = Trainer(cfg)
    seen = []
    tokenizer = trainer.family.tokenizer
    trainer.family.tokenizer = lambda texts, **kw: seen.append(list(texts)) or tokenizer(texts, **kw)
    batch = next(iter(trainer.loader))
    trainer.train_step(batch)
    queries, passages = seen
    assert all(q.startswith("Q: ") for q in queries)
    assert len(passages) == len(batch["passage_pools"]) == len(batch["passages"])
    for text, pool, raw in zip(passages, batch["passage_pools"], batch["passages"]):
        assert text == ("Q: " if pool == "questions" else "D: ") + raw
    assert {"questions", "answers"} <= set(batch["passage_pools"])

    write_jsonl(train, rows)  # a file without pools (e.g. from an older mine stage): said, with what to do
    with pytest.warns(UserWarning, match="names no pool.*stage=mine force=true"):
        Trainer(train_config(tmp_path, texts, train, "run2", "trainer.query_side_pools=[questions]"))


def _groups(loader) -> dict[str, list[str]]:
    """query text -> its group of passage texts, over one pass of a loader."""
    out = {}
    for batch in loader:
        g = len(batch["passages"]) // len(batch["queries"])
        for i, q in enumerate(batch["queries"]):
            out[q] = batch["passages"][i * g:(i + 1) * g]
    return out


def test_sampling_depends_only_on_seed_epoch_and_index(train_files):
    from accelerate.data_loader import prepare_data_loader

    texts, train = train_files
    data = TrainingGroups(texts, train, group_size=4, seed=7)

    def loader(epoch, workers=0):
        sampler = EpochSampler(len(data), seed=7)
        sampler.set_epoch(epoch)
        return DataLoader(data, batch_size=8, sampler=sampler, collate_fn=collate_groups, drop_last=True,
                          num_workers=workers)

    one = _groups(loader(1))
    assert _groups(loader(1, workers=2)) == one
    # two processes, each its shard of the same global order (accelerate's own sharding; its loader
    # re-sets the sampler's epoch from its own counter on every pass, so the trainer sets it there too)
    shards = []
    for p in range(2):
        shard = prepare_data_loader(loader(1), num_processes=2, process_index=p, put_on_device=False)
        shard.set_epoch(1)
        shards.append(_groups(shard))
    assert {**shards[0], **shards[1]} == one and not set(shards[0]) & set(shards[1])
    # an independent check of the contract: each group = 1 positive + 3 distinct negatives of its example
    by_query = {data.texts[e["query_id"]]: e for e in data.examples}
    for q, group in one.items():
        ex = by_query[q]
        assert group[0] in {data.texts[p] for p in ex["pos_ids"]}
        negs = {data.texts[n] for n in ex["neg_ids"]}
        assert len(set(group[1:])) == 3 and set(group[1:]) <= negs
    # another epoch: another order and other negatives
    other = _groups(loader(2))
    assert other != one


def test_fallbacks_when_negatives_are_short(train_files, tmp_path):
    texts, train = train_files
    rows = [json.loads(x) for x in train.read_text(encoding="utf-8").splitlines()]
    rows[0]["neg_ids"], rows[0]["neg_scores"] = rows[0]["neg_ids"][:2], rows[0]["neg_scores"][:2]
    rows[1]["neg_ids"], rows[1]["neg_scores"] = [], []
    write_jsonl(train, rows)
    data = TrainingGroups(texts, train, group_size=6)
    assert data.stats["short_of_negatives"] == 1 and data.stats["without_negatives"] == 1
    _, g0 = data.group_ids(0, 0)
    assert len(g0) == 6 and set(g0[1:]) == set(rows[0]["neg_ids"])  # own 2 negatives, repeated
    _, g1 = data.group_ids(0, 1)
    assert len(g1) == 6 and not set(g1[1:]) & set(rows[1]["pos_ids"]) and all(x in data.texts for x in g1)
    # group size 1: in-batch negatives only, never a hard negative
    plain = TrainingGroups(texts, train, group_size=1)
    assert all(len(plain.group_ids(0, i)[1]) == 1 for i in range(len(plain)))
