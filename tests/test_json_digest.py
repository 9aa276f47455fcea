"""One JSON-digest helper (care/data/io.py json_digest) and every stored key it makes unchanged: each site that
hashed `json.dumps(...)` by hand (run config hashes, recipe groups, encoder and pair-scorer fingerprints, BM25's
fingerprint, the ONNX export key, the mteb data revision) computes on fixed inputs the same characters as its old
expression, written out here literally, with its own options (sort_keys, ensure_ascii, default) and length
(12, 16, 24).  The pinned values were printed by the code before the helper existed: a stored cache entry,
stage output or run folder keyed by one of them stays valid.  BM25's fingerprint keeps its own expression:
care/retrieval/bm25.py is part of the Nano stage's code fingerprint (data_pipeline/nano/stage.py CODE), so any
edit of it rebuilds every stored Nano folder; its test holds it to the same expression all the same."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from care.data.io import json_digest

# Awkward on purpose: unsorted keys, non-ASCII text, a value json cannot encode (a Path: only default=str can).
CONFIG = {"model": {"name": "tiny", "path": "/m/tiny", "kind": "dense", "query_prompt": "查询: "},
          "loss": {"temperature": 0.02, "types": ["dense"]}, "seed": 3, "out": Path("/x/输出"), "z": 1, "a": [1, 2]}
IDENTITY = {"name": "模型", "b": 1, "a": [1.5, None]}


@pytest.mark.parametrize(("options", "chars"), [({}, 16), ({"sort_keys": True}, 24),
                                                 ({"sort_keys": True, "ensure_ascii": False}, 16),
                                                 ({"sort_keys": True, "default": str}, 12)])
def test_the_helper_is_json_dumps_then_sha256(options, chars):
    value = CONFIG if "default" in options else IDENTITY
    want = hashlib.sha256(json.dumps(value, **options).encode()).hexdigest()[:chars]
    assert json_digest(value, chars, **options) == want


def test_each_option_changes_the_key():
    """The options are not decoration: each one alone gives another key (so a site must keep its own)."""
    keys = {json_digest(IDENTITY, 16), json_digest(IDENTITY, 16, sort_keys=True),
            json_digest(IDENTITY, 16, ensure_ascii=False)}
    assert len(keys) == 3


def test_recipe_group_keeps_its_key():
    from care.config import recipe, recipe_group

    for ignore, pinned in ((("seed",), "d9f7fa999656"), ((), "71949e9a4fa5")):
        old = hashlib.sha256(json.dumps(recipe(CONFIG, ignore), sort_keys=True, default=str).encode()).hexdigest()[:12]
        assert recipe_group(CONFIG, ignore) == old == pinned


def test_run_config_hash_keeps_its_key(monkeypatch):
    from care.config import recipe
    from care.training import checkpoint

    monkeypatch.setattr(checkpoint, "file_digest", lambda p: f"digest-of-{Path(p).name}")
    monkeypatch.setattr(checkpoint, "weights_digest", lambda p: f"weights-of-{Path(p).name}")
    cfg = OmegaConf.create({"model": {"name": "tiny", "path": "/m/tiny", "kind": "dense"}, "seed": 3,
                            "data": {"texts": "/d/texts.jsonl", "examples": "/d/examples.jsonl"},
                            "loss": {"temperature": 0.02}})
    c = recipe(OmegaConf.to_container(cfg, resolve=True), ignore=())
    c["data_digest"] = ["digest-of-texts.jsonl", "digest-of-examples.jsonl"]
    c["start_weights"] = "weights-of-tiny"
    old = hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:16]
    assert checkpoint.config_hash(cfg) == old == "f264585dd836879c"


def test_encoder_fingerprint_digest_keeps_its_key():
    from care.encoders import base

    old = hashlib.sha256(json.dumps(IDENTITY, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]
    assert base._digest(IDENTITY) == old == "9e7c7ada810cb93f"


def test_pair_scorer_fingerprint_keeps_its_key(monkeypatch):
    from care.encoders import cross_encoder

    monkeypatch.setattr(cross_encoder, "weights_digest", lambda folder: "0123456789abcdef")
    identity = {"kind": "cross-encoder", "weights": "0123456789abcdef", "max_length": 256,
                "truncation": "longest_first", "score": "logit"}
    old = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    assert cross_encoder.pair_fingerprint("/f", 256) == old == "7f93b51eecd423f5"


def test_mteb_data_revision_keeps_its_key():
    from care.data.tasks import TaskData
    from care.evaluation.mteb_adapter.tasks import data_revision

    data = TaskData("retrieval", "p", queries={"q2": "发烧", "q1": "头痛"}, docs={"d1": "休息"},
                    qrels={"q1": {"d1": 1}})
    payload = [data.type, data.queries, data.docs, data.qrels, data.pairs, data.gold, data.candidates,
               data.safeguards]
    old = hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]
    assert data_revision(data) == old == "aa238ba82d5f6c29"


@pytest.mark.parametrize("method", ["lucene", "robertson"])
def test_bm25_fingerprint_keeps_its_key(method):
    """Keys in insertion order (no sort_keys), as first stored; method and tokenizer only when not the defaults."""
    import bm25s
    import jieba

    from care.retrieval.bm25 import BM25Scorer

    scorer = BM25Scorer(k1=1.2, b=0.75, method=method)
    settings = {"bm25s": bm25s.__version__, "jieba": jieba.__version__, "k1": 1.2, "b": 0.75}
    if method != "lucene":
        settings |= {"method": method, "tokenizer": scorer.tokenizer}
    assert scorer.fingerprint == hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


def test_onnx_export_key_keeps_its_key():
    import transformers

    from care.encoders.onnx_backend import EXPORT_SETTINGS, export_key

    model = torch.nn.Linear(2, 2)
    key = {**EXPORT_SETTINGS, "weights": "w", "class": "Linear", "inputs": ["input_ids"], "int8": False,
           "torch": torch.__version__, "transformers": transformers.__version__}
    old = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    assert export_key("w", model, ["input_ids"], False) == old


def test_a_moved_command_in_a_build_hint_keeps_the_run_hash():
    """tiny_m3's build hint names `python -m care.tools.build_m3` since its command line moved out of
    care.models.m3; the hint is in the config a run's hash covers, so recipe() hashes it as it read before
    (care.config.MOVED_COMMANDS) and a run folder recorded then keeps its hash and its group."""
    from care.config import load_config, recipe, recipe_group

    now = OmegaConf.to_container(load_config("train", ["model=tiny_m3"]), resolve=True)
    assert "python -m care.tools.build_m3 tiny " in now["model"]["build_hint"]
    before = {**now, "model": {**now["model"], "build_hint": now["model"]["build_hint"].replace(
        "python -m care.tools.build_m3 tiny ", "python -m care.models.m3 tiny ")}}
    assert recipe_group(now, ignore=()) == recipe_group(before, ignore=())
    assert recipe(now)["model"]["build_hint"] == before["model"]["build_hint"]
