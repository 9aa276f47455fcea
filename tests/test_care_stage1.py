"""CARE's stage I: the document tower frozen, encoded once into the cache, and queries encoded afresh."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _care_helpers import root, tiny, tower_calls, train_overrides  # noqa: F401  (root, tiny: fixtures)

from care.config import load_config
from care.data.io import read_jsonl
from care.encoders.cache import EmbeddingCache
from care.retrieval.scorer import EncoderScorer
from care.training.care_family import CAREFamily
from care.training.care_recipe import stage_config
from care.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 4. stage I ---------------------------------------------------------------------------------------

def stage1_trainer(root: Path, tiny: Path, run: Path) -> Trainer:
    cfg = load_config("train", train_overrides(root, None, f"model.query.path={tiny / 'query'}",
                                               f"model.document.path={tiny / 'document'}", "++trainer.dtype=float64"))
    return Trainer(stage_config(cfg, "stage1", run))


def test_stage1_freezes_the_document_tower_and_never_runs_it_in_the_loop(root, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache"))  # an empty embedding cache
    calls = tower_calls(monkeypatch)
    trainer = stage1_trainer(root, tiny, tmp_path / "run")
    family = trainer.family
    n_texts = len(family.row)
    # before step 1: every training text encoded once by the document tower, into the embedding cache
    assert calls["document"] == math.ceil(n_texts / 64) and (family.cache.misses, family.cache.hits) == (n_texts, 0)
    document, query = family.document_tower, family.query_module
    assert query.model.dtype == torch.float64 and family.document_module.table.dtype == torch.float32
    in_loop = []
    document.model.register_forward_hook(lambda *a: in_loop.append(1))
    start = {k: v.clone() for k, v in document.model.state_dict().items()}
    query_start = {k: v.clone() for k, v in query.state_dict().items()}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(p.requires_grad for p in document.parameters())
    assert not any(id(p) in optimized for p in document.parameters())
    assert {id(p) for p in query.parameters()} <= optimized
    calls.update(query=0, document=0)

    summary = trainer.fit()
    assert summary["step"] == 4 and in_loop == [] and calls["document"] == 0 and calls["query"] > 0
    assert all(torch.equal(v, start[k]) for k, v in document.model.state_dict().items())  # bit-identical
    assert any(not torch.equal(v, query_start[k]) for k, v in query.state_dict().items())  # the query tower learned
    losses = [r for r in read_jsonl(tmp_path / "run" / "stage1" / "metrics.jsonl") if "loss/loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4] and all(r["loss/mse"] > 0 for r in losses)
    # the control: the hook does see the document tower when it runs
    family.encoder(trainer.unwrapped(), None).encode_documents(["头痛"])
    assert in_loop == [1]

    # A second stage I over the same texts takes every document vector from the cache: no forward at all.
    calls.update(query=0, document=0)
    again = stage1_trainer(root, tiny, tmp_path / "again").family
    assert calls["document"] == 0 and (again.cache.misses, again.cache.hits) == (0, n_texts)
    assert torch.equal(again.document_module.table, family.document_module.table)


def test_stage1_validation_encodes_queries_afresh(root, tiny, tmp_path, monkeypatch):
    """The query tower trains under the fingerprint of its start folder: a cached query vector would be stale
    at the next validation.  Validation's scorer takes only the frozen document side from stage I's cache
    (care.training.validation.Validator: cached_sides=("document",))."""
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache"))
    cfg = load_config("train", train_overrides(root, tmp_path / "run", f"model.query.path={tiny / 'query'}",
                                               f"model.document.path={tiny / 'document'}"))
    family = CAREFamily(stage_config(cfg, "stage1", tmp_path / "run"))
    encoder = family.encoder([family.query_module, family.document_module], None)
    texts = ["癫痫病人可以怀孕吗", "头痛发烧怎么办"]

    def both(cache, sides=("document",)):
        scorer = EncoderScorer(encoder, cache, cached_sides=sides, show_progress=False)
        return scorer.embed(texts, "query").dense, scorer.embed(texts, "document").dense

    plain = EmbeddingCache(tmp_path / "plain")
    q0, d0 = both(family.cache)
    p0, _ = both(plain, ("query", "document"))
    with torch.no_grad():  # a training step's worth of change
        for p in family.query_module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hits = family.cache.hits
    q1, d1 = both(family.cache)
    assert np.abs(q1 - q0).max() > 1e-4 and np.array_equal(d1, d0) and family.cache.hits == hits + len(texts)
    p1, _ = both(plain, ("query", "document"))
    assert np.array_equal(p1, p0)  # the control: an ordinary cache serves the stale query vectors


def test_stage1_extra_texts_join_the_training_texts_and_a_missing_one_is_named(root, tmp_path):
    """Stage I's same-text pairs: every training text plus a seeded sample of `extra_texts`; a missing extra
    store says which command writes it."""
    extra = tmp_path / "unlabelled.jsonl"
    extra.write_text("".join(f'{{"id": "u{i}", "text": "未标注的医学文本{i}"}}\n' for i in range(10)), encoding="utf-8")
    cfg = load_config("train", train_overrides(root, tmp_path / "run", f"model.stages.stage1.extra_texts=[{extra}]",
                                               "model.stages.stage1.extra_texts_max=4"))
    c = stage_config(cfg, "stage1", tmp_path / "run")
    texts = [r["text"] for r in read_jsonl(c.data.texts)]
    training = [r["text"] for r in read_jsonl(root / "texts.jsonl")]
    assert texts[:len(training)] == list(dict.fromkeys(training)) and len(texts) == len(set(training)) + 4
    assert all(t.startswith("未标注") for t in texts[len(training):])
    examples = list(read_jsonl(c.data.examples))
    assert all(e["pos_ids"] == [e["query_id"]] for e in examples) and len(examples) == len(texts)
    missing = load_config("train", train_overrides(root, tmp_path / "run2",
                                                   f"model.stages.stage1.extra_texts=[{tmp_path / 'none.jsonl'}]"))
    with pytest.raises(FileNotFoundError, match="extra_texts names .*none.jsonl.*build stage"):
        stage_config(missing, "stage1", tmp_path / "run2")
