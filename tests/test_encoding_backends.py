"""Faster encoding paths of the dense encoder (care/encoders/dense.py): length bucketing and the inference
backends.  Speed is measured in bench/encode_bench.py, never here; these tests pin what must hold for a
faster path to be usable: the same vectors in the same order (bucketing), a distinct cache identity and
close-but-not-equal vectors (int8), and a clear error for a backend that cannot run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from care.encoders.dense import BACKENDS, HFDenseEncoder, batched_forward, token_lengths

pytestmark = pytest.mark.usefixtures("one_thread")

# Titles and answers of very different lengths, in no length order: bucketing must reorder them.
TEXTS = ["头痛", "高血压患者每天应该吃多少盐，饮食上还需要注意什么？医生建议低盐低脂。", "发烧怎么办",
         "糖尿病", "孩子咳嗽一周了，晚上加重，有痰，吃了止咳药也没有好转，需要去医院拍片吗？", "胃疼",
         "失眠多梦是什么原因引起的", "感冒"]


def encoder(path, backend: str = "torch", device: str = "cpu") -> HFDenseEncoder:
    return HFDenseEncoder(str(path), name="tiny", pooling="cls", max_length=64, device=device, backend=backend)


@pytest.fixture(scope="module")
def fp32(tiny_bert_dir):
    return encoder(tiny_bert_dir)


@pytest.fixture(scope="module")
def fp32_vectors(fp32):
    return fp32.encode_documents(TEXTS, batch_size=4).dense


def test_bucketing_batches_by_length_and_restores_order():
    seen = []

    def step(batch):
        seen.append(batch)
        return [f"<{t}>" for t in batch]

    out = batched_forward(TEXTS, 3, False, "", step)
    assert out == [f"<{t}>" for t in TEXTS]
    assert [t for b in seen for t in b] == sorted(TEXTS, key=len, reverse=True)


def test_encode_sorts_by_tokens_not_characters(fp32, monkeypatch):
    """A Latin word is many characters and few word pieces: sorted by characters it would lead the batches."""
    texts = ["hypertension", "头痛发烧咳嗽", "感冒", "insulin"]
    tokens = token_lengths(fp32.tokenizer, texts, fp32.max_length)
    by_tokens = sorted(texts, key=lambda t: -tokens[texts.index(t)])
    assert by_tokens != sorted(texts, key=len, reverse=True)  # the case tells the two orders apart
    seen, embed = [], fp32.embed
    monkeypatch.setattr(fp32, "embed", lambda batch: seen.extend(batch) or embed(batch))
    out = fp32.encode_documents(texts, batch_size=1).dense
    assert seen == by_tokens
    np.testing.assert_allclose(out[0], embed(["hypertension"]).detach().numpy()[0], atol=1e-6)  # order restored


def test_bucketed_vectors_equal_unbatched_ones(fp32, fp32_vectors):
    alone = np.concatenate([fp32.encode_documents([t], batch_size=1).dense for t in TEXTS])
    np.testing.assert_allclose(fp32_vectors, alone, atol=1e-6)
    assert not np.allclose(fp32_vectors[0], fp32_vectors[1], atol=1e-3)  # distinct texts, distinct rows


def test_torch_identity_has_no_backend_key(fp32):
    """The default backend adds nothing to the identity: fp32 vectors cached before backends stay valid."""
    assert "backend" not in fp32.identity("document")


def test_unknown_backend_is_a_clear_error(tiny_bert_dir):
    with pytest.raises(ValueError, match="unknown dense encoder backend 'int4'.*torch_int8"):
        encoder(tiny_bert_dir, backend="int4")


def test_cpu_backend_refuses_a_gpu(tiny_bert_dir):
    with pytest.raises(ValueError, match="CPU only"):
        encoder(tiny_bert_dir, backend="torch_int8", device="cuda")


def check_close_not_equal(other, fp32, fp32_vectors, bound):
    assert other.side_fingerprint("document") != fp32.side_fingerprint("document")
    assert other.side_fingerprint("query") != fp32.side_fingerprint("query")
    assert other.online_parameters == fp32.online_parameters
    vec = other.encode_documents(TEXTS, batch_size=4).dense
    cos = (vec * fp32_vectors).sum(1)
    assert cos.min() > bound, cos
    return vec


def test_torch_int8_is_close_but_not_fp32(tiny_bert_dir, fp32, fp32_vectors):
    int8 = encoder(tiny_bert_dir, backend="torch_int8")
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in int8.model.modules())
    assert not any(type(m) is torch.nn.Linear for m in int8.model.modules())
    vec = check_close_not_equal(int8, fp32, fp32_vectors, 0.999)
    assert np.abs(vec - fp32_vectors).max() > 1e-4  # it did quantise


def test_onnx_backends(tiny_bert_dir, fp32, fp32_vectors):
    pytest.importorskip("onnxruntime")
    onnx = encoder(tiny_bert_dir, backend="onnx")
    vec = check_close_not_equal(onnx, fp32, fp32_vectors, 0.9999)
    np.testing.assert_allclose(vec, fp32_vectors, atol=1e-5)  # the same fp32 network
    int8 = encoder(tiny_bert_dir, backend="onnx_int8")
    vec8 = check_close_not_equal(int8, fp32, fp32_vectors, 0.999)
    assert np.abs(vec8 - fp32_vectors).max() > 1e-4
    assert int8.side_fingerprint("document") != onnx.side_fingerprint("document")


def test_every_backend_has_its_own_fingerprint(tiny_bert_dir):
    """Identity is computed without loading anything backend-specific, so this checks every backend cheaply."""
    prints = set()
    for backend in BACKENDS:
        enc = encoder(tiny_bert_dir)
        enc.backend = backend
        prints.add(enc.side_fingerprint("document"))
    assert len(prints) == len(BACKENDS)


def test_model_config_backend_reaches_the_encoder(tiny_bert_dir):
    """conf/model/*.yaml `backend:` is what build_encoder builds (the registry must not drop it)."""
    from care.encoders import build_encoder

    enc = build_encoder({"kind": "dense", "name": "tiny", "path": str(tiny_bert_dir), "backend": "torch_int8"},
                        device="cpu")
    assert enc.backend == "torch_int8"
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in enc.model.modules())
    # none named: the app's setting decides (torch here; `auto` is tests/test_inference_backend.py's)
    assert build_encoder({"kind": "dense", "name": "tiny", "path": str(tiny_bert_dir)}, backend="torch").backend == "torch"


def test_training_refuses_an_inference_only_backend(tiny_bert_dir):
    from omegaconf import OmegaConf

    from care.training.model import build_family

    cfg = OmegaConf.create({"model": {"kind": "dense", "name": "tiny", "path": str(tiny_bert_dir),
                                      "backend": "onnx_int8"}})
    with pytest.raises(ValueError, match="backend 'onnx_int8', which only encodes.*model.backend=torch"):
        build_family(cfg)
