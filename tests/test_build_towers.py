"""The tower folders of asymmetric encoders (care.encoders.builders.towers; its command line care.tools.build_towers):
the tiny query/document pair, a BertModel-family encoder cut to its first N layers, and build_from_spec (what
the registry calls on first use)."""
from __future__ import annotations

import csv
import itertools
import json

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from care.encoders.builders.towers import build_cut, build_from_spec, build_tiny, default_source
from care.tools import build_towers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def questions(shared) -> list[str]:
    """Real Chinese medical questions (cEpilepsyQA), the first rows of the file."""
    with open(shared / "cepilepsyqa" / "question.csv", encoding="utf-8", newline="") as fh:
        return [row["content"] for row in itertools.islice(csv.DictReader(fh), 16)]


@pytest.fixture(scope="module")
def tiny_towers(tmp_path_factory):
    out = tmp_path_factory.mktemp("towers") / "tiny"
    return out, build_tiny(out)


def no_pooler(folder) -> dict:
    """BERT-family folders here have no pooler (as care.models.hub.load_encoder_model loads them)."""
    return {"add_pooling_layer": False} if AutoConfig.from_pretrained(folder).model_type == "bert" else {}


def load(folder):
    return AutoModel.from_pretrained(folder, **no_pooler(folder)).eval(), AutoTokenizer.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------------
# tiny

def test_tiny_towers_load_with_documented_widths(tiny_towers):
    out, manifest = tiny_towers
    q_model, q_tok = load(out / "query")
    d_model, d_tok = load(out / "document")
    assert (q_model.config.model_type, q_model.config.hidden_size, q_model.config.num_hidden_layers) == ("bert", 32, 2)
    assert (d_model.config.model_type, d_model.config.hidden_size, d_model.config.num_hidden_layers) == ("qwen3", 64, 2)
    assert d_model.config.hidden_size > q_model.config.hidden_size  # the document vector is cut to the query width
    assert q_tok.vocab_size == d_tok.vocab_size == 21128  # the real bert-base-chinese vocabulary, both sides
    assert (manifest["query"]["hidden"], manifest["document"]["hidden"]) == (32, 64)
    # query side: BERT, CLS first, right padding; document side: pad and end tokens, left padding
    assert q_tok.pad_token == "[PAD]" and q_tok.padding_side == "right"
    assert q_tok("头痛")["input_ids"][0] == q_tok.cls_token_id
    assert d_tok.pad_token == "[PAD]" and d_tok.eos_token == "[SEP]" and d_tok.padding_side == "left"
    assert d_model.config.pad_token_id == d_tok.pad_token_id
    assert not manifest["skipped"]


def test_tiny_document_tokenizer_appends_the_end_token_like_qwen3_embedding(tiny_towers, questions):
    out, _ = tiny_towers
    tok = AutoTokenizer.from_pretrained(out / "document")
    batch = tok(questions[:4] + ["头痛"], padding=True, return_tensors="pt")
    assert set(batch) == {"input_ids", "attention_mask"}  # no token_type_ids, as Qwen2TokenizerFast
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert (ids[:, -1] == tok.eos_token_id).all() and (mask[:, -1] == 1).all()  # appended by the tokenizer, left pad
    assert (ids[-1, :-3] == tok.pad_token_id).all() and (mask[-1, :-3] == 0).all()
    plain = tok("头痛", add_special_tokens=False)["input_ids"]
    assert tok("头痛")["input_ids"] == plain + [tok.eos_token_id]  # no BOS, one end token
    long = tok("头痛" * 600, truncation=True, max_length=16)["input_ids"]
    assert len(long) == 16 and long[-1] == tok.eos_token_id  # truncation keeps the end token
    record = json.loads((out / "document" / "manifest.json").read_text(encoding="utf-8"))
    assert record["pooling"] == "last_token" and record["tokenizer"]["appended_token_id"] == tok.eos_token_id
    assert "<|endoftext|>" in record["tokenizer"]["real_qwen3_embedding"]["appended_token"]


def test_tiny_document_last_token_does_not_depend_on_left_padding(tiny_towers, questions):
    """Left padding + the attention mask: a text's last-token state is the same alone and in a padded batch."""
    out, _ = tiny_towers
    model, tok = load(out / "document")
    texts = [questions[0], "头痛"]
    with torch.inference_mode():
        batch = tok(texts, padding=True, return_tensors="pt")
        batched = model(**batch).last_hidden_state[:, -1]
        alone = torch.cat([model(**tok([t], return_tensors="pt")).last_hidden_state[:, -1] for t in texts])
    assert batch["attention_mask"][1, 0] == 0  # the short text really was padded
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_tiny_rerun_is_a_no_op_and_options_rebuild(tiny_towers, tmp_path):
    out, first = tiny_towers
    weights = out / "document" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = build_tiny(out)
    assert again["skipped"] and weights.stat().st_mtime_ns == mtime
    assert again["files"] == first["files"] and "query/model.safetensors" in first["files"]
    # seeded: another folder, same seed -> the same bytes; another seed -> rebuilt, other weights
    other = tmp_path / "same-seed"
    assert not build_tiny(other)["skipped"]
    assert (other / "document" / "model.safetensors").read_bytes() == weights.read_bytes()
    reseeded = build_tiny(other, seed=1)
    assert not reseeded["skipped"] and reseeded["key"]["seed"] == 1
    assert (other / "document" / "model.safetensors").read_bytes() != weights.read_bytes()
    # a file the manifest lists that went missing -> rebuilt
    (other / "query" / "tokenizer.json").unlink()
    assert not build_tiny(other, seed=1)["skipped"] and (other / "query" / "tokenizer.json").is_file()


def test_tiny_refuses_a_narrower_document_tower_and_a_foreign_folder(tmp_path):
    with pytest.raises(ValueError, match="at least as wide"):
        build_tiny(tmp_path / "bad", query_hidden=64, document_hidden=32)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not built by build_towers"):
        build_tiny(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ----------------------------------------------------------------------------------------------------
# cut

@pytest.fixture(scope="module")
def bert4(tmp_path_factory):
    from care.models.tiny import tiny_bert

    model, tok = tiny_bert(layers=4, seed=3)
    src = tmp_path_factory.mktemp("bert4") / "src"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    return src


def intermediate_equals_cut(src, cut, n, texts):
    full, tok = load(src)
    with torch.inference_mode():
        batch = tok(texts, padding=True, return_tensors="pt")
        expected = full(**batch, output_hidden_states=True).hidden_states[n]
        model, info = AutoModel.from_pretrained(cut, output_loading_info=True, **no_pooler(cut))
        got = model.eval()(**batch).last_hidden_state
        last = full(**batch).last_hidden_state
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_hidden_layers == len(model.encoder.layer) == n
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if n < full.config.num_hidden_layers:  # and it is not simply the full model
        assert not torch.allclose(got, last, atol=1e-3)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cut_equals_the_full_models_intermediate_hidden_states(bert4, tmp_path, questions, n):
    out = tmp_path / f"cut{n}"
    manifest = build_cut(bert4, out, layers=n)
    intermediate_equals_cut(bert4, out, n, questions)
    assert AutoConfig.from_pretrained(out).num_hidden_layers == n and manifest["source_layers"] == 4
    # transformers 5 saves a fast tokenizer as tokenizer.json + tokenizer_config.json only (4.x added vocab.txt)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["tokenizer_files"])
    for name in manifest["tokenizer_files"]:
        assert (out / name).read_bytes() == (bert4 / name).read_bytes()


@pytest.mark.parametrize("n", [0, -1, 5, 2.0])
def test_cut_bad_layer_count_is_a_clear_error(bert4, tmp_path, n):
    with pytest.raises(ValueError, match=r"from 1 to 4 \(the layers src has\)"):
        build_cut(bert4, tmp_path / "cut", layers=n)
    assert not (tmp_path / "cut").exists()


def test_cut_cli_error_and_rerun(bert4, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        build_towers.main(["cut", str(bert4), str(tmp_path / "cut"), "--layers", "9"])
    assert e.value.code == 2 and "from 1 to 4" in capsys.readouterr().err
    build_towers.main(["cut", str(bert4), str(tmp_path / "cut"), "--layers", "2"])
    assert build_cut(bert4, tmp_path / "cut", layers=2)["skipped"]
    assert not build_cut(bert4, tmp_path / "cut", layers=3)["skipped"]  # another N: rebuilt


def test_cut_rebuilds_when_the_source_changes(tmp_path):
    from care.models.tiny import save_tiny

    src = save_tiny(tmp_path / "src", layers=3, seed=0)
    first = build_cut(src, tmp_path / "cut", layers=2)
    assert build_cut(src, tmp_path / "cut", layers=2)["skipped"]
    save_tiny(src, layers=3, seed=1)  # other weights in the same folder
    again = build_cut(src, tmp_path / "cut", layers=2)
    assert not again["skipped"] and again["key"]["source_digest"] != first["key"]["source_digest"]
    with pytest.raises(ValueError, match="overwrite its source"):
        build_cut(src, src, layers=2)


def test_cut_of_the_real_me5_equals_its_fourth_layer(tmp_path, questions):
    """The offline multilingual-e5-small (built first when missing) cut to 4 layers."""
    out = tmp_path / "me5-l4"
    manifest = build_cut(None, out, layers=4)
    assert manifest["source_layers"] == 12 and manifest["hidden"] == 384
    intermediate_equals_cut(default_source(), out, 4, ["query: " + q for q in questions[:8]])


# ----------------------------------------------------------------------------------------------------
# the registry hook

def test_build_from_spec_runs_the_named_builder(bert4, tmp_path):
    build_from_spec({"tool": "tiny", "out": str(tmp_path / "pair"), "seed": 2})
    assert AutoConfig.from_pretrained(tmp_path / "pair" / "document").model_type == "qwen3"
    build_from_spec({"tool": "cut", "source": str(bert4), "layers": 3, "out": str(tmp_path / "cut")})
    assert AutoConfig.from_pretrained(tmp_path / "cut").num_hidden_layers == 3
    manifest = json.loads((tmp_path / "cut" / "manifest.json").read_text(encoding="utf-8"))
    build_from_spec({"tool": "cut", "source": str(bert4), "layers": 3, "out": str(tmp_path / "cut")})  # a no-op
    assert json.loads((tmp_path / "cut" / "manifest.json").read_text(encoding="utf-8")) == manifest
    for spec, msg in (({"tool": "prune", "out": "x"}, "'tiny' or 'cut'"), ({"tool": "cut", "out": "x"}, "'layers'"),
                      ({"tool": "tiny"}, "'out'"), ({"tool": "tiny", "out": "x", "width": 8}, "unknown keys")):
        with pytest.raises(ValueError, match=msg):
            build_from_spec(spec)
