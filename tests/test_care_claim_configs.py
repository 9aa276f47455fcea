"""The symmetric rows of CARE's claim at equal query cost (docs/care.md, "CARE's claim at equal query cost"):
`model=me5_small_cut4` is care_me5's query tower used on both sides, and a tower folder of a CARE run scored
through evaluate.py's ckpt= path is a dense model whose query vectors are CARE's.  A tiny 12-layer BERT stands
in for multilingual-e5-small at the folder the configs name (the same cut builder, the same spread pick)."""
from __future__ import annotations

import pytest
import torch
from _care_helpers import texts  # noqa: F401  (a fixture: real cEpilepsyQA questions and answers)

from care.config import model_config
from care.encoders import build_encoder
from care.encoders.builders.towers import picked_layers
from care.encoders.registry import ensure_towers
from care.evaluation.entries import checkpoint_models
from care.models.towers import Tower, TowerSpec


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """care_me5, me5_small_cut4 and me5_small composed under a temporary cache root, with a tiny 12-layer BERT
    where me5 lies and care_me5's query tower cut from it by the registry (its `build:`)."""
    from care.models.tiny import tiny_bert

    root = tmp_path_factory.mktemp("claim")
    roots = {"cache_root": str(root / "cache"), "out_root": str(root / "out")}
    care, cut4, me5 = (model_config(n, roots) for n in ("care_me5", "me5_small_cut4", "me5_small"))
    model, tok = tiny_bert(hidden=32, layers=12, seed=5)
    model.save_pretrained(me5["path"])
    tok.save_pretrained(me5["path"])
    ensure_towers(care)
    return {"care": care, "cut4": cut4, "me5": me5, "root": root}


def short(texts):  # noqa: F811
    """Texts within every tower's token limit (care_me5's query side reads 64 tokens, the dense model 512):
    one token a Chinese character, so 40 characters and the prompt stay under 64."""
    return [t for t in texts if len(t) <= 40]


def dense(c):
    return build_encoder(c, backend="torch")


def vectors(encoder, texts, side):  # noqa: F811
    emb = (encoder.encode_queries if side == "query" else encoder.encode_documents)(texts)
    return torch.as_tensor(emb.dense)


def test_cut_config_is_the_care_query_tower_on_both_sides(configs, texts):  # noqa: F811
    care, cut4, me5 = configs["care"], configs["cut4"], configs["me5"]
    # the one folder: what care_me5's query tower is built into and loads, and what the dense config loads
    assert cut4["path"] == care["query"]["path"] == care["query"]["build"]["out"]
    assert care["query"]["build"]["source"] == care["document"]["path"] == me5["path"]
    assert {k: cut4[k] for k in ("kind", "pooling", "prompts")} == {"kind": "dense", "pooling": "mean",
                                                                    "prompts": me5["prompts"]}
    enc = dense(cut4)
    assert type(enc).__name__ == "HFDenseEncoder" and enc.model.config.num_hidden_layers == 4
    # its layers are the source's 0, 4, 7, 11, weight for weight
    from transformers import AutoModel

    source = AutoModel.from_pretrained(me5["path"], add_pooling_layer=False)
    picks = picked_layers(12, 4, "spread")
    assert picks == [0, 4, 7, 11]
    for mine, theirs in zip(enc.model.encoder.layer, (source.encoder.layer[i] for i in picks)):
        for (name, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # queries: the CARE model's own query vectors; documents: the small tower's, not the 12-layer tower's
    texts = short(texts)
    assert len(texts) >= 4
    care_enc = dense(care)
    torch.testing.assert_close(vectors(enc, texts, "query"), vectors(care_enc, texts, "query"), atol=1e-6, rtol=0)
    assert not torch.allclose(vectors(enc, texts, "document"), vectors(care_enc, texts, "document"), atol=1e-3)


def test_a_tower_folder_scores_as_a_dense_model_through_ckpt(configs, texts, tmp_path):  # noqa: F811
    """A stage-I query tower saved as CAREFamily.save saves it (Tower.save into <run>/stage1/final/query),
    linked into a folder of checkpoints: evaluate.py's ckpt= path builds it as the evaluation's model= config
    (me5_small: mean pooling, query: / passage: prompts) at the tower's folder."""
    care, me5 = configs["care"], configs["me5"]
    spec = TowerSpec.from_config({k: v for k, v in care["query"].items() if k != "build"}, "model.query")
    tower = Tower.load(spec, "model.query")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a "trained" tower: not the cut it started from
        for p in tower.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    saved = tower.save(tmp_path / "run" / "stage1" / "final" / "query")
    table = tmp_path / "table"
    table.mkdir()
    (table / "h-tower-s42").symlink_to(saved)
    [(name, c)] = checkpoint_models(str(table), me5)
    assert name == "table/h-tower-s42" and c["kind"] == "dense" and c["path"] == str(table / "h-tower-s42")
    enc = dense(c)
    texts = short(texts)
    trained_care = dense({**care, "query": {**care["query"], "path": str(saved)}})
    untrained_care = dense(care)
    q = vectors(enc, texts, "query")
    torch.testing.assert_close(q, vectors(trained_care, texts, "query"), atol=1e-6, rtol=0)
    assert not torch.allclose(q, vectors(untrained_care, texts, "query"), atol=1e-3)
    # documents: the same tower under the passage: prompt, mean-pooled (an independent forward of the tower)
    tower = Tower.load(TowerSpec(path=str(saved), pooling="mean"), "h").eval()
    with torch.no_grad():
        expected = tower(**tower.tokenize([f"passage: {t}" for t in texts]))["dense"]
    torch.testing.assert_close(vectors(enc, texts, "document"), expected, atol=1e-6, rtol=0)
