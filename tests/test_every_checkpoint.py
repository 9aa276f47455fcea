"""Every saved checkpoint of a training run is a model folder evaluate.py scores (`checkpoints=all`), plotted
against the step beside the validation curve; the resume state is unchanged beside it."""
from __future__ import annotations

import json

import pytest
from _training_helpers import make_training_files, train_config

from care.config import load_config
from care.data.io import write_jsonl
from care.encoders.registry import CHECKPOINT_MODEL, TRAINING_RECORD, detect
from care.training.trainer import Trainer


@pytest.fixture(scope="module")
def run(shared, tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    texts, train = make_training_files(root, shared, n_questions=24)
    cfg = train_config(root, texts, train, "run", "trainer.max_steps=4", "trainer.epochs=2",
                       "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3")
    Trainer(cfg).fit()
    return root, root / "run"


def test_each_checkpoint_holds_a_model_folder_with_its_record(run):
    _, out = run
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-0000002", "step-0000004"]
    for name in steps:
        folder = out / "checkpoints" / name
        assert (folder / "state.pt").is_file()
        record = json.loads((folder / CHECKPOINT_MODEL / TRAINING_RECORD).read_text())
        assert record["steps"] == int(name[5:]) and record["config"]["seed"] is not None
        assert detect(folder / CHECKPOINT_MODEL, {})["kind"] == "m3"


def test_evaluate_scores_every_checkpoint_and_plots_them(run, tmp_path):
    from care.evaluation.entries import checkpoint_models
    from evaluate import evaluate

    root, out = run
    assert [n for n, _ in checkpoint_models(str(out), {})] == ["run/final", "run/tuned"]  # the merge's two
    names = [n for n, _ in checkpoint_models(str(out), {}, "all")]
    assert names == ["run/final", "run/tuned", "run/step-0000002", "run/step-0000004"]
    rerank = tmp_path / "rerank.jsonl"
    texts = [json.loads(line)["text"] for line in (root / "texts.jsonl").read_text(encoding="utf-8").splitlines()]
    write_jsonl(rerank, [{"query": texts[i], "positive": [texts[-1 - i]], "negative": texts[30:36]} for i in range(6)])
    cfg = load_config("evaluate", [f"ckpt={out}", "checkpoints=all", "benchmark=cmedteb", "~benchmark@extra_benchmark",
                                   *[f"benchmark.tasks.{t}.path={rerank}" for t in ("cmed_v1", "cmed_v2", "rerank")],
                                   "~benchmark.tasks.retrieval", "~benchmark.tasks.sts", "baselines=[]",
                                   f"out_dir={tmp_path / 'eval'}", f"cache.dir={tmp_path / 'cache'}",
                                   "efficiency.enabled=false"])
    result = evaluate(cfg)
    assert [r["name"] for r in result["rows"]] == names
    assert (tmp_path / "eval" / "steps.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="best_final or all"):
        checkpoint_models(str(out), {}, "every")
