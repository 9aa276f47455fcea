"""Matryoshka widths in training (issue #22, item 4): the InfoNCE of each prefix of the full-width unit vectors
(cut, not re-normalised: the project's convention) added to the full width's, in M3Loss's dense head and in
CARE's AsymmetricLoss; against a numpy formula, GradCache exact, bit-identical to the loss before the
change when off, and the widths a model cannot give refused at the run's start."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import _gradcache_dist_worker as worker
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _care_helpers import root, tiny, todays_asymmetric, train_overrides  # noqa: F401  (module fixtures: training files, towers)
from _training_helpers import make_training_files, train_config
from hydra.utils import instantiate
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import read_jsonl
from care.models.m3 import tiny_m3
from care.paths import PROJECT_ROOT
from care.training.care_recipe import stage_config
from care.training.gradcache import GradCache
from care.training.head_scores import HEAD_SCORES
from care.training.loss_terms import at_least_fp32, info_nce, pool_group_size
from care.training.losses import AsymmetricLoss, M3Loss
from care.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def logsumexp(x: np.ndarray) -> float:
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()))


def info_nce_reference(scores: np.ndarray, group: int) -> float:
    return float(np.mean([logsumexp(scores[i]) - scores[i, i * group] for i in range(len(scores))]))


def unit(rng, n, d):
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def prefix_terms(q, p, dims, weights, temperature, group, renormalise=False):
    """sum_d w_d InfoNCE(q[:, :d] . p[:, :d] / temperature) of the full-width unit vectors."""
    total = 0.0
    for d, w in zip(dims, weights):
        qd, pd = q[:, :d], p[:, :d]
        if renormalise:  # FlagEmbedding's MRL, the control
            qd, pd = (x / np.linalg.norm(x, axis=1, keepdims=True) for x in (qd, pd))
        total += w * info_nce_reference(qd @ pd.T / temperature, group)
    return total


# ---- the formula ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", [None, [0.5, 2.0]])
def test_asymmetric_prefixes_match_the_formula(weights):
    rng = np.random.default_rng(1)
    n, group, temperature, dims = 5, 3, 0.05, [4, 8]
    q, p = unit(rng, n, 16), unit(rng, n * group, 16)
    loss = AsymmetricLoss(temperature=temperature, mse_weight=0.5, group_size=group, matryoshka_dims=dims,
                          matryoshka_weights=weights)
    out = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)})
    w = weights or [1.0, 1.0]
    full = info_nce_reference(q @ p.T / temperature, group)
    mse = float(np.mean(((q - p[::group]) ** 2).sum(1)))  # the MSE stays at the full width
    expected = full + 0.5 * mse + prefix_terms(q, p, dims, w, temperature, group)
    assert float(out["loss"]) == pytest.approx(expected, rel=1e-12)
    for d in dims:
        assert float(out[f"infonce_dim{d}"]) == pytest.approx(
            info_nce_reference(q[:, :d] @ p[:, :d].T / temperature, group), rel=1e-12)
    assert float(out["infonce"]) == pytest.approx(full, rel=1e-12)
    # the control: re-normalised prefixes (FlagEmbedding's MRL) give another value
    assert abs(prefix_terms(q, p, dims, w, temperature, group, renormalise=True)
               - prefix_terms(q, p, dims, w, temperature, group)) > 1e-3


@pytest.mark.parametrize("preset", ["equal", "flagembedding"])
def test_m3_dense_prefixes_match_the_formula(preset):
    """All three heads of a tiny M3 model: the prefixes add weights.dense x sum_d w_d L_dense[:d] to the main
    loss (halved with it under the preset's self-distillation); every other term is unchanged."""
    model = tiny_m3(dropout=0.0).double().eval()
    queries, passages = worker.medical_batch()
    with torch.no_grad():
        q = model(**worker.tokenize(model.tokenizer, queries))
        p = model(**worker.tokenize(model.tokenizer, passages))
    dims, weights = [8, 32], [1.0, 0.25]
    plain = loss_preset(preset, group_size=worker.GROUP)
    cut = loss_preset(preset, group_size=worker.GROUP, matryoshka_dims=dims, matryoshka_weights=weights)
    base, out = plain(q, p), cut(q, p)
    w_dense, temperature = plain.weights["dense"], plain.temperature["dense"]
    extra = w_dense * prefix_terms(q["dense"].numpy(), p["dense"].numpy(), dims, weights, temperature, worker.GROUP)
    halved = 2 if plain.self_distill else 1
    assert float(out["loss"]) == pytest.approx(float(base["loss"]) + extra / halved, rel=1e-12)
    assert set(out) == set(base) | {"dense_dim8", "dense_dim32"}
    for k in base:
        if k != "loss":
            assert torch.equal(out[k], base[k]), k


# ---- GradCache -----------------------------------------------------------------------------------------

def loss_preset(name: str, **overrides):
    return instantiate(OmegaConf.load(PROJECT_ROOT / "conf" / "loss" / f"{name}.yaml"), **overrides, _convert_="all")


def run_both(loss_fn, passage_seed=None, chunk=2):
    """(losses, grads) of plain autograd (the same chunks in the same order) and of GradCache; with
    `passage_seed` a second tiny model is the document tower (a two-tower loss, as CARE's)."""
    queries, passages = worker.medical_batch()
    results = []
    for cached in (False, True):
        query = tiny_m3(dropout=0.1).double().train()
        document = tiny_m3(seed=passage_seed, dropout=0.1).double().train() if passage_seed else query
        qb, pb = worker.tokenize(query.tokenizer, queries), worker.tokenize(document.tokenizer, passages)
        torch.manual_seed(7)
        if cached:
            losses = GradCache(loss_fn, chunk_size=chunk).step(query, qb, pb, passage_model=document)
        else:
            def forward(m, batch):
                outs = [m(**{k: v[s:s + chunk] for k, v in batch.items()}) for s in range(0, len(batch["input_ids"]), chunk)]
                return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
            out = loss_fn(forward(query, qb), forward(document, pb))
            out["loss"].backward()
            losses = {k: float(v.detach()) for k, v in out.items()}
        towers = (query,) if document is query else (query, document)
        results.append((losses, {f"{i}.{n}": p.grad for i, t in enumerate(towers) for n, p in t.named_parameters()}))
    return results


@pytest.mark.parametrize("which", ["m3_equal", "m3_flagembedding", "asymmetric"])
def test_gradcache_with_prefixes_equals_the_plain_step(which):
    if which == "asymmetric":
        loss_fn = AsymmetricLoss(temperature=0.05, mse_weight=0.5, group_size=worker.GROUP, matryoshka_dims=[8, 40])
        (ref_loss, ref), (gc_loss, got) = run_both(loss_fn, passage_seed=1)
        assert {"infonce_dim8", "infonce_dim40"} <= set(gc_loss)
    else:
        loss_fn = loss_preset(which[3:], group_size=worker.GROUP, matryoshka_dims=[16, 32], matryoshka_weights=[2.0, 0.5])
        (ref_loss, ref), (gc_loss, got) = run_both(loss_fn)
        assert {"dense_dim16", "dense_dim32"} <= set(gc_loss)
    for k in ref_loss:
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12), k
    assert any(g is not None for g in ref.values())
    for name in ref:
        if ref[name] is None:  # AsymmetricLoss reads the dense vectors only: the other heads get no gradient
            assert got[name] is None and which == "asymmetric", name
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-7, atol=1e-9, msg=name)


# ---- off: bit-identical to the loss before the change -----------------------------------------------------

def todays_m3(loss: M3Loss, q: dict, p: dict) -> dict:
    """M3Loss.forward as it was before the extras (care/training/losses.py at commit bce6e37), op for op."""
    group = pool_group_size(len(q["dense"]), len(p["dense"]), loss.group_size)
    q, p = ({k: at_least_fp32(v) if v.is_floating_point() else v for k, v in r.items()} for r in (q, p))
    mixed = loss.weights["ensemble"] > 0 or loss.self_distill
    heads = [h for h in ("dense", "sparse", "colbert") if loss.weights[h] > 0 or (mixed and loss.ensemble_mix[h] > 0)]
    scores = {h: HEAD_SCORES[h](q, p) / loss.temperature[h] for h in heads}
    out = {h: info_nce(s, group) for h, s in scores.items()}
    if mixed:
        ensemble = sum(loss.ensemble_mix[h] * scores[h] for h in scores)
        out["ensemble"] = info_nce(ensemble, group)
    total = sum(loss.weights[k] * v for k, v in out.items())
    if loss.self_distill:
        def distill_ce(teacher, student):
            targets = torch.softmax(at_least_fp32(teacher.detach()), dim=-1)
            return -(targets * torch.log_softmax(at_least_fp32(student), dim=-1)).sum(-1).mean()
        distill = [loss.distill_weights[h] * distill_ce(ensemble, scores[h]) for h in scores]
        out["distill"] = sum(distill) / len(distill)
        total = (total + out["distill"]) / 2
    return {"loss": total, **out}


def leaves(reps: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in reps.items()}


@pytest.mark.parametrize("preset", ["equal", "flagembedding"])
@pytest.mark.parametrize("off", [{}, {"matryoshka_dims": []}, {"matryoshka_dims": None, "matryoshka_weights": None}])
def test_off_is_bit_identical_to_todays_m3_loss(preset, off):
    model = tiny_m3(dropout=0.0).eval()  # float32: the least forgiving of a changed order of operations
    queries, passages = worker.medical_batch()
    with torch.no_grad():
        q0 = model(**worker.tokenize(model.tokenizer, queries))
        p0 = model(**worker.tokenize(model.tokenizer, passages))
    loss = loss_preset(preset, group_size=worker.GROUP, **off)
    results = []
    for forward in (loss, lambda q, p: todays_m3(loss, q, p)):
        q, p = leaves(q0), leaves(p0)
        out = forward(q, p)
        out["loss"].backward()
        results.append((out, {f"{side}.{k}": v.grad for side, r in (("q", q), ("p", p)) for k, v in r.items()
                              if v.grad is not None}))
    (new, new_grads), (old, old_grads) = results
    assert set(new) == set(old)
    for k in old:
        assert torch.equal(new[k], old[k]), k
    assert set(new_grads) == set(old_grads) and new_grads
    for k in old_grads:
        assert torch.equal(new_grads[k], old_grads[k]), k


@pytest.mark.parametrize("mse_weight", [0.0, 1.0])
def test_off_is_bit_identical_to_todays_asymmetric_loss(mse_weight):
    rng = np.random.default_rng(2)
    q0 = {"dense": torch.from_numpy(unit(rng, 4, 16)).float()}
    p0 = {"dense": torch.from_numpy(unit(rng, 12, 24)[:, :16]).float()}  # a cut document side
    loss = AsymmetricLoss(temperature=0.02, mse_weight=mse_weight, group_size=3, matryoshka_dims=[])
    results = []
    for forward in (loss, lambda q, p: todays_asymmetric(loss, q, p)):
        q, p = leaves(q0), leaves(p0)
        out = forward(q, p)
        out["loss"].backward()
        results.append((out, q["dense"].grad, p["dense"].grad))
    (new, *new_grads), (old, *old_grads) = results
    assert set(new) == set(old) and all(torch.equal(new[k], old[k]) for k in old)
    assert all(torch.equal(a, b) for a, b in zip(new_grads, old_grads))


# ---- refusals and tiny runs ----------------------------------------------------------------------------

def test_widths_that_cannot_be_prefixes_are_refused():
    for dims, match in (([0, 8], "each width must be a positive integer"), ([-4], "positive integer"),
                        ([8, 8], "listed twice"), ([8.5], "positive integer")):
        with pytest.raises(ValueError, match=match):
            AsymmetricLoss(matryoshka_dims=dims)
    with pytest.raises(ValueError, match=r"matryoshka_weights=\[1.0\] has 1 weights for 2 matryoshka_dims"):
        M3Loss(matryoshka_dims=[8, 16], matryoshka_weights=[1.0])
    with pytest.raises(ValueError, match="prefixes of the dense head, whose loss weight is 0"):
        M3Loss(weights={"dense": 0.0}, matryoshka_dims=[8])
    loss = AsymmetricLoss(matryoshka_dims=[8, 16], group_size=1)
    with pytest.raises(ValueError, match=r"loss.matryoshka_dims=\[8, 16\]: \[16\] not below the model's 16-d vectors"):
        loss({"dense": torch.eye(16)[:2]}, {"dense": torch.eye(16)[:2]})


def test_tiny_m3_run_refuses_a_full_width_and_trains_prefixes(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    with pytest.raises(ValueError, match=r"^loss.matryoshka_dims=\[16, 64\]: \[64\] not below the model's 64-d vectors"):
        Trainer(train_config(tmp_path, texts, train, "refused", "loss.matryoshka_dims=[16,64]",
                             "trainer.query_side_pools=[]"))
    assert not (tmp_path / "refused" / "checkpoints").exists()
    Trainer(train_config(tmp_path, texts, train, "run", "loss.matryoshka_dims=[16,32]", "trainer.max_steps=2",
                         "trainer.query_side_pools=[]")).fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss/loss" in r]
    assert len(rows) == 2 and all(np.isfinite([r["loss/loss"], r["loss/dense_dim16"], r["loss/dense_dim32"]]).all()
                                  for r in rows)


def test_care_stage1_trains_prefixes_and_names_its_key_when_refused(root, tiny, tmp_path):
    """care_tiny's query tower is 32-d (its document tower, 64-d, is cut to it)."""
    def config(run, dims):
        return load_config("train", train_overrides(root, run, f"model.query.path={tiny / 'query'}",
                                                    f"model.document.path={tiny / 'document'}",
                                                    f"model.stages.stage1.loss.matryoshka_dims={dims}"))
    with pytest.raises(ValueError, match=r"model.stages.stage1.loss.matryoshka_dims=\[32\]: \[32\] not below the "
                                         r"model's 32-d vectors"):
        Trainer(stage_config(config(tmp_path / "refused", "[32]"), "stage1", tmp_path / "refused"))
    Trainer(stage_config(config(tmp_path / "run", "[8,16]"), "stage1", tmp_path / "run")).fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "stage1" / "metrics.jsonl") if "loss/loss" in r]
    assert len(rows) == 4
    for r in rows:
        assert r["loss/loss"] == pytest.approx(r["loss/infonce"] + r["loss/mse"] + r["loss/infonce_dim8"]
                                               + r["loss/infonce_dim16"], rel=1e-5)


def test_prefix_of_a_unit_vector_is_not_renormalised():
    """The convention itself: the prefix score of AsymmetricLoss is the cut dot product, below 1 in norm."""
    q = F.normalize(torch.tensor([[3.0, 4.0, 12.0]], dtype=torch.float64), dim=-1)
    p = q.clone()
    out = AsymmetricLoss(temperature=1.0, mse_weight=0.0, group_size=1, matryoshka_dims=[2])(
        {"dense": torch.cat([q, -q])}, {"dense": torch.cat([p, -p])})
    cut = float(q[0, :2] @ q[0, :2])  # 25/169, not 1
    expected = np.log(np.exp(cut) + np.exp(-cut)) - cut
    assert float(out["infonce_dim2"]) == pytest.approx(expected, rel=1e-12)
