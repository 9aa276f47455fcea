"""Identity per side, prompts in one place, and the document cache surviving a new query tower."""
from __future__ import annotations

import numpy as np
import pytest

from care.encoders.base import Embeddings, Encoder
from care.encoders.cache import EmbeddingCache, embed
from care.encoders.prompts import Prompts


class TwoTowers(Encoder):
    """A fake asymmetric encoder: each side's vector is a function of (tower version, text)."""

    name = "two_towers"

    def __init__(self, query_version: int, document_version: int, prompts: Prompts | None = None):
        self.version = {"query": query_version, "document": document_version}
        self.prompts = prompts or Prompts()
        self.seen: dict[str, list[str]] = {"query": [], "document": []}

    def identity(self, side):
        return {"tower": side, "version": self.version[side], "prompt": self.prompts.of(side)}

    @property
    def online_parameters(self):
        return 1

    def encode(self, texts, side, batch_size, heads, show_progress):
        self.seen[side] += texts
        rows = [np.random.default_rng([self.version[side], len(t), ord(t[-1])]).normal(size=4) for t in texts]
        return Embeddings(np.array(rows, dtype=np.float32).reshape(len(texts), 4))


def test_a_new_query_tower_reuses_the_document_cache(tmp_path):
    docs, queries = ["头痛怎么办", "发烧吃什么药", "高血压"], ["头痛"]
    old, new = TwoTowers(1, 7), TwoTowers(2, 7)
    assert old.side_fingerprint("document") == new.side_fingerprint("document")
    assert old.side_fingerprint("query") != new.side_fingerprint("query")
    assert old.fingerprint != new.fingerprint
    cache = EmbeddingCache(tmp_path)
    first = embed(old, docs, "document", cache)
    embed(old, queries, "query", cache)
    again = embed(new, docs, "document", cache)
    embed(new, queries, "query", cache)
    assert new.seen == {"query": queries, "document": []}  # the corpus came from the cache
    np.testing.assert_array_equal(first.dense, again.dense)


def test_prompts_are_applied_once_by_the_interface():
    enc = TwoTowers(1, 1, Prompts("query: ", "passage: "))
    enc.encode_queries(["头痛"])
    enc.encode_documents(["发烧"])
    assert enc.seen == {"query": ["query: 头痛"], "document": ["passage: 发烧"]}
    template = Prompts("<instruct>检索\\n<query>{text}", "")
    assert template.apply(["头痛"], "query") == ["<instruct>检索\\n<query>头痛"]
    with pytest.raises(ValueError, match="side"):
        template.apply(["头痛"], "doc")


def test_nan_embeddings_are_refused_at_the_interface():
    class Broken(TwoTowers):
        def encode(self, texts, side, batch_size, heads, show_progress):
            emb = super().encode(texts, side, batch_size, heads, show_progress)
            emb.dense[1, 0] = np.nan
            return emb

    with pytest.raises(FloatingPointError, match=r"1 of 2 texts, first #1: '发烧'"):
        Broken(1, 1).encode_documents(["头痛", "发烧"])


def test_the_trainer_tokenizes_with_the_encoders_prompts(tmp_path):
    """The M3 family's tokenize and the M3 encoder apply the same prompt to the same side."""
    from omegaconf import OmegaConf

    from care.encoders.m3 import M3Encoder
    from care.encoders.prompts import Prompts
    from care.models.m3 import tiny_m3
    from care.training.model import M3Family

    path = tiny_m3(dropout=0.0).save(tmp_path / "m3")
    cfg = OmegaConf.create({"seed": 0, "model": {"name": "t", "kind": "m3", "path": str(path), "pooling": "cls",
                                                  "prompts": {"query": "Q: ", "document": "D: "}},
                            "trainer": {"freeze": [], "backbone_heads": ["dense"], "gradient_checkpointing": False}})
    family = M3Family(cfg)
    encoder = M3Encoder(str(path), prompts=Prompts("Q: ", "D: "), device="cpu")
    seen = []
    original = encoder.tokenizer

    class Spy:
        def __call__(self, texts, **kw):
            seen.append(list(texts))
            return original(texts, **kw)

    encoder.tokenizer = Spy()
    encoder.encode_queries(["头痛"])
    encoder.encode_documents(["发烧"])
    batch = family.tokenize(["头痛", "发烧"], ["query", "document"], 32)
    assert seen == [["Q: 头痛"], ["D: 发烧"]]
    assert original.batch_decode(batch["input_ids"], skip_special_tokens=True) == \
        [original.decode(original(t)["input_ids"], skip_special_tokens=True) for t in ("Q: 头痛", "D: 发烧")]


def test_a_scorer_may_serve_only_the_frozen_side_from_the_cache(tmp_path):
    """Training's validation: the query tower changes while its fingerprint (its starting folder) does not,
    so only the document side may come from the cache (a stale query side froze stage I's dev metric)."""
    from care.retrieval.scorer import EncoderScorer

    enc, cache = TwoTowers(1, 1), EmbeddingCache(tmp_path)
    scorer = EncoderScorer(enc, cache, cached_sides=("document",), show_progress=False)
    for _ in range(2):
        scorer.prepare(["头痛"], ["发烧吃什么药"])
    assert enc.seen == {"query": ["头痛", "头痛"], "document": ["发烧吃什么药"]}
    for seen in ({"query": ["头痛"], "document": []}, {"query": [], "document": []}):
        both = TwoTowers(1, 1)  # by default both sides are cached (evaluation): the query once, then never
        EncoderScorer(both, cache, show_progress=False).prepare(["头痛"], ["发烧吃什么药"])
        assert both.seen == seen


def test_evaluation_caps_each_towers_token_limit():
    from care.evaluation.corpora import evaluation_model

    two = evaluation_model({"kind": "care", "query": {"max_length": 512}, "document": {"max_length": 128}}, 256)
    assert (two["query"]["max_length"], two["document"]["max_length"]) == (256, 128) and "max_length" not in two
    assert evaluation_model({"kind": "dense", "max_length": 512}, 256)["max_length"] == 256


def test_validation_takes_only_documents_from_the_cache(tmp_path):
    """care.training.validation.Validator with a cache (CARE stage I): the trained query side is encoded at
    every validation, the frozen document side once."""
    import json

    from omegaconf import OmegaConf

    from care.training.validation import Validator

    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({"query": "头痛怎么办", "positive": ["多休息"], "negative": ["发烧吃药"]},
                              ensure_ascii=False) + "\n", encoding="utf-8")
    v = OmegaConf.create({"task": str(dev), "build_from": None, "metric": "map_cut_10", "heads": ["dense"],
                          "max_queries": None, "batch_size": 8})
    validator, enc = Validator(v, EmbeddingCache(tmp_path / "cache")), TwoTowers(1, 1)
    for _ in range(2):
        validator(enc)
    assert len(enc.seen["query"]) == 2 and len(enc.seen["document"]) == 2  # the two candidates, once


def test_identity_follows_the_weights_not_the_folder(tiny_bert_dir, tmp_path):
    """A copied folder keeps its fingerprint (its cached vectors); other weights or another pooling do not."""
    import shutil

    from care.encoders import build_encoder

    cfg = {"kind": "dense", "name": "t", "pooling": "cls", "max_length": 32}
    copy = shutil.copytree(tiny_bert_dir, tmp_path / "copy")
    here, there = (build_encoder({**cfg, "path": str(p)}, device="cpu") for p in (tiny_bert_dir, copy))
    assert here.fingerprint == there.fingerprint
    assert build_encoder({**cfg, "path": str(copy), "pooling": "mean"}, device="cpu").fingerprint != here.fingerprint
    from safetensors.torch import load_file, save_file

    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1.0
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert build_encoder({**cfg, "path": str(copy)}, device="cpu").fingerprint != here.fingerprint
