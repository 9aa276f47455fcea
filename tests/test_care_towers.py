"""CARE's towers: the Matryoshka cut of the document vector, the decoder's end token, bad tower folders."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from _care_helpers import DOCUMENT, encoder, texts, towers  # noqa: F401  (texts, towers: fixtures)
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast

from care.models.tiny import qwen3_embedding_like_tokenizer
from care.models.towers import Tower, TowerSpec, care_towers
from care.retrieval.scorer import EncoderScorer

pytestmark = pytest.mark.usefixtures("one_thread")


def full_document_vectors(folder, texts) -> np.ndarray:
    """Independently of the tower code: each text alone through AutoModel, the hidden state of its last token
    (the tokenizer appends the end token itself), L2-normalised at full width."""
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    rows = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, truncation=True, max_length=DOCUMENT["max_length"], return_tensors="pt")
            rows.append(model(**ids).last_hidden_state[0, -1].numpy().astype(np.float64))
    full = np.stack(rows)
    return full / np.linalg.norm(full, axis=1, keepdims=True)


# ---- 1. the cut ----------------------------------------------------------------------------------------

def test_document_vectors_are_the_cut_of_the_normalised_full_vector(towers, texts):
    enc = encoder(towers)
    q = enc.encode_queries(texts).dense
    d = enc.encode_documents(texts).dense
    full = full_document_vectors(towers / "seed0" / "document", texts)
    assert full.shape[1] == 64 and q.shape[1] == d.shape[1] == 32  # cut to the query width
    np.testing.assert_allclose(d, full[:, :32], atol=1e-5)
    norms = np.linalg.norm(d, axis=1)
    assert (norms < 0.999).all() and (norms > 0).all()  # a prefix of a unit vector, not re-normalised
    renormalised = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)
    assert np.abs(d - renormalised).max() > 1e-2  # the control: re-normalising would be seen
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-5)  # queries are unit vectors
    # the score is the dot product of the two (no cosine): what retrieval ranks by
    pair = EncoderScorer(enc, show_progress=False).prepare(texts, texts)
    np.testing.assert_allclose(pair.score("dense", 0, np.arange(len(texts))), d @ q[0], rtol=1e-6)
    cosine = (d / norms[:, None]) @ q[0]
    assert np.abs(pair.score("dense", 0, np.arange(len(texts))) - cosine).max() > 1e-3


def test_tower_vectors_keep_float64_and_lift_bfloat16(towers, texts):
    """`trainer.dtype=float64` (the exact distributed tests) must not be cut to float32 at the vector; bf16
    vectors are lifted to float32 (a ranking in bf16 loses ties)."""
    folder = towers / "seed0" / "document"
    full = full_document_vectors(folder, texts)
    for dtype, want, atol in ((torch.float64, torch.float64, 1e-6), (torch.bfloat16, torch.float32, 0.1)):
        tower = Tower.load(TowerSpec(path=str(folder), **DOCUMENT), "model.document", dtype).eval()
        with torch.no_grad():
            vectors = torch.cat([tower(**tower.tokenize([t]))["dense"] for t in texts])
        assert vectors.dtype == want, dtype
        np.testing.assert_allclose(vectors.float().numpy(), full, atol=atol)
    double = Tower.load(TowerSpec(path=str(folder), **DOCUMENT), "model.document", torch.float64).eval()
    with torch.no_grad():
        ids = double.tokenize(texts[:1])
        hidden = double.model(**ids).last_hidden_state[0, -1]
        exact = hidden / hidden.norm()
        assert float((double(**ids)["dense"][0] - exact).abs().max()) < 1e-15  # no float32 step in between


def test_a_query_tower_wider_than_the_document_tower_is_an_error(towers):
    seed0 = towers / "seed0"
    with pytest.raises(ValueError, match=r"query tower .*64-d\) is wider than the document tower .*32-d\)"):
        care_towers({"path": str(seed0 / "document"), **DOCUMENT}, {"path": str(seed0 / "query")})
    q, d = care_towers({"path": str(seed0 / "query")}, {"path": str(seed0 / "document"), **DOCUMENT})
    assert (q.dim, d.width, d.dim) == (32, 64, 32)


# ---- 3. the end token of the decoder tower ------------------------------------------------------------

def tokenizer_folder(towers, tmp_path, tokenizer):
    """The seed-0 document model with another tokenizer."""
    folder = tmp_path / "document"
    shutil.copytree(towers / "seed0" / "document", folder)
    for f in folder.glob("*token*"):
        f.unlink()
    tokenizer.save_pretrained(folder)
    return folder


def plain_tokenizer(pad: bool = True):
    """A tokenizer that appends nothing (as transformers' slow Qwen2 tokenizer, or a base Qwen3's)."""
    from tokenizers.processors import TemplateProcessing

    tok = qwen3_embedding_like_tokenizer()
    backend = copy.deepcopy(tok.backend_tokenizer)
    backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[SEP]", unk_token="[UNK]",
                                   padding_side="left", model_input_names=["input_ids", "attention_mask"],
                                   **({"pad_token": "[PAD]"} if pad else {}))


def real_qwen3_embedding_like_tokenizer():
    """As Qwen3-Embedding's: the post-processor appends the PAD token (<|endoftext|> there), and the eos_token
    attribute names another token (<|im_end|> there)."""
    from tokenizers.processors import TemplateProcessing

    tok = qwen3_embedding_like_tokenizer()
    backend = copy.deepcopy(tok.backend_tokenizer)
    pad = tok.convert_tokens_to_ids("[PAD]")
    backend.post_processor = TemplateProcessing(single="$A:0 [PAD]:0", pair="$A:0 [PAD]:0 $B:1 [PAD]:1",
                                                special_tokens=[("[PAD]", pad)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[SEP]",
                                   unk_token="[UNK]", padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])


def real_tokens(batch) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


@pytest.mark.parametrize("kind", ["appends_eos_token", "appends_nothing", "appends_pad_as_qwen3_embedding"])
def test_the_document_input_ends_in_one_end_token(kind, towers, texts, tmp_path):
    if kind == "appends_eos_token":  # the tiny tower's own tokenizer
        folder = towers / "seed0" / "document"
    else:
        make = plain_tokenizer if kind == "appends_nothing" else real_qwen3_embedding_like_tokenizer
        folder = tokenizer_folder(towers, tmp_path, make())
    tower = Tower.load(TowerSpec(path=str(folder), **{**DOCUMENT, "max_length": 16}), "model.document")
    tok = tower.tokenizer
    end = tok.pad_token_id if kind == "appends_pad_as_qwen3_embedding" else tok.eos_token_id
    if kind == "appends_pad_as_qwen3_embedding":  # the control: an id check would see no end token here
        assert tok("头痛")["input_ids"][-1] != tok.eos_token_id
    if kind == "appends_nothing":  # the control: this tokenizer really ends no text with one
        assert end not in tok("头痛")["input_ids"]
    batch = tower.tokenize(texts + ["头痛" * 40])  # the last is truncated
    assert (batch["attention_mask"][:, -1] == 1).all()  # left padding: the last position is real
    for row in real_tokens(batch):
        assert row[-1] == end and row.count(end) == 1, row
        assert len(row) <= 16
        if kind == "appends_pad_as_qwen3_embedding":
            assert tok.eos_token_id not in row  # no second end token appended by hand
    assert len(real_tokens(batch)[-1]) == 16  # a truncated text keeps its end token


def test_last_token_pooling_with_left_padding_is_the_unpadded_last_token(towers, texts):
    tower = Tower.load(TowerSpec(path=str(towers / "seed0" / "document"), **DOCUMENT), "model.document").eval()
    batch = tower.tokenize(texts)
    assert (batch["attention_mask"][:, 0] == 0).any()  # some rows are padded
    with torch.no_grad():
        padded = tower(**batch)["dense"]
        for i, t in enumerate(texts):
            alone = tower.tokenize([t])
            assert alone["attention_mask"].all()
            hidden = tower.model(**alone).last_hidden_state[0, -1]
            torch.testing.assert_close(padded[i], torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5, rtol=0)
        # the control: the padding is there and counts unless masked
        unmasked = tower(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["attention_mask"]))
    short = int(batch["attention_mask"].sum(1).argmin())
    assert (unmasked["dense"][short] - padded[short]).abs().max() > 1e-3


# ---- 9. bad tower folders -----------------------------------------------------------------------------

def test_a_tokenizer_without_a_pad_token_is_a_clear_error(towers, tmp_path, monkeypatch):
    folder = tokenizer_folder(towers, tmp_path, plain_tokenizer(pad=False))
    assert AutoTokenizer.from_pretrained(folder).pad_token_id is None
    import care.models.towers as towers_module

    def no_weights(*args, **kwargs):  # said before the weights load (billions of them for an LLM tower)
        raise AssertionError("loaded the model before checking its tokenizer")

    monkeypatch.setattr(towers_module.AutoModel, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match=r"tokenizer of .*document \(model.document\) has no pad token.*pad_token"):
        Tower.load(TowerSpec(path=str(folder), **DOCUMENT), "model.document")


def test_remote_code_without_trust_remote_code_is_a_clear_error(towers, tmp_path):
    """A folder whose config.json maps the model to its own code (gte-multilingual-base's NewModel)."""
    folder = tmp_path / "remote"
    shutil.copytree(towers / "seed0" / "query", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="new", architectures=["NewModel"],
                  auto_map={"AutoConfig": "configuration.NewConfig", "AutoModel": "modeling.NewModel"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"remote needs its own modelling code: pass \+\+model.query.trust_remote_code=true"):
        care_towers({"path": str(folder)}, {"path": str(towers / "seed0" / "document"), **DOCUMENT})
