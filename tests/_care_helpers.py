"""Shared by the CARE tests: real training texts, tiny tower pairs, and the configs and counters over them."""
from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
from _training_helpers import make_training_files

from care.config import model_config as project_model_config
from care.encoders import build_encoder
from care.encoders.builders.towers import build_tiny
from care.models.towers import Tower
from care.training.care_family import CAREFamily

# ---- training: real training files and the towers care_tiny builds --------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory, shared):
    """Training files (24 real cEpilepsyQA questions, their answers, 6 negatives each) and CARE_CACHE (built
    towers, embedding caches) in a temporary folder for the whole module, subprocesses included."""
    root = tmp_path_factory.mktemp("care-train")
    make_training_files(root, shared, n_questions=24)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CARE_CACHE", str(root / "cache"))
        yield root


@pytest.fixture(scope="module")
def tiny(root) -> Path:
    """The tiny towers where conf/model/care_tiny.yaml builds them on first use."""
    out = root / "cache" / "models" / "care-tiny"
    build_tiny(out)
    return out


def train_overrides(root: Path, run: Path | None, *extra: str) -> list[str]:
    return ["model=care_tiny", f"data.texts={root / 'texts.jsonl'}", f"data.examples={root / 'train.jsonl'}",
            *([f"output_dir={run}"] if run else []), "validation.task=null", *extra]


def tower_calls(monkeypatch) -> dict[str, int]:
    """Forwards of every Tower, by its folder's name (query / document), counted from now on."""
    calls = {"query": 0, "document": 0}
    forward = Tower.forward

    def counted(self, *args, **kwargs):
        calls[Path(self.spec.path).name] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Tower, "forward", counted)
    return calls


# ---- the model: two tiny tower pairs and the encoder over them -------------------------------------------

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
    c = project_model_config("care_tiny")
    for side, path in (("query", query), ("document", document)):
        c[side].pop("build")
        c[side]["path"] = str(path)
    return {**c, **extra}


def encoder(towers, query_seed=0, document_seed=0):
    return build_encoder(model_config(towers / f"seed{query_seed}" / "query", towers / f"seed{document_seed}" / "document"),
                         device="cpu", backend="torch")  # the towers themselves (an app's `auto` would run ONNX)


def stage2_family(towers, tmp_path, **trainer):
    from care.config import load_config
    from care.training.care_recipe import stage_config

    seed0 = towers / "seed0"
    cfg = load_config("train", ["model=care_tiny", f"model.query.path={seed0 / 'query'}",
                                f"model.document.path={seed0 / 'document'}", f"output_dir={tmp_path / 'run'}",
                                f"model.stages.stage2.query_from={seed0 / 'query'}", "validation.task=null",
                                *(f"trainer.{k}={v}" for k, v in trainer.items())])
    return CAREFamily(stage_config(cfg, "stage2", tmp_path / "run"))


def todays_asymmetric(loss, q: dict, p: dict) -> dict:
    """AsymmetricLoss.forward as it was before Matryoshka widths, teacher and score distillation: the reference
    their "off means unchanged" tests compare with, bit for bit.  Written with torch's own cross_entropy (each
    query's positive at i x group in the pool) rather than the project's info_nce / pool_group_size, so a slip
    there is not repeated here; the formula itself is checked against loops in tests/test_care_losses.py."""
    import torch
    import torch.nn.functional as F

    dtype = torch.promote_types(torch.promote_types(q["dense"].dtype, p["dense"].dtype), torch.float32)
    qv, pv = q["dense"].to(dtype), p["dense"].to(dtype)
    group = loss.group_size or len(pv) // len(qv)
    assert len(pv) == len(qv) * group, "1 positive + (group - 1) negatives per query, in query order"
    positives = torch.arange(len(qv)) * group
    out = {"infonce": F.cross_entropy(qv @ pv.T / loss.temperature, positives)}
    if loss.mse_weight:
        out["mse"] = (qv - pv[positives]).pow(2).sum(-1).mean()
    return {"loss": out["infonce"] + loss.mse_weight * out.get("mse", 0.0), **out}
