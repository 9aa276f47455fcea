"""Pinned outputs: a tiny pipeline's files (real cEpilepsyQA data: import, exact + MinHash dedup) and a tiny
training run (GradCache, dropout on, the default recipe's merge), held to the values the code gave when
the restructuring of the packages landed.  A refactor must not move them; a deliberate behaviour change
regenerates them and says so in its commit:

    .venv/bin/python tests/test_pinned_outputs.py --write

Files are pinned by digest (they are exact); weights by per-tensor sums and the loss curve, with a
tolerance far below what any change of recipe moves but above float noise across thread counts.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

sys.path.insert(0, str(Path(__file__).parent))
from _training_helpers import make_training_files, train_config

from care.config import load_config
from care.paths import shared_data

PIN = Path(__file__).with_name("pinned_outputs.json")
PIPELINE_FILES = ("import/texts.jsonl", "import/candidates.jsonl", "dedup/kept.jsonl", "dedup/clusters.jsonl")


def pipeline_outputs(root: Path) -> dict[str, str]:
    from data_pipeline import import_stage
    from data_pipeline.dedup import stage as dedup_stage

    cfg = load_config("data_pipeline", [f"data_dir={root}", "dedup.stages=[exact,minhash]"])
    with open_dict(cfg):
        cfg.data.sources = OmegaConf.create({"cepilepsyqa": cfg.data.sources.cepilepsyqa})
    import_stage.run(cfg)
    dedup_stage.run(cfg)
    return {name: hashlib.sha256((root / name).read_bytes()).hexdigest()[:16] for name in PIPELINE_FILES}


def training_outputs(root: Path) -> dict:
    from safetensors.torch import load_file

    from care.data.io import read_jsonl
    from care.training.trainer import Trainer

    texts, train = make_training_files(root, shared_data(), n_questions=32)
    Trainer(train_config(root, texts, train, "run", "trainer.max_steps=6", "trainer.epochs=3")).fit()
    final = root / "run" / "final"
    weights = load_file(final / "model.safetensors")
    for head in ("colbert_linear.pt", "sparse_linear.pt"):
        weights.update({f"{head}:{k}": v for k, v in torch.load(final / head, weights_only=True).items()})
    return {"loss": [r["loss/loss"] for r in read_jsonl(root / "run" / "metrics.jsonl") if "loss/loss" in r],
            "tensor_sums": {k: float(v.double().sum()) for k, v in sorted(weights.items())}}


@pytest.fixture(scope="module")
def pinned():
    return json.loads(PIN.read_text(encoding="utf-8"))


def test_tiny_pipeline_files_are_unchanged(pinned, tmp_path):
    assert pipeline_outputs(tmp_path) == pinned["pipeline"]


def test_tiny_training_weights_are_unchanged(pinned, tmp_path, one_thread):
    got, want = training_outputs(tmp_path), pinned["training"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["tensor_sums"].keys() == want["tensor_sums"].keys()
    moved = {k: (got["tensor_sums"][k], v) for k, v in want["tensor_sums"].items()
             if got["tensor_sums"][k] != pytest.approx(v, rel=1e-5, abs=1e-4)}
    assert not moved, f"{len(moved)} tensors moved, e.g. {list(moved.items())[:3]}"


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        values = {"pipeline": pipeline_outputs(Path(tmp) / "data"), "training": training_outputs(Path(tmp) / "train")}
    PIN.write_text(json.dumps(values, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {PIN}")
