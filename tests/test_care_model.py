"""CARE's asymmetric encoder on tiny towers (care.models.towers, care.encoders.care, the registry's `kind: care`):
the Matryoshka cut of the document vector, which tower each side runs, per-side fingerprints, the end token
of the decoder tower, LoRA placement and its merge, and the errors a bad tower folder gives."""
from __future__ import annotations

import copy
import csv
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from torch import nn
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast

from care.config import CONF_DIR
from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache, embed
from care.models.tiny import tiny_bert, tiny_qwen3
from care.models.towers import Tower, TowerSpec, care_towers
from care.retrieval.scorer import EncoderScorer
from care.tools.build_towers import build_tiny, qwen3_embedding_like_tokenizer
from care.training.care_family import CAREFamily, lora_targets

pytestmark = pytest.mark.usefixtures("one_thread")

DOCUMENT = {"pooling": "last_token", "padding_side": "left", "append_eos": True, "max_length": 128}


@pytest.fixture(scope="module")
def texts(shared) -> list[str]:
    """Real Chinese medical questions and answers (cEpilepsyQA) of different lengths, and a short one."""
    with open(shared / "cepilepsyqa" / "question.csv", encoding="utf-8-sig", newline="") as fh:
        questions = [r["content"] for r in itertools.islice(csv.DictReader(fh), 5)]
    with open(shared / "cepilepsyqa" / "answer.csv", encoding="utf-8-sig", newline="") as fh:
        answers = [r["content"][:120] for r in itertools.islice(csv.DictReader(fh), 3)]
    return questions + answers + ["头痛"]


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """Two tiny tower pairs (query 32-d BERT, document 64-d Qwen3) from seeds 0 and 1."""
    root = tmp_path_factory.mktemp("care-towers")
    for seed in (0, 1):
        build_tiny(root / f"seed{seed}", seed=seed)
    return root


def model_config(query, document, **extra) -> dict:
    """conf/model/care_tiny.yaml with its towers pointed at the given folders (no build on first use)."""
    c = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "care_tiny.yaml"), resolve=True)
    for side, path in (("query", query), ("document", document)):
        c[side].pop("build")
        c[side]["path"] = str(path)
    return {**c, **extra}


def encoder(towers, query_seed=0, document_seed=0):
    return build_encoder(model_config(towers / f"seed{query_seed}" / "query", towers / f"seed{document_seed}" / "document"),
                         device="cpu")


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


# ---- 2. the encoder interface -------------------------------------------------------------------------

def test_each_side_runs_only_its_own_tower(towers, texts):
    enc = encoder(towers)
    calls = {"query": 0, "document": 0}
    for side, tower in enc.towers.items():
        tower.model.register_forward_hook(lambda *a, side=side: calls.__setitem__(side, calls[side] + 1))
    enc.encode_queries(texts, batch_size=4)
    assert calls == {"query": 3, "document": 0}
    enc.encode_documents(texts, batch_size=4)
    assert calls == {"query": 3, "document": 3}


def test_the_document_fingerprint_depends_on_the_document_tower_only(towers, texts, tmp_path):
    base, other_query, other_document = encoder(towers), encoder(towers, query_seed=1), encoder(towers, document_seed=1)
    assert other_query.towers["query"].width == base.towers["query"].width  # same width: same cut
    assert other_query.side_fingerprint("document") == base.side_fingerprint("document")
    assert other_query.side_fingerprint("query") != base.side_fingerprint("query")
    assert other_document.side_fingerprint("document") != base.side_fingerprint("document")  # the control
    assert other_document.side_fingerprint("query") == base.side_fingerprint("query")
    # so a corpus cached with one query tower is not encoded again for another
    cache = EmbeddingCache(tmp_path)
    first = embed(base, texts, "document", cache, show_progress=False).dense
    again = embed(other_query, texts, "document", cache, show_progress=False).dense
    assert (cache.misses, cache.hits) == (len(texts), len(texts)) and np.array_equal(first, again)
    embed(other_document, texts, "document", cache, show_progress=False)
    assert cache.misses == 2 * len(texts)


def test_queries_take_the_instruction_of_their_task_and_training_uses_the_same_text(towers, texts, tmp_path):
    enc = encoder(towers)
    instructions = model_config(".", ".")["instructions"]
    assert enc.prompts.apply(["头痛"], "query", "sts") == [f"<instruct>{instructions['sts']}\n<query>头痛"]
    assert enc.prompts.apply(["头痛"], "document", "sts") == ["头痛"]  # documents get none
    retrieval, sts = enc.encode_queries(texts[:3]).dense, enc.encode_queries(texts[:3], task="sts").dense
    assert np.abs(retrieval - sts).max() > 1e-4  # the instruction changes the vector ...
    assert enc.side_fingerprint("query", "sts") != enc.side_fingerprint("query", "retrieval")  # ... and its key
    assert enc.side_fingerprint("document", "sts") == enc.side_fingerprint("document", "retrieval")
    with pytest.raises(ValueError, match="no instruction for task type 'clustering'"):
        enc.encode_queries(["头痛"], task="clustering")
    # the training loop tokenizes a query exactly as the encoder does for retrieval (the training task)
    family = stage2_family(towers, tmp_path)
    trained = family.tokenize(texts[:3], ["query"] * 3, 64)
    served = enc.towers["query"].tokenize(enc.prompts.apply(texts[:3], "query", "retrieval"))
    assert torch.equal(trained["input_ids"], served["input_ids"])
    documents = family.tokenize(texts[:3], ["document"] * 3, 128)
    assert torch.equal(documents["input_ids"], enc.towers["document"].tokenize(texts[:3])["input_ids"])


def test_online_parameters_are_the_query_towers(towers):
    enc = encoder(towers)
    with safe_open(towers / "seed0" / "query" / "model.safetensors", "np") as weights:
        total = sum(weights.get_tensor(k).size for k in weights.keys())  # noqa: SIM118 (no __iter__)
        lookup = weights.get_tensor("embeddings.word_embeddings.weight").size
    document = sum(p.numel() for p in enc.towers["document"].parameters())
    assert enc.online_parameters == total and enc.online_embedding_parameters == lookup
    assert document > total  # the document tower never counts, though it is the larger


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


# ---- 5. LoRA placement and merge ------------------------------------------------------------------------

def test_lora_targets_every_attention_and_mlp_projection():
    bert, _ = tiny_bert(hidden=32, layers=2)
    qwen, _ = tiny_qwen3(hidden=64, layers=2)
    bert_projections = ["attention.self.query", "attention.self.key", "attention.self.value",
                        "attention.output.dense", "intermediate.dense", "output.dense"]
    qwen_projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {"bert": {f"encoder.layer.{i}.{p}" for i in range(2) for p in bert_projections},
                "qwen3": {f"layers.{i}.{p}" for i in range(2) for p in qwen_projections}}
    for name, model in (("bert", bert), ("qwen3", qwen)):
        targets = lora_targets(model)
        assert set(targets) == expected[name] and len(targets) == len(expected[name]), name
        linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        assert linear == expected[name]  # every linear layer of these models is one of them
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(copy.deepcopy(qwen), LoraConfig(r=4, target_modules=lora_targets(qwen)))
    adapted = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    assert adapted == expected["qwen3"]  # peft placed an adapter on each of them
    with pytest.raises(ValueError, match="no linear layer inside numbered transformer blocks"):
        lora_targets(nn.Sequential(nn.Linear(4, 4)))


def stage2_family(towers, tmp_path, **trainer):
    from care.config import load_config
    from care.training.care_recipe import stage_config

    seed0 = towers / "seed0"
    cfg = load_config("train", ["model=care_tiny", f"model.query.path={seed0 / 'query'}",
                                f"model.document.path={seed0 / 'document'}", f"output_dir={tmp_path / 'run'}",
                                f"model.stages.stage2.query_from={seed0 / 'query'}", "validation.task=null",
                                *(f"trainer.{k}={v}" for k, v in trainer.items())])
    return CAREFamily(stage_config(cfg, "stage2", tmp_path / "run"))


def test_the_merged_document_tower_equals_the_adapter_and_every_folder_reloads(towers, texts, tmp_path):
    from peft import PeftModel

    family = stage2_family(towers, tmp_path)
    query, document = family.query_module, family.document_module
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter (peft starts lora_B at zero: a merge of nothing)
        for name, p in document.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    document.eval()
    out = family.save([query, document], tmp_path / "saved")
    assert {p.name for p in out.iterdir()} == {"query", "document", "document_adapter"}
    spec = TowerSpec(path=str(out / "document"), **DOCUMENT)
    merged = Tower.load(spec, "model.document").eval()
    base = Tower.load(TowerSpec(path=str(towers / "seed0" / "document"), **DOCUMENT), "model.document").eval()
    reloaded = copy.deepcopy(base)
    reloaded.model = PeftModel.from_pretrained(reloaded.model, out / "document_adapter").eval()
    batch = document.tokenize(texts)
    with torch.no_grad():
        live, from_merged = document(**batch)["dense"], merged(**batch)["dense"][:, :32]
        from_adapter, start = reloaded(**batch)["dense"][:, :32], base(**batch)["dense"][:, :32]
    torch.testing.assert_close(from_merged, live, atol=1e-5, rtol=0)
    torch.testing.assert_close(from_adapter, live, atol=1e-5, rtol=0)
    assert (start - live).abs().max() > 1e-3  # the control: the adapter does change the tower
    for side, source in (("query", towers / "seed0" / "query"), ("document", towers / "seed0" / "document")):
        tok, original = AutoTokenizer.from_pretrained(out / side), AutoTokenizer.from_pretrained(source)
        assert tok(texts)["input_ids"] == original(texts)["input_ids"], side
        assert json.loads((out / side / "config.json").read_text())["hidden_size"] == (32 if side == "query" else 64)
    assert not any("lora" in k for k in safe_open(out / "document" / "model.safetensors", "np").keys())  # noqa: SIM118


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
    with pytest.raises(ValueError, match=r"remote needs its own modelling code: set model.query.trust_remote_code=true"):
        care_towers({"path": str(folder)}, {"path": str(towers / "seed0" / "document"), **DOCUMENT})
