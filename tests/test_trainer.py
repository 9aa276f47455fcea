"""The training loop on accelerate, the experiment and trainer configs, and train.py (tiny models)."""
from __future__ import annotations

import importlib.util
import json
import logging
import sys

import numpy as np
import pytest
import torch
from _training_helpers import make_training_files, train_config

from care.config import CONF_DIR as CONF
from care.config import load_config
from care.data.io import read_jsonl
from care.encoders.m3 import M3Encoder
from care.models.m3 import M3Model, tiny_m3
from care.paths import PROJECT_ROOT as ROOT
from care.training.trainer import Trainer
from care.training.validation import Validator

# ---------------------------------------------------------------- the loop

def test_loss_decreases_on_a_tiny_model(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    # no GradCache here (the whole pool in one pass): the resume tests cover the cached path
    cfg = train_config(tmp_path, texts, train, "run", "trainer.epochs=6", "trainer.lr=1e-3",
                       "trainer.checkpoint_every=100", "trainer.chunk_size=null")
    summary = Trainer(cfg).fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss/loss" in r]
    assert summary["step"] == len(rows) == 12  # 16 examples / 8 a batch x 6 epochs
    losses = [r["loss/loss"] for r in rows]
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses
    for head in ("dense", "sparse", "colbert"):  # every head learns, not only the sum
        assert rows[-1][f"loss/{head}"] < rows[0][f"loss/{head}"]
    # warmup (10% of 12 steps = 2) then cosine decay to 0, checked by the formula; step s uses the rate of s-1
    lrs = [r["lr"] for r in rows]
    expected = [1e-3 * (s / 2 if s < 2 else 0.5 * (1 + np.cos(np.pi * (s - 2) / 10))) for s in range(12)]
    np.testing.assert_allclose(lrs, expected, atol=1e-12)
    assert all(r["examples_per_s"] > 0 and r["memory_mb"] > 0 for r in rows)
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_early_stopping_keeps_the_best_weights(tmp_path, shared, caplog):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    dev = tmp_path / "dev.jsonl"
    cfg = train_config(tmp_path, texts, train, "run", "trainer.epochs=5", f"validation.task={dev}",
                       "validation.max_queries=3", "validation.every_steps=1", "validation.patience=2",
                       "validation.min_delta=1.0")  # nothing can improve MAP by 1.0: stop at the 2nd check
    with caplog.at_level(logging.WARNING, logger="care.training.model_saving"):
        summary = Trainer(cfg).fit()
    # a final/ that is the untrained start is said out loud, with the way to keep the last weights
    said = [r.getMessage() for r in caplog.records if "final/ holds the starting weights" in r.getMessage()]
    assert len(said) == 1 and "2 trained steps" in said[0] and "validation.task=null" in said[0], said
    assert summary["stop_reason"] == "early_stopping" and summary["step"] == 2 and summary["best_step"] == 0
    rows = list(read_jsonl(dev))  # built from the shared cEpilepsyQA dev split on first use
    assert len(rows) == 490 and all(r["positive"] and r["negative"] for r in rows)
    vals = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "val/map_cut_10" in r]
    assert [r["step"] for r in vals] == [0, 1, 2] and all(0 <= r["val/map_cut_10"] <= 1 for r in vals)
    # final = the step-0 weights (the best), not the trained ones
    start, final = M3Model.load(tmp_path / "tiny-m3"), M3Model.load(tmp_path / "run" / "final")
    assert all(torch.equal(a, b) for a, b in zip(start.state_dict().values(), final.state_dict().values()))
    info = json.loads((tmp_path / "run" / "final" / "care_training.json").read_text(encoding="utf-8"))
    assert info["weights"] == "best (step 0)" and info["model"]["kind"] == "m3"
    assert info["data"] == {"examples": 16, "group_size": 3, "short_of_negatives": 0, "without_negatives": 0}


def test_merge_with_start_writes_the_merged_final_and_keeps_the_tuned_weights(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    cfg = train_config(tmp_path, texts, train, "run", "trainer.max_steps=2", "trainer.merge_with_start=0.25",
                       "trainer.checkpoint_every=100")
    Trainer(cfg).fit()
    run = tmp_path / "run"
    start, tuned, final = (M3Model.load(p).state_dict() for p in (tmp_path / "tiny-m3", run / "tuned", run / "final"))
    moved = [k for k in tuned if not torch.equal(tuned[k], start[k])]
    assert moved  # training changed the weights, so the merge has something to do
    for k in tuned:
        expected = 0.25 * tuned[k] + 0.75 * start[k] if k.startswith("backbone.") else tuned[k]  # heads as trained
        torch.testing.assert_close(final[k], expected, rtol=0, atol=1e-6, msg=k)
    info = json.loads((run / "final" / "care_training.json").read_text(encoding="utf-8"))
    # paths inside a run are relative to it; the start is provenance, named without the local path
    assert info["merge"] == {"weight": 0.25, "start": "tiny-m3", "tuned": "../tuned"}
    assert json.loads((run / "tuned" / "care_training.json").read_text(encoding="utf-8"))["merge"] is None
    from care.evaluation.entries import (
        checkpoint_models,  # ckpt=<run> scores the merged and the tuned model side by side
    )

    assert [name for name, _ in checkpoint_models(str(run), {})] == ["run/final", "run/tuned"]


def test_backbone_heads_keeps_the_other_losses_off_the_backbone(tmp_path, shared):
    """trainer.backbone_heads=[dense]: the backbone trains exactly as under the dense loss alone, while the
    sparse and ColBERT heads still learn (no clipping, which would couple them through the global norm)."""
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    common = ("trainer.max_steps=2", "trainer.checkpoint_every=100", "trainer.max_grad_norm=1e9")
    runs = {"detached": ["trainer.backbone_heads=[dense]"],
            "dense_loss": ["loss.weights.sparse=0", "loss.weights.colbert=0"]}
    for run, extra in runs.items():
        Trainer(train_config(tmp_path, texts, train, run, *common, *extra)).fit()
    start, detached, dense_loss = (M3Model.load(p).state_dict()
                                   for p in (tmp_path / "tiny-m3", tmp_path / "detached" / "final",
                                             tmp_path / "dense_loss" / "final"))
    for k in detached:
        if k.startswith("backbone."):
            torch.testing.assert_close(detached[k], dense_loss[k], rtol=1e-5, atol=1e-7, msg=k)
    for head in ("sparse_linear.weight", "colbert_linear.weight"):
        assert not torch.equal(detached[head], start[head]), head
    assert any(not torch.equal(detached[k], start[k]) for k in detached if k.startswith("backbone.encoder."))


def test_dev_metric_matches_an_independent_reranking(tmp_path, shared):
    """The validation metric against a reference: dense scores by hand and pytrec_eval's map_cut_10."""
    import pytrec_eval

    texts, train = make_training_files(tmp_path, shared, n_questions=8)
    dev = tmp_path / "dev.jsonl"
    cfg = train_config(tmp_path, texts, train, "run", f"validation.task={dev}", "validation.max_queries=4")
    model = M3Model.load(tmp_path / "tiny-m3").eval()
    encoder = M3Encoder(str(tmp_path / "tiny-m3"), max_length=48, device="cpu", model=model)
    got = Validator(cfg.validation)(encoder)
    rows = list(read_jsonl(dev))[:4]
    run, qrels = {}, {}
    for i, r in enumerate(rows):
        cands = list(dict.fromkeys(r["positive"] + r["negative"]))
        with torch.no_grad():
            def enc(t):
                b = model.tokenizer(t, padding=True, truncation=True, max_length=48, return_tensors="pt")
                return model(**b)["dense"]
            s = (enc([r["query"]]) @ enc(cands).T)[0].tolist()
        run[str(i)] = {f"d{j}": float(np.float32(x)) for j, x in enumerate(s)}
        qrels[str(i)] = {f"d{j}": 1 for j, c in enumerate(cands) if c in r["positive"]}
    ref = pytrec_eval.RelevanceEvaluator(qrels, {"map_cut"}).evaluate(run)
    assert got == pytest.approx(np.mean([v["map_cut_10"] for v in ref.values()]), abs=1e-5)


# ---------------------------------------------------------------- configs and train.py

@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes(name):
    cfg = load_config("train", [f"experiment={name}"])
    assert cfg.experiment_name == name and cfg.run_name.startswith(name)
    assert cfg.trainer.batch_size > 0 and cfg.trainer.group_size >= 1 and cfg.loss.temperature.dense > 0
    if name == "bge_m3_medical_cn":  # the source recipe, docs/facts.md s.1
        t = cfg.trainer
        assert cfg.model.name == "bge_m3" and t.batch_size * t.group_size == 1280 and t.lr == 1e-5
        assert t.warmup_ratio == 0.01 and t.mixed_precision == "bf16" and cfg.validation.patience > 0
        assert dict(cfg.loss.weights) == {"dense": 1.0, "sparse": 1.0, "colbert": 1.0, "ensemble": 0.0}
        assert list(t.backbone_heads) == ["dense", "sparse", "colbert"]  # every loss trains the backbone
    # a backbone swap on the command line wins over the experiment's choice
    assert load_config("train", [f"experiment={name}", "model=tiny_m3"]).model.name == "tiny_m3"


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "trainer").glob("*.yaml")))
def test_every_trainer_composes(name):
    cfg = load_config("train", [f"trainer={name}"])
    assert cfg.trainer.cpu == (name == "cpu") and cfg.trainer.mixed_precision in ("no", "bf16", "fp16")
    assert cfg.trainer.lr > 0  # the recipe part is still there


def test_train_py_end_to_end(tmp_path, shared, monkeypatch):
    """train.py's Hydra entry point with `model=tiny_m3 ...` on its command line (run in this process: a fresh
    interpreter would spend most of the test importing torch): 3 steps, validation, a final model that
    FlagEmbedding's own loader reads."""
    texts, train = make_training_files(tmp_path, shared, n_questions=24)
    model_dir = tmp_path / "tiny-m3"
    tiny_m3().save(model_dir)
    out = tmp_path / "run"
    argv = ["train.py", "model=tiny_m3", f"model.path={model_dir}", f"data.texts={texts}", f"data.examples={train}",
            f"output_dir={out}", "trainer.max_steps=3", "trainer.batch_size=8", "trainer.group_size=2",
            "trainer.chunk_size=8", "trainer.query_max_length=32", "trainer.passage_max_length=48",
            f"validation.task={tmp_path / 'dev.jsonl'}", "validation.max_queries=3", "validation.every_steps=3",
            f"hydra.run.dir={tmp_path / 'hydra'}"]
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    rows = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["step"] for r in rows if "loss/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "val/map_cut_10" in r] == [0, 3]
    assert (out / "curves.png").exists() and (out / "checkpoints" / "step-0000003" / "state.pt").exists()
    assert (tmp_path / "hydra" / ".hydra" / "overrides.yaml").exists()  # it did go through Hydra
    # the final folder is FlagEmbedding's M3 format: its own loader gives our dense vectors
    from FlagEmbedding import BGEM3FlagModel

    ours = M3Encoder(str(out / "final"), device="cpu").encode_queries(["癫痫能治好吗"], heads=("dense",)).dense
    theirs = BGEM3FlagModel(str(out / "final"), use_fp16=False, devices="cpu").encode(["癫痫能治好吗"])["dense_vecs"]
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
