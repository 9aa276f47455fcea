"""Distillation from the training file's teacher scores (issue #22, item 3): both kd types against a numpy
formula and against FlagEmbedding's own M3 loss, GradCache exact with teacher scores, the groups drawn the
same with and without teacher fields (their scores aligned with the draws), the refusals, and tiny runs."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import json

import _gradcache_dist_worker as worker
import numpy as np
import pytest
import torch
from _care_helpers import root, tiny, train_overrides  # noqa: F401  (module fixtures: training files, towers)
from _training_helpers import make_training_files, train_config
from FlagEmbedding.finetune.embedder.encoder_only.m3.modeling import EncoderOnlyEmbedderM3Model
from hydra.utils import instantiate
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import DataError, read_jsonl, write_jsonl
from care.models.m3 import tiny_m3
from care.paths import PROJECT_ROOT
from care.training.care_recipe import stage_config
from care.training.data import TrainingGroups, collate_groups
from care.training.gradcache import GradCache
from care.training.losses import AsymmetricLoss, M3Loss
from care.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ("kl_div", "m3_kd_loss")


# ---- the formula, written out -------------------------------------------------------------------------

def logsumexp(x: np.ndarray) -> float:
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()))


def kd_reference(kind: str, scores: np.ndarray, teacher: np.ndarray, group: int, tau: float,
                 rows: list[int] | None = None) -> float:
    """The distillation term with loops.  targets = softmax(teacher / tau) per query.  kl_div: cross-entropy of
    the targets against the log-softmax of the query's own group's scores, averaged over queries.
    m3_kd_loss: for each group position k, the cross-entropy of the query's whole row against member k, the
    members before k left out of the row, weighted by target k and averaged over queries; summed over k.
    `rows`: the queries averaged over (default all)."""
    rows = list(range(len(scores))) if rows is None else rows
    t = np.exp(teacher / tau - (teacher / tau).max(1, keepdims=True))
    t /= t.sum(1, keepdims=True)
    if kind == "kl_div":
        total = 0.0
        for i in rows:
            own = scores[i, i * group:(i + 1) * group]
            total -= sum(t[i, k] * (own[k] - logsumexp(own)) for k in range(group))
        return total / len(rows)
    total = 0.0
    for k in range(group):
        per_query = []
        for i in rows:
            keep = [j for j in range(scores.shape[1]) if not i * group <= j < i * group + k]
            per_query.append(t[i, k] * (logsumexp(scores[i, keep]) - scores[i, i * group + k]))
        total += float(np.mean(per_query))
    return total


def info_nce_reference(scores: np.ndarray, group: int) -> float:
    return float(np.mean([logsumexp(scores[i]) - scores[i, i * group] for i in range(len(scores))]))


def unit(rng, n, d):
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("tau", [1.0, 0.5])
@pytest.mark.parametrize("kind", KINDS)
def test_asymmetric_teacher_term_matches_the_formula(kind, tau):
    rng = np.random.default_rng(3)
    n, group, temperature = 5, 4, 0.05
    q, p = unit(rng, n, 8), unit(rng, n * group, 8)
    teacher = rng.normal(scale=3.0, size=(n, group))
    loss = AsymmetricLoss(temperature=temperature, mse_weight=0.0, group_size=group, teacher_weight=0.7,
                          teacher_temperature=tau, kd_loss_type=kind)
    out = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)}, teacher_scores=torch.from_numpy(teacher))
    scores = q @ p.T / temperature
    expected = kd_reference(kind, scores, teacher, group, tau)
    assert float(out["teacher"]) == pytest.approx(expected, rel=1e-12)
    assert float(out["loss"]) == pytest.approx(info_nce_reference(scores, group) + 0.7 * expected, rel=1e-12)
    # the controls: the temperature and the kd type each change the value
    assert abs(kd_reference(kind, scores, teacher, group, 2 * tau) - expected) > 1e-3
    other = KINDS[1 - KINDS.index(kind)]
    assert abs(kd_reference(other, scores, teacher, group, tau) - expected) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_without_teacher_scores_is_left_out_of_the_term(kind):
    """A NaN row (a group of borrowed random passages) adds nothing: the term is the formula's over the
    scored queries alone, each in its place in the pool; a batch with no scored row gives 0 (and a graph)."""
    rng = np.random.default_rng(7)
    n, group, temperature = 5, 3, 0.05
    q, p = unit(rng, n, 8), unit(rng, n * group, 8)
    teacher = rng.normal(scale=3.0, size=(n, group))
    teacher[[1, 3]] = np.nan
    loss = AsymmetricLoss(temperature=temperature, mse_weight=0.0, group_size=group, teacher_weight=1.0,
                          kd_loss_type=kind)
    qt = torch.from_numpy(q).requires_grad_()
    out = loss({"dense": qt}, {"dense": torch.from_numpy(p)}, teacher_scores=torch.from_numpy(teacher))
    scores = q @ p.T / temperature
    expected = kd_reference(kind, scores, teacher, group, 1.0, rows=[0, 2, 4])
    assert float(out["teacher"].detach()) == pytest.approx(expected, rel=1e-12)
    out["loss"].backward()
    assert torch.isfinite(qt.grad).all()
    none = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)},
                teacher_scores=torch.full((n, group), float("nan"), dtype=torch.float64))
    assert float(none["teacher"]) == 0.0 and float(none["loss"]) == pytest.approx(info_nce_reference(scores, group))


@pytest.mark.parametrize("kind", KINDS)
def test_m3_teacher_term_per_head_matches_the_formula(kind):
    """M3Loss distils each head it trains (teacher_heads null = `weights`) from the head's scores / its own
    temperature; here only dense trains, at weight 2, so teacher = 2 x KD_dense."""
    rng = np.random.default_rng(4)
    n, group = 4, 3
    q, p = unit(rng, n, 16), unit(rng, n * group, 16)
    teacher = rng.normal(scale=2.0, size=(n, group))
    loss = M3Loss(temperature={"dense": 0.05, "sparse": 0.02, "colbert": 0.02},
                  weights={"dense": 2.0, "sparse": 0.0, "colbert": 0.0}, group_size=group,
                  teacher_weight=0.5, teacher_temperature=0.8, kd_loss_type=kind)
    out = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)}, teacher_scores=torch.from_numpy(teacher))
    scores = q @ p.T / 0.05
    kd = kd_reference(kind, scores, teacher, group, 0.8)
    assert set(out) == {"loss", "dense", "teacher", "teacher_dense"}
    assert float(out["teacher_dense"]) == pytest.approx(kd, rel=1e-12)
    assert float(out["teacher"]) == pytest.approx(2.0 * kd, rel=1e-12)
    assert float(out["loss"]) == pytest.approx(2.0 * info_nce_reference(scores, group) + 0.5 * 2.0 * kd, rel=1e-12)


# ---- FlagEmbedding's own M3 loss with teacher scores -----------------------------------------------------

def flag_batches(model, shared):
    """Real KUAKE-QTR queries and titles; passages cut to one length with no padding, where FlagEmbedding's
    training ColBERT score and ours agree (tests/test_m3.py, unpadded_batches)."""
    rows = json.loads((shared / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    queries = [r["query"] for r in rows[:4]]
    titles = [r["title"] for r in rows[:40] if len(r["title"]) >= 14][:12]
    tok = model.tokenizer
    qb = dict(tok(queries, padding=True, return_tensors="pt"))
    pb = dict(tok(titles, padding="max_length", truncation=True, max_length=12, return_tensors="pt"))
    assert bool(pb["attention_mask"].all())
    return qb, pb


def loss_preset(name: str, **overrides) -> M3Loss:
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "loss" / f"{name}.yaml")
    return instantiate(cfg, **overrides, _convert_="all")


@pytest.mark.parametrize("kind", KINDS)
def test_flagembedding_preset_with_teacher_scores_equals_flagembeddings_loss(kind, shared):
    """FlagEmbedding 1.4.2's M3 forward with teacher scores: kl_div adds KD_h to each head's InfoNCE
    (teacher_weight 1 on the preset as is); m3_kd_loss replaces each head's InfoNCE by KD_h (weights 0,
    teacher_heads = the preset's weights).  Self-distillation on, as the preset."""
    model = tiny_m3(dropout=0.0)
    qb, pb = flag_batches(model, shared)
    teacher = torch.tensor(np.random.default_rng(5).normal(scale=2.0, size=(4, 3)), dtype=torch.float32)
    flag = EncoderOnlyEmbedderM3Model(
        {"model": model.backbone, "colbert_linear": model.colbert_linear, "sparse_linear": model.sparse_linear},
        tokenizer=model.tokenizer, temperature=0.02, normalize_embeddings=True, use_self_distill=True,
        kd_loss_type=kind).train()
    expected = flag(queries=qb, passages=pb, teacher_scores=teacher.flatten().tolist()).loss.item()
    weights = {"dense": 0.25, "sparse": 0.025, "colbert": 0.25, "ensemble": 0.25}
    if kind == "kl_div":
        loss = loss_preset("flagembedding", teacher_weight=1.0, kd_loss_type=kind, group_size=3)
    else:
        loss = loss_preset("flagembedding", teacher_weight=1.0, kd_loss_type=kind, group_size=3,
                           weights=dict.fromkeys(weights, 0.0), teacher_heads=weights)
    out = loss(model(**qb), model(**pb), teacher_scores=teacher)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
    assert {f"teacher_{h}" for h in weights} <= set(out)
    without = loss_preset("flagembedding", group_size=3)(model(**qb), model(**pb))["loss"].item()
    assert abs(without - expected) > 1e-3  # the control: the teacher term is there


# ---- GradCache ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,kind", [("equal", "kl_div"), ("flagembedding", "m3_kd_loss")])
def test_gradcache_with_teacher_scores_equals_the_plain_step(preset, kind):
    loss_fn = loss_preset(preset, teacher_weight=0.5, teacher_temperature=0.7, kd_loss_type=kind,
                          group_size=worker.GROUP)
    teacher = torch.from_numpy(np.random.default_rng(6).normal(scale=2.0, size=(worker.N_QUERIES, worker.GROUP)))
    teacher[1] = float("nan")  # a group of borrowed passages: left out of the term, in both paths alike
    queries, passages = worker.medical_batch()
    results = []
    for cached in (False, True):
        model = tiny_m3(dropout=0.1).double().train()
        qb, pb = worker.tokenize(model.tokenizer, queries), worker.tokenize(model.tokenizer, passages)
        torch.manual_seed(7)
        if cached:
            losses = GradCache(loss_fn, chunk_size=2).step(model, qb, pb, teacher_scores=teacher)
        else:  # plain autograd, the same chunks in the same order (the same dropout masks)
            def forward(m, batch):
                outs = [m(**{k: v[s:s + 2] for k, v in batch.items()}) for s in range(0, len(batch["input_ids"]), 2)]
                return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
            out = loss_fn(forward(model, qb), forward(model, pb), teacher_scores=teacher)
            out["loss"].backward()
            losses = {k: float(v.detach()) for k, v in out.items()}
        results.append((losses, {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref), (gc_loss, got) = results
    assert "teacher" in gc_loss and gc_loss["teacher"] > 0
    for k in ref_loss:
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12), k
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-7, atol=1e-9, msg=name)


# ---- the training file: the same draws, the teacher scores of the drawn passages ------------------------

def teacher_score(example: int, pid: str, positive: bool = False) -> float:
    """A score that names its example and passage, so an alignment error cannot go unseen."""
    return round(example * 100 + int(pid[1:]) % 97 + 0.25, 3)


def favours_positives(example: int, pid: str, positive: bool = False) -> float:
    """A teacher sure of each positive (10 above every negative), with a little spread among the negatives."""
    return (10.0 if positive else 0.0) + int(pid[1:]) % 97 / 97


def with_teacher_scores(train, out, score=teacher_score):
    rows = list(read_jsonl(train))
    for i, r in enumerate(rows):
        r["teacher_pos_scores"] = [score(i, p, True) for p in r["pos_ids"]]
        r["teacher_neg_scores"] = [score(i, n) for n in r["neg_ids"]]
    write_jsonl(out, rows)
    return out


def test_draws_are_identical_with_and_without_teacher_fields(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    rows = list(read_jsonl(train))
    rows[0]["neg_ids"], rows[0]["neg_scores"] = rows[0]["neg_ids"][:2], rows[0]["neg_scores"][:2]  # too few
    write_jsonl(train, rows)
    scored = with_teacher_scores(train, tmp_path / "scored.jsonl")
    for group_size in (1, 4, 6):
        plain, taught = (TrainingGroups(texts, f, group_size=group_size, seed=3) for f in (train, scored))
        assert taught.stats == {**plain.stats, "with_teacher_scores": len(rows)}
        for epoch in (0, 1):
            for i in range(len(rows)):
                qid, ids, no_scores = plain.group(epoch, i)
                assert taught.group(epoch, i)[:2] == (qid, ids) and no_scores is None
                assert taught.group(epoch, i)[2] == [teacher_score(i, pid) for pid in ids]
        # row 0 at group size 6: its own 2 negatives, repeated, each with its own score
        _, ids, _ = taught.group(0, 0)
        if group_size == 6:
            assert len(set(ids[1:])) == 2 and len(ids) == 6
        items = [taught[(1, i)] for i in range(4)]
        batch = collate_groups(items)
        assert batch["teacher_scores"].shape == (4, group_size) and batch["teacher_scores"].dtype == torch.float32
        expected = [teacher_score(i, pid) for i in range(4) for pid in taught.group_ids(1, i)[1]]
        np.testing.assert_allclose(batch["teacher_scores"].flatten().numpy(), expected, rtol=1e-6)
        assert "teacher_scores" not in collate_groups([plain[(1, i)] for i in range(4)])


def test_bad_teacher_fields_name_file_line_and_field(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=8)
    scored = with_teacher_scores(train, tmp_path / "scored.jsonl")
    rows = list(read_jsonl(scored))
    rows[2]["teacher_neg_scores"] = rows[2]["teacher_neg_scores"][:-1]
    write_jsonl(scored, rows)
    with pytest.raises(DataError, match=r"line 3, field 'teacher_neg_scores': 5 teacher scores for 6 neg_ids"):
        TrainingGroups(texts, scored)
    rows[2]["teacher_neg_scores"] = [1.0] * 5 + [float("nan")]
    write_jsonl(scored, rows)
    with pytest.raises(DataError, match=r"line 3, field 'teacher_neg_scores': teacher scores must be finite"):
        TrainingGroups(texts, scored)


# ---- refusals -----------------------------------------------------------------------------------------

def test_a_distilling_run_refuses_a_file_without_teacher_scores(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    with pytest.raises(DataError) as err:
        Trainer(train_config(tmp_path, texts, train, "run", "loss.teacher_weight=1.0"))
    message = str(err.value)
    assert "\n" not in message and str(train) in message
    assert "loss.teacher_weight > 0" in message and "python -m data_pipeline stage=score teacher=..." in message
    assert not (tmp_path / "run" / "checkpoints").exists()

    scored = with_teacher_scores(train, tmp_path / "scored.jsonl")
    rows = list(read_jsonl(scored))
    del rows[5]["teacher_pos_scores"], rows[5]["teacher_neg_scores"]  # one example without: refused by the
    write_jsonl(scored, rows)  # reader of the format (care/data/examples.py), distilling or not
    with pytest.raises(DataError, match=r"line 6, field 'teacher_pos_scores': missing: the first line carries"):
        Trainer(train_config(tmp_path, texts, scored, "run2", "loss.teacher_weight=1.0"))

    rows[5]["teacher_pos_scores"] = [1.0] * len(rows[5]["pos_ids"])
    rows[5]["teacher_neg_scores"] = [1.0] * len(rows[5]["neg_ids"])
    rows[7]["neg_ids"], rows[7]["neg_scores"], rows[7]["teacher_neg_scores"] = [], [], []
    write_jsonl(scored, rows)
    # an example without negatives borrows random passages, which no teacher scored: it is accepted, and
    # its group's row of teacher scores is NaN (the distillation term leaves it out: the formula test below)
    trainer = Trainer(train_config(tmp_path, texts, scored, "run3", "loss.teacher_weight=1.0"))
    assert trainer.data.stats["without_negatives"] == 1
    batch = collate_groups([trainer.data[(0, i)] for i in (6, 7)])
    assert not batch["teacher_scores"][0].isnan().any() and batch["teacher_scores"][1].isnan().all()


def test_the_loss_refuses_what_it_cannot_distil():
    with pytest.raises(ValueError, match="group size 1"):
        M3Loss(teacher_weight=1.0, group_size=1)
    with pytest.raises(ValueError, match="kd_loss_type='kl'"):
        AsymmetricLoss(kd_loss_type="kl")
    with pytest.raises(ValueError, match="teacher_temperature must be > 0"):
        M3Loss(teacher_temperature=0.0)
    with pytest.raises(ValueError, match="teacher_weight must be >= 0"):
        AsymmetricLoss(teacher_weight=-1.0)
    with pytest.raises(ValueError, match="unknown teacher_heads"):
        M3Loss(teacher_weight=1.0, teacher_heads={"bm25": 1.0})
    loss = AsymmetricLoss(teacher_weight=1.0, group_size=2)
    q, p = {"dense": torch.eye(4)[:2]}, {"dense": torch.eye(4)}
    with pytest.raises(ValueError, match="batch carries no teacher scores.*stage=score"):
        loss(q, p)
    with pytest.raises(ValueError, match=r"teacher scores of shape \(2, 3\) for 2 queries x group size 2"):
        loss(q, p, teacher_scores=torch.zeros(2, 3))
    # off: teacher scores given are ignored, the value is the plain loss's
    plain = AsymmetricLoss(group_size=2)
    assert torch.equal(plain(q, p, teacher_scores=torch.ones(2, 2))["loss"], plain(q, p)["loss"])


def test_care_stage1_refuses_distillation(root, tmp_path):
    cfg = load_config("train", train_overrides(root, tmp_path / "run", "++model.stages.stage1.loss.teacher_weight=1.0"))
    with pytest.raises(ValueError, match=r"model.stages.stage1.loss.teacher_weight > 0: stage I trains on same-text "
                                         r"pairs.*model.stages.stage2.loss.teacher_weight"):
        stage_config(cfg, "stage1", tmp_path / "run")


# ---- tiny runs ----------------------------------------------------------------------------------------

def test_tiny_m3_training_with_teacher_scores(tmp_path, shared):
    """GradCache, dropout on, the teacher favouring each positive: a finite loss that decreases, and the
    teacher term with it."""
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    scored = with_teacher_scores(train, tmp_path / "scored.jsonl", favours_positives)
    cfg = train_config(tmp_path, texts, scored, "run", "loss.teacher_weight=1.0", "loss.teacher_temperature=0.5",
                       "trainer.epochs=6", "trainer.lr=1e-3", "trainer.checkpoint_every=100",
                       "trainer.query_side_pools=[]")
    summary = Trainer(cfg).fit()
    assert summary["data"]["with_teacher_scores"] == 16
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss/loss" in r]
    assert len(rows) == 12
    for key in ("loss/loss", "loss/teacher"):
        values = [r[key] for r in rows]
        assert all(np.isfinite(values)) and np.mean(values[-4:]) < 0.8 * np.mean(values[:4]), (key, values)
    assert {"loss/teacher_dense", "loss/teacher_sparse", "loss/teacher_colbert"} <= set(rows[0])


def stage2_config(root, tiny, run, examples, *extra):
    """care_tiny's stage II from the tiny query tower, on `examples` (the training texts of the fixture)."""
    overrides = [o for o in train_overrides(root, run) if not o.startswith("data.examples=")]
    return load_config("train", [*overrides, f"data.examples={examples}", f"model.query.path={tiny / 'query'}",
                                 f"model.document.path={tiny / 'document'}",
                                 f"model.stages.stage2.query_from={tiny / 'query'}", *extra])


def test_care_stage2_training_with_teacher_scores(root, tiny, tmp_path):
    """CARE's stage II (LoRA document tower, GradCache) with m3_kd_loss from the mined file's teacher scores."""
    scored = with_teacher_scores(root / "train.jsonl", tmp_path / "scored.jsonl", favours_positives)
    cfg = stage2_config(root, tiny, tmp_path / "run", scored, "model.stages.stage2.loss.teacher_weight=0.5",
                        "model.stages.stage2.loss.kd_loss_type=m3_kd_loss",
                        "model.stages.stage2.loss.teacher_temperature=0.5")
    Trainer(stage_config(cfg, "stage2", tmp_path / "run")).fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "stage2" / "metrics.jsonl") if "loss/loss" in r]
    assert len(rows) == 3 and all(np.isfinite([r["loss/loss"], r["loss/teacher"]]).all() for r in rows)
    assert all(r["loss/loss"] == pytest.approx(r["loss/infonce"] + 0.5 * r["loss/teacher"], rel=1e-5) for r in rows)

    plain = tmp_path / "plain.jsonl"  # the same stage refuses the mined file without teacher scores
    write_jsonl(plain, [{k: v for k, v in r.items() if not k.startswith("teacher_")} for r in read_jsonl(scored)])
    cfg = stage2_config(root, tiny, tmp_path / "run2", plain, "model.stages.stage2.loss.teacher_weight=0.5")
    with pytest.raises(DataError, match=r"model.stages.stage2.loss.teacher_weight > 0 .*stage=score teacher="):
        Trainer(stage_config(cfg, "stage2", tmp_path / "run2"))
