"""The foundation: config composition, path resolution, the dense encoder interface on a tiny model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from care.config import load_config
from care.encoders import build_encoder
from care.models.hub import resolve_model_path
from care.models.pooling import pool
from care.models.tiny import chinese_tokenizer, tiny_qwen3

TEXTS = ["高血压患者可以吃鸡蛋吗？", "糖尿病的早期症状有哪些", "小儿发烧39度怎么办"]


def test_chinese_tokenizer_has_no_unknowns():
    tok = chinese_tokenizer()
    ids = tok(TEXTS)["input_ids"]
    assert tok.unk_token_id not in {i for row in ids for i in row}
    assert tok.vocab_size == 21128


def test_compose_real_configs():
    cfg = load_config("data_pipeline", ["model=tiny_bert"])
    assert cfg.model.kind == "dense"
    assert cfg.model.path.endswith("tiny-bert")
    assert "${" not in str(cfg.data_dir) and cfg.data_dir == f"{cfg.out_root}/data"


def test_dense_encoder_matches_manual_pooling(tiny_bert_dir):
    cfg = load_config("data_pipeline", ["model=tiny_bert", "model.pooling=mean", f"model.path={tiny_bert_dir}"])
    enc = build_encoder(cfg.model)
    emb = enc.encode_documents(TEXTS, batch_size=2).dense
    # independent reference: one text at a time, mean over real tokens, normalised
    for text, row in zip(TEXTS, emb):
        batch = enc.tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            hidden = enc.model(**batch).last_hidden_state[0]
        ref = hidden.mean(0)
        ref = (ref / ref.norm()).numpy()
        np.testing.assert_allclose(row, ref, atol=1e-5)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
    assert enc.online_parameters == sum(p.numel() for p in enc.model.parameters())
    with pytest.raises(ValueError, match="sparse"):
        enc.encode_queries(TEXTS, heads=("dense", "sparse"))


def test_fingerprint_tracks_what_changes_vectors(tiny_bert_dir):
    base = load_config("data_pipeline", ["model=tiny_bert", f"model.path={tiny_bert_dir}"]).model
    a = build_encoder(base)
    b = build_encoder({**dict(base), "prompts": {"query": "query: ", "document": ""}})
    assert a.fingerprint == build_encoder(base).fingerprint
    assert a.fingerprint != b.fingerprint


def test_last_token_pooling_left_and_right_padding():
    """Last-token pooling equals the last real token of each text encoded alone, with left padding (the LLM
    document path: Qwen3-Embedding pads left) and with right padding.  RoPE scores depend on relative
    positions only, so left padding's shifted positions change nothing."""
    model, tok = tiny_qwen3()
    model.eval()
    refs = []
    for text in TEXTS:
        with torch.no_grad():
            refs.append(model(**tok([text], return_tensors="pt")).last_hidden_state[0, -1])
    for side in ("left", "right"):
        tok.padding_side = side
        batch = tok(TEXTS, padding=True, return_tensors="pt")
        mask = batch["attention_mask"]
        assert not bool(mask.all()), "the texts must differ in length, or no padding is tested"
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        pooled = pool(hidden, mask, "last_token")
        for i in range(len(TEXTS)):
            torch.testing.assert_close(pooled[i], refs[i], atol=1e-4, rtol=1e-4, msg=f"{side} padding, text {i}")
        if side == "left":
            assert bool(mask[:, -1].all())  # left padding: the last position is real in every row
            # the right-padding rule (position sum(mask) - 1) would pick a padding token here: a real check
            wrong = hidden[torch.arange(len(TEXTS)), mask.sum(1) - 1]
            short = int(mask.sum(1).argmin())
            assert not torch.allclose(wrong[short], refs[short], atol=1e-3)


def test_missing_model_folder_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="make model"):
        resolve_model_path(str(tmp_path / "nope"), "Build it with `make model`.")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path / "empty"))
