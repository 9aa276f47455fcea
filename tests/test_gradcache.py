"""GradCache is exact: its gradients equal the plain (uncached) ones, with dropout, frozen towers, bf16
autocast, and across two processes with gathered negatives.

The uncached reference keeps the whole graph and consumes the RNG in the same chunk order (a forward of 4
texts draws different dropout masks from two forwards of 2), so any difference is GradCache's own.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from care.models.m3 import tiny_m3
from care.paths import PROJECT_ROOT
from care.training import gradcache, head_scores
from care.training.gradcache import GradCache
from care.training.losses import M3Loss

WORKER = Path(__file__).with_name("_gradcache_dist_worker.py")
spec = importlib.util.spec_from_file_location("_gradcache_dist_worker", WORKER)
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)


pytestmark = pytest.mark.usefixtures("one_thread")


def preset(name: str) -> M3Loss:
    return instantiate(OmegaConf.load(PROJECT_ROOT / "conf" / "loss" / f"{name}.yaml"), group_size=worker.GROUP)


def batches(model):
    queries, passages = worker.medical_batch()
    return worker.tokenize(model.tokenizer, queries), worker.tokenize(model.tokenizer, passages)


def chunks(batch: dict, size: int) -> list[dict]:
    n = len(batch["input_ids"])
    return [{k: v[s:s + size] for k, v in batch.items()} for s in range(0, n, size)]


def uncached(model, loss_fn, qb, pb, chunk, passage_model=None, autocast=contextlib.nullcontext):
    """Plain autograd over the whole pool: one graph, one backward.  Autocast wraps each forward alone, as in
    GradCache: one context around all chunks would share one cached bf16 copy of each weight, whose
    gradient then accumulates in bf16 (~1% off)."""
    passage_model = passage_model or model

    def forward(m, c):
        with autocast(), torch.set_grad_enabled(any(p.requires_grad for p in m.parameters())):
            return m(**c)

    q = [forward(model, c) for c in chunks(qb, chunk)]
    p = [forward(passage_model, c) for c in chunks(pb, chunk)]

    def cat(outs):
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    out = loss_fn(cat(q), cat(p))
    out["loss"].backward()
    return {k: float(v.detach()) for k, v in out.items()}


def run_both(make_model, loss_fn, chunk, seed=7, **kw):
    """(losses, grads) of the uncached reference and of GradCache, from identical models and RNG."""
    results = []
    for cached in (False, True):
        model = make_model()
        qb, pb = batches(model)
        torch.manual_seed(seed)
        if cached:
            losses = GradCache(loss_fn, chunk_size=chunk, autocast=kw.get("autocast")).step(
                model, qb, pb, passage_model=kw.get("passage_model"))
        else:
            losses = uncached(model, loss_fn, qb, pb, chunk, kw.get("passage_model"),
                              kw.get("autocast") or contextlib.nullcontext)
        results.append((losses, {n: p.grad for n, p in model.named_parameters()}))
    return results


@pytest.mark.parametrize("loss_name,chunk", [("equal", 2), ("flagembedding", 5)])
def test_cached_equals_uncached_with_dropout(loss_name, chunk):
    loss_fn = preset(loss_name)
    (ref_loss, ref), (gc_loss, got) = run_both(lambda: tiny_m3(dropout=0.1).double().train(), loss_fn, chunk)
    assert {"dense", "sparse", "colbert"} <= set(gc_loss)
    for k in ref_loss:
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12)
    assert all(g is not None for g in ref.values())
    for name in ref:  # every parameter: backbone, ColBERT head, sparse head
        torch.testing.assert_close(got[name], ref[name], rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize("blocks", ["1x1", "2 queries x 1", "all x 5 passages"])
def test_cached_in_colbert_blocks_equals_uncached_in_one(blocks, monkeypatch):
    """Issue #14: the loss over the cached pool computes the ColBERT score in blocks (1 query x 1 passage,
    query slices, passage slices that do not divide the pool of 12); its gradients still equal the uncached
    step's, whose score is one block (the whole similarity tensor)."""
    loss_fn = preset("flagembedding")  # all three heads, ensemble and self-distillation

    def step(cached: bool):
        model = tiny_m3(dropout=0.1).double().train()
        qb, pb = batches(model)
        torch.manual_seed(7)
        losses = (GradCache(loss_fn, chunk_size=5).step(model, qb, pb) if cached
                  else uncached(model, loss_fn, qb, pb, 5))
        return losses, {n: p.grad for n, p in model.named_parameters()}, qb, pb

    ref_loss, ref, qb, pb = step(cached=False)
    (n_q, q_len), (n_p, p_len) = ((len(b["input_ids"]), b["input_ids"].shape[1] - 1) for b in (qb, pb))
    assert head_scores._colbert_blocks(n_q, q_len, n_p, p_len) == (n_q, n_p)  # the reference: one block
    budget, want = {"1x1": (1, (1, 1)), "2 queries x 1": (2 * q_len * p_len, (2, 1)),
                    "all x 5 passages": (5 * n_q * q_len * p_len, (n_q, 5))}[blocks]
    monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", budget)
    assert head_scores._colbert_blocks(n_q, q_len, n_p, p_len) == want
    gc_loss, got, _, _ = step(cached=True)
    for k in ref_loss:
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12), k
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-7, atol=1e-9, msg=name)


def test_without_rng_restore_dropout_differs(monkeypatch):
    """The equality above depends on restoring the RNG per chunk: without it the gradients are wrong."""
    monkeypatch.setattr(gradcache.RngState, "restore", lambda self: None)
    (_, ref), (_, got) = run_both(lambda: tiny_m3(dropout=0.1).double().train(), preset("equal"), 2)
    worst = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-12)) for n in ref)
    assert worst > 1e-3


def test_frozen_tower_and_frozen_parameters():
    """CARE stage I: the document tower is frozen; part of the query tower too.  Frozen parameters get no
    gradient, the frozen tower runs once per chunk, and the rest matches the uncached gradients."""
    frozen_tower = tiny_m3(seed=1, dropout=0.1).double().train().requires_grad_(False)
    calls = []
    frozen_tower.register_forward_hook(lambda *a: calls.append(1))

    def query_tower():
        m = tiny_m3(dropout=0.1).double().train()
        m.backbone.embeddings.requires_grad_(False)
        return m

    (ref_loss, ref), (gc_loss, got) = run_both(query_tower, preset("equal"), 2, passage_model=frozen_tower)
    n_passage_chunks = -(-worker.N_QUERIES * worker.GROUP // 2)
    assert len(calls) == 2 * n_passage_chunks  # once in the reference, once in GradCache: no re-forward
    assert all(p.grad is None for p in frozen_tower.parameters())
    for name, g in got.items():
        if name.startswith("backbone.embeddings."):
            assert g is None, name
        else:
            torch.testing.assert_close(g, ref[name], rtol=1e-7, atol=1e-9, msg=name)
    assert gc_loss["loss"] == pytest.approx(ref_loss["loss"], rel=1e-12)


def test_bf16_autocast_matches_uncached():
    """bf16 forwards under autocast, loss in fp32, no loss scaling: same gradients as plain bf16 autograd."""
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    (ref_loss, ref), (gc_loss, got) = run_both(lambda: tiny_m3(dropout=0.1).train(), preset("equal"), 2,
                                               autocast=autocast)
    assert gc_loss["loss"] == pytest.approx(ref_loss["loss"], rel=1e-6)
    for name in ref:
        assert got[name].dtype == torch.float32
        scale = float(ref[name].abs().max())
        assert float((got[name] - ref[name]).abs().max()) <= 1e-5 * scale + 1e-8, name


def test_heads_on_detached_features():
    """backbone_heads=[dense]: the backbone gets exactly the dense loss's gradient, the sparse and ColBERT
    heads exactly the gradient they get when all three losses train the backbone, and GradCache agrees."""
    def model(backbone_heads=("dense", "sparse", "colbert")):
        def make():
            m = tiny_m3(dropout=0.1).double().train()
            m.set_backbone_heads(backbone_heads)
            return m
        return make

    dense_only = M3Loss(weights={"dense": 1.0, "sparse": 0.0, "colbert": 0.0}, group_size=worker.GROUP)
    (_, detached), (_, detached_gc) = run_both(model(["dense"]), preset("equal"), 2)
    (_, reference_backbone), _ = run_both(model(), dense_only, 2)
    (_, all_heads), _ = run_both(model(), preset("equal"), 2)
    for name, g in detached.items():
        torch.testing.assert_close(detached_gc[name], g, rtol=1e-7, atol=1e-9, msg=name)
        if name.startswith("backbone."):
            torch.testing.assert_close(g, reference_backbone[name], rtol=1e-7, atol=1e-12, msg=name)
        else:  # the heads still learn, as much as with the shared gradient
            assert float(g.abs().max()) > 0, name
            torch.testing.assert_close(g, all_heads[name], rtol=1e-7, atol=1e-12, msg=name)
    moved = max(float((all_heads[n] - detached[n]).abs().max()) for n in detached if n.startswith("backbone."))
    assert moved > 1e-6  # the sparse and ColBERT losses do reach the backbone when not detached


def test_backbone_heads_must_name_heads():
    model = tiny_m3(dropout=0.0)
    for bad in ([], ["dense", "bm25"]):
        with pytest.raises(ValueError, match="backbone_heads=.*name one or more of dense, sparse, colbert"):
            model.set_backbone_heads(bad)


def test_pool_that_does_not_fit_is_a_clear_error():
    model = tiny_m3(dropout=0.0).double()
    qb, pb = batches(model)
    pb = {k: v[:-1] for k, v in pb.items()}  # 11 passages for 4 queries x group 3
    with pytest.raises(ValueError, match=r"pool of 11 passages does not fit 4 queries x group size 3"):
        GradCache(M3Loss(group_size=3), chunk_size=2).step(model, qb, pb)
    assert all(p.grad is None for p in model.parameters())  # nothing was back-propagated
    with pytest.raises(ValueError, match="pool of 11 passages does not split into groups for 4 queries"):
        GradCache(M3Loss(), chunk_size=2).step(model, qb, pb)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        GradCache(M3Loss(), chunk_size=0)


def test_two_processes_equal_one_process(tmp_path):
    """torchrun, 2 gloo processes (accelerate, DDP), half the batch each, negatives gathered across them:
    the gradients equal one process on the whole batch; without the world-size factor they are half."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    model = tiny_m3(dropout=0.0).double()
    qb, pb = batches(model)
    ref_loss = uncached(model, M3Loss(group_size=worker.GROUP), qb, pb, chunk=len(pb["input_ids"]))
    ref = worker.grads(model)
    scaled = [torch.load(tmp_path / f"scaled_rank{r}.pt") for r in (0, 1)]
    unscaled = torch.load(tmp_path / "unscaled_rank0.pt")["grads"]
    assert set(scaled[0]["grads"]) == set(ref)
    assert scaled[0]["lengths"] != scaled[1]["lengths"]  # the ranks padded differently: gathering re-pads
    for k, v in ref_loss.items():
        assert scaled[0]["losses"][k] == pytest.approx(v, rel=1e-10)
    for name in ref:
        torch.testing.assert_close(scaled[0]["grads"][name], ref[name], rtol=1e-6, atol=1e-9, msg=name)
        torch.testing.assert_close(scaled[1]["grads"][name], scaled[0]["grads"][name], rtol=0, atol=0)
        torch.testing.assert_close(unscaled[name], ref[name] / 2, rtol=1e-6, atol=1e-9, msg=name)
