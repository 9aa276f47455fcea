"""CARE's training loss (AsymmetricLoss) against a plain formula, and exact GradCache over the two towers."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _care_helpers import root, tiny  # noqa: F401  (module fixtures: training files, the tiny towers)
from omegaconf import OmegaConf

from care.models.towers import Tower, TowerSpec
from care.training import gradcache
from care.training.care_family import CAREFamily
from care.training.gradcache import GradCache
from care.training.losses import AsymmetricLoss

pytestmark = pytest.mark.usefixtures("one_thread")

DOCUMENT = {"pooling": "last_token", "padding_side": "left", "append_eos": True, "max_length": 64}


# ---- 6. the loss and GradCache ----------------------------------------------------------------------------

def reference_loss(q: np.ndarray, p: np.ndarray, group: int, temperature: float, mse_weight: float,
                   positive=lambda i, group: i * group) -> float:
    """CARE's loss written out with loops: InfoNCE over q.d / temperature, + mse_weight x the squared distance
    of each query to its positive, averaged over queries."""
    total = mse = 0.0
    for i in range(len(q)):
        scores = [float(q[i] @ p[j]) / temperature for j in range(len(p))]
        top = max(scores)
        log_sum = top + math.log(sum(math.exp(s - top) for s in scores))
        total += log_sum - scores[positive(i, group)]
        mse += sum((a - b) ** 2 for a, b in zip(q[i], p[positive(i, group)]))
    return total / len(q) + mse_weight * mse / len(q)


@pytest.mark.parametrize("group,mse_weight", [(1, 1.0), (3, 0.0), (3, 0.5)])
def test_asymmetric_loss_matches_the_formula(group, mse_weight):
    rng = np.random.default_rng(group)
    n = 5
    q = rng.normal(size=(n, 8))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    full = rng.normal(size=(n * group, 16))
    p = (full / np.linalg.norm(full, axis=1, keepdims=True))[:, :8]  # cut document vectors, norms below 1
    loss = AsymmetricLoss(temperature=0.05, mse_weight=mse_weight, group_size=group)
    out = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)})
    expected = reference_loss(q, p, group, 0.05, mse_weight)
    assert float(out["loss"]) == pytest.approx(expected, rel=1e-12)
    assert ("mse" in out) == bool(mse_weight)
    if mse_weight:
        assert float(out["loss"]) == pytest.approx(float(out["infonce"]) + mse_weight * float(out["mse"]), rel=1e-12)
    # mixed precisions (stage I: float64 queries, float32 cached documents) give the same value
    mixed = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p).float()})["loss"]
    assert mixed.dtype == torch.float64 and float(mixed) == pytest.approx(expected, rel=1e-6)
    if group > 1:  # the control: the formula tells the pool layout apart (positive i, not i x group)
        assert abs(reference_loss(q, p, group, 0.05, mse_weight, lambda i, g: i) - expected) > 1e-3


def test_asymmetric_loss_refuses_widths_and_pools_that_do_not_fit():
    loss = AsymmetricLoss(group_size=2)
    with pytest.raises(ValueError, match="query vectors are 8-d, document vectors 16-d"):
        loss({"dense": torch.zeros(2, 8)}, {"dense": torch.zeros(4, 16)})
    with pytest.raises(ValueError, match="pool of 3 passages does not fit 2 queries x group size 2"):
        loss({"dense": torch.zeros(2, 8)}, {"dense": torch.zeros(3, 8)})
    with pytest.raises(ValueError, match="temperature must be > 0"):
        AsymmetricLoss(temperature=0)


QUERIES = ["癫痫病人可以怀孕吗", "头痛发烧怎么办", "孩子咳嗽有痰吃什么药", "高血压能治愈吗"]
PASSAGES = ["癫痫患者在医生指导下可以怀孕", "胃疼吃什么药", "失眠怎么调理",
            "发烧头痛可以先物理降温，多喝水", "腰疼是肾的问题吗", "感冒流鼻涕怎么办",
            "小儿咳嗽有痰可以拍背，遵医嘱用药", "糖尿病人能吃西瓜吗", "肚子胀气怎么办",
            "高血压需要长期服药控制", "脚踝扭伤怎么处理", "眼睛干涩怎么办"]


def two_towers(tiny: Path, lora: bool):
    """A float64 query tower (dropout 0.1) and document tower, cut to 32-d: with a LoRA (dropout 0.1, non-zero
    B so every adapter weight gets a gradient) or fully trainable."""
    query = Tower.load(TowerSpec(path=str(tiny / "query")), "model.query", torch.float64).train()
    document = Tower.load(TowerSpec(path=str(tiny / "document"), **DOCUMENT), "model.document", torch.float64)
    document.truncate_dim = 32
    if lora:
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        document = CAREFamily._with_lora(document, {"r": 4, "alpha": 8, "dropout": 0.1},
                                         OmegaConf.create({"gradient_checkpointing": False}))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in document.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.1)
    return query, document.train()


def grads(*towers) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad.clone() for i, t in enumerate(towers) for n, p in t.named_parameters() if p.requires_grad}


def run_both(tiny: Path, lora: bool, chunk: int = 5):
    """(losses, grads) of plain autograd over the whole pool and of GradCache, from the same towers and RNG.
    The reference forwards the same chunks in the same order (query chunks, then passage chunks)."""
    loss_fn = AsymmetricLoss(temperature=0.05, mse_weight=0.5, group_size=3)
    results = []
    for cached in (False, True):
        query, document = two_towers(tiny, lora)
        qb, pb = query.tokenize(QUERIES), document.tokenize(PASSAGES)
        torch.manual_seed(7)
        if cached:
            losses = GradCache(loss_fn, chunk_size=chunk).step(query, qb, pb, passage_model=document)
        else:
            def forward(m, batch):
                outs = [m(**{k: v[s:s + chunk] for k, v in batch.items()})["dense"]
                        for s in range(0, len(batch["input_ids"]), chunk)]
                return {"dense": torch.cat(outs)}
            out = loss_fn(forward(query, qb), forward(document, pb))
            out["loss"].backward()
            losses = {k: float(v.detach()) for k, v in out.items()}
        results.append((losses, grads(query, document)))
    return results


@pytest.mark.parametrize("lora", [True, False], ids=["lora_document", "trainable_document"])
def test_gradcache_over_two_towers_equals_the_plain_step(tiny, lora):
    (ref_loss, ref), (gc_loss, got) = run_both(tiny, lora)
    for k in ("loss", "infonce", "mse"):
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12), k
    assert set(got) == set(ref)
    if lora:  # the document tower trains only its adapter, on every projection
        document = [n for n in ref if n.startswith("1.")]
        assert document and all("lora_" in n for n in document)
    assert any(n.startswith("0.") for n in ref)
    for name in ref:
        assert float(ref[name].abs().max()) > 0, name
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)


def test_gradcache_over_two_towers_needs_the_rng_restored(tiny, monkeypatch):
    """The control of the test above: both towers draw dropout masks, so without restoring the RNG state per
    chunk the re-forward draws other masks and the gradients of both towers are wrong."""
    monkeypatch.setattr(gradcache.RngState, "restore", lambda self: None)
    (_, ref), (_, got) = run_both(tiny, lora=True)
    for tower in ("0.", "1."):
        worst = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in ref if n.startswith(tower))
        assert worst > 1e-3, tower
