"""The M3 model: FlagEmbedding's head definitions and checkpoint format, our memory-safe sparse head, the
losses against FlagEmbedding's own loss code, and the encoder interface."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from FlagEmbedding import BGEM3FlagModel
from FlagEmbedding.finetune.embedder.encoder_only.m3.modeling import EncoderOnlyEmbedderM3Model
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from care.config import model_config
from care.encoders import build_encoder
from care.encoders.m3 import M3Encoder
from care.models.m3 import M3Model, tiny_m3
from care.paths import PROJECT_ROOT
from care.retrieval.scorer import EncoderScorer
from care.tools import build_m3
from care.training import head_scores
from care.training.losses import M3Loss

HEADS = ("dense", "sparse", "colbert")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def texts(shared):
    """Real Chinese medical text: KUAKE-QTR queries and titles, cMedQA2 answers (long, truncated)."""
    rows = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    lines = (shared / "chineseblue_cmedqa2_pairs" / "dev.txt").read_text(encoding="utf-8").splitlines()
    answers = [line.split("\t")[2].strip('"') for line in lines[:3]]
    return {"queries": [r["query"] for r in rows[:6]], "titles": [r["title"] for r in rows[:40]],
            "docs": [r["title"] for r in rows[6:12]] + answers}


def flag_training_model(model: M3Model, temperature: float = 1.0, **kw) -> EncoderOnlyEmbedderM3Model:
    """FlagEmbedding's own training model around our backbone and heads (an independent reference)."""
    return EncoderOnlyEmbedderM3Model(
        {"model": model.backbone, "colbert_linear": model.colbert_linear, "sparse_linear": model.sparse_linear},
        tokenizer=model.tokenizer, temperature=temperature, normalize_embeddings=True, **kw)


def test_flagembedding_loads_our_checkpoint_with_same_scores(tmp_path, texts):
    path = tiny_m3(dropout=0.0).save(tmp_path / "m3")
    ours = M3Encoder(str(path), max_length=64, device="cpu")
    flag = BGEM3FlagModel(str(path), use_fp16=False, devices="cpu", pooling_method="cls",
                          query_max_length=64, passage_max_length=64)
    kw = {"return_dense": True, "return_sparse": True, "return_colbert_vecs": True}
    fq, fd = flag.encode_queries(texts["queries"], **kw), flag.encode_corpus(texts["docs"], **kw)
    scorer = EncoderScorer(ours, heads=list(HEADS), show_progress=False)  # what evaluation scores with
    pair = scorer.prepare(texts["queries"], texts["docs"])
    od = pair.d
    every_doc = np.arange(len(texts["docs"]))

    expected = {
        "dense": fq["dense_vecs"] @ fd["dense_vecs"].T,
        "sparse": flag.compute_lexical_matching_score(fq["lexical_weights"], fd["lexical_weights"]),
        "colbert": np.array([[float(flag.colbert_score(a, b)) for b in fd["colbert_vecs"]]
                             for a in fq["colbert_vecs"]]),
    }
    for head in HEADS:
        ours_scores = np.stack([pair.score(head, qi, every_doc) for qi in range(len(texts["queries"]))])
        np.testing.assert_allclose(ours_scores, expected[head], atol=1e-5, err_msg=head)
    assert (expected["sparse"] > 0).any()  # the lexical scores are not trivially zero
    # random tiny models give near-identical dense scores, so compare the vectors themselves too
    np.testing.assert_allclose(od.dense, fd["dense_vecs"], atol=1e-5)
    for mine, theirs in zip(od.colbert, fd["colbert_vecs"]):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    for mine, theirs in zip(od.sparse, fd["lexical_weights"]):
        assert set(mine) == {int(t) for t in theirs}


def test_load_refuses_a_folder_without_head_files(tiny_bert_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"colbert_linear.pt, sparse_linear.pt missing.*m3 init"):
        M3Model.load(tiny_bert_dir)
    cfg = model_config("tiny_m3")
    with pytest.raises(FileNotFoundError, match="not an M3 checkpoint"):
        build_encoder({**cfg, "path": str(tiny_bert_dir)})
    with pytest.raises(FileNotFoundError, match=r"does not exist.*python -m care.tools.build_m3 tiny"):
        build_encoder({**cfg, "path": str(tmp_path / "missing")})


def test_init_command_gives_a_loadable_checkpoint(tiny_bert_dir, tmp_path):
    from transformers import AutoModel

    out = tmp_path / "m3"
    build_m3.main(["init", str(out), "--backbone", str(tiny_bert_dir)])
    loaded = M3Model.load(out)
    original = AutoModel.from_pretrained(tiny_bert_dir).state_dict()
    for name, value in loaded.backbone.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0)
    assert loaded.colbert_linear.weight.shape == (64, 64)


class ShapeRecorder(TorchDispatchMode):
    """Every tensor any aten op produces (forward and backward), with the op's name."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(str(func), tuple(t.shape)) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def test_sparse_head_never_builds_a_vocabulary_sized_tensor(texts):
    model = tiny_m3(dropout=0.1).train()
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    tok = model.tokenizer
    qb = dict(tok(texts["queries"][:4], padding=True, return_tensors="pt"))
    pb = dict(tok(texts["titles"][:12], padding=True, return_tensors="pt"))
    with ShapeRecorder() as rec:
        M3Loss(group_size=3)(model(**qb), model(**pb))["loss"].backward()
    assert any("embedding_dense_backward" in op for op, _ in rec.seen)  # the recorder sees backward too
    # the only vocabulary-sized tensors are the word-embedding matrix and its gradient
    assert {shape for _, shape in rec.seen if vocab in shape} <= {(vocab, hidden)}

    # the recorder does catch FlagEmbedding's batch x length x vocabulary training path
    flag = flag_training_model(model).train()
    hidden_states = model.backbone(**qb).last_hidden_state
    with ShapeRecorder() as rec:
        flag._sparse_embedding(hidden_states, qb["input_ids"])
    assert (4, qb["input_ids"].shape[1], vocab) in {shape for _, shape in rec.seen}


def test_scores_match_flagembedding_definitions(texts, monkeypatch):
    """Dense and sparse against FlagEmbedding's training model (vocabulary-sized sparse vectors), ColBERT
    vectors likewise, ColBERT scores against its inference score on padding-stripped vectors."""
    model = tiny_m3(dropout=0.0).eval()
    tok = model.tokenizer
    qb = dict(tok(texts["queries"], padding=True, return_tensors="pt"))
    pb = dict(tok(texts["docs"], padding=True, truncation=True, max_length=48, return_tensors="pt"))
    flag = flag_training_model(model).train()  # .train(): its vocabulary-sized sparse path
    with torch.no_grad():
        q, p = model(**qb), model(**pb)
        (fqd, fqs, fqc), (fpd, fps, fpc) = flag._encode(qb), flag._encode(pb)
        torch.testing.assert_close(head_scores.dense_scores(q, p), fqd @ fpd.T)
        torch.testing.assert_close(head_scores.sparse_scores(q, p), fqs @ fps.T)
        assert float(head_scores.sparse_scores(q, p).max()) > 0
        torch.testing.assert_close(q["colbert"], fqc)
        expected = [[float(BGEM3FlagModel.colbert_score(None, a[: n - 1].numpy(), b[: m - 1].numpy()))
                     for b, m in zip(fpc, pb["attention_mask"].sum(1))]
                    for a, n in zip(fqc, qb["attention_mask"].sum(1))]
        torch.testing.assert_close(head_scores.colbert_scores(q, p), torch.tensor(expected))
        monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", 1)  # one query x one passage per block: same scores
        torch.testing.assert_close(head_scores.colbert_scores(q, p), torch.tensor(expected))


def loss_preset(name: str) -> M3Loss:
    return instantiate(OmegaConf.load(PROJECT_ROOT / "conf" / "loss" / f"{name}.yaml"), group_size=3)


def unpadded_batches(model: M3Model, texts) -> tuple[dict, dict]:
    """Passages cut to one length: FlagEmbedding's training ColBERT score lets padding vectors (similarity
    0) into the max, ours (like its inference) does not; without passage padding both must agree."""
    tok = model.tokenizer
    titles = [t for t in texts["titles"] if len(t) >= 14][:12]
    qb = dict(tok(texts["queries"][:4], padding=True, return_tensors="pt"))
    pb = dict(tok(titles, padding="max_length", truncation=True, max_length=12, return_tensors="pt"))
    assert bool(pb["attention_mask"].all())
    return qb, pb


def test_equal_loss_is_the_sum_of_flagembeddings_head_losses(texts):
    model = tiny_m3(dropout=0.0)
    qb, pb = unpadded_batches(model, texts)
    flag = flag_training_model(model, temperature=0.02).train()
    (qd, qs, qc), (pd, ps, pc) = flag._encode(qb), flag._encode(pb)
    expected = {"dense": flag._compute_in_batch_neg_loss(qd, pd, compute_score_func=flag.compute_dense_score)[1],
                "sparse": flag._compute_in_batch_neg_loss(qs, ps, compute_score_func=flag.compute_sparse_score)[1],
                "colbert": flag._compute_in_batch_neg_loss(qc, pc, compute_score_func=flag.compute_colbert_score,
                                                           q_mask=qb["attention_mask"])[1]}
    loss = loss_preset("equal")
    out = loss(model(**qb), model(**pb))
    for head in HEADS:
        assert out[head].item() == pytest.approx(expected[head].item(), rel=1e-5)
    assert out["loss"].item() == pytest.approx(sum(expected.values()).item(), rel=1e-5)
    assert loss.weights == {"dense": 1.0, "sparse": 1.0, "colbert": 1.0, "ensemble": 0.0}


def test_flagembedding_preset_equals_flagembeddings_loss(texts):
    """(dense + ensemble + 0.1 sparse + colbert)/4 with self-distillation, as FlagEmbedding's forward."""
    model = tiny_m3(dropout=0.0)
    qb, pb = unpadded_batches(model, texts)
    flag = flag_training_model(model, temperature=0.02, use_self_distill=True).train()
    expected = flag(queries=qb, passages=pb).loss.item()
    out = loss_preset("flagembedding")(model(**qb), model(**pb))
    assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
    assert {"dense", "sparse", "colbert", "ensemble", "distill"} <= set(out)


def test_encoder_from_config_and_fingerprint(tmp_path, texts):
    path = tiny_m3(dropout=0.0).save(tmp_path / "m3")
    cfg = model_config("tiny_m3")
    enc = build_encoder({**cfg, "path": str(path)}, device="cpu")
    assert isinstance(enc, M3Encoder) and enc.heads == HEADS
    emb = enc.encode_documents(texts["docs"], batch_size=4, heads=HEADS)
    assert emb.dense.shape == (len(texts["docs"]), 64) and len(emb.sparse) == len(emb.colbert) == len(emb)
    np.testing.assert_allclose(np.linalg.norm(emb.dense, axis=1), 1.0, rtol=1e-5)
    assert enc.online_parameters == sum(p.numel() for p in enc.model.parameters())
    before = enc.fingerprint
    torch.save({"weight": torch.ones(1, 64), "bias": torch.zeros(1)}, path / "sparse_linear.pt")
    assert build_encoder({**cfg, "path": str(path)}, device="cpu").fingerprint != before  # heads are identity
