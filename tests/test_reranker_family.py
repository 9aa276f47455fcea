"""The cross-encoder reranker family (`kind: reranker`, issue #35 item 1), on a tiny model: `python train.py
model=me5_reranker` trains it from an encoder folder (a fresh one-label head), resumes bit-identically, and its
final/ folder loads with sentence-transformers' CrossEncoder and FlagEmbedding's FlagReranker in a process that
never imports the project, whose scores equal the project's (1e-5).  References independent of the code:
those two libraries' own loading and scoring, an uninterrupted run's weights, and the two losses written out
from their definitions (-log softmax of the positive; the mean binary cross-entropy)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from _training_helpers import make_training_files
from safetensors.torch import load_file

from care.config import load_config
from care.encoders import build_pair_scorer, detect
from care.encoders.cross_encoder import CrossEncoder
from care.models.tiny import save_tiny
from care.training.reranker_family import RerankerLoss
from care.training.reranker_recipe import RerankerTrainer, reranker_config
from care.training.trainer import train

PAIRS = [["头痛怎么办", "头痛可以先休息，多喝水"], ["高血压患者可以吃鸡蛋吗", "每天一个鸡蛋一般没有问题"],
         ["癫痫发作怎么办", "让病人侧卧，不要往嘴里塞东西"]]

_SCRIPT = """
import json, sys
from sentence_transformers import CrossEncoder
from FlagEmbedding import FlagReranker
folder, pairs = sys.argv[1], json.loads(sys.argv[2])
st = CrossEncoder(folder, device="cpu").predict(pairs, batch_size=2).tolist()
flag = FlagReranker(folder, use_fp16=False, devices=["cpu"]).compute_score(pairs, batch_size=2)
print("SCORES " + json.dumps({"st": st, "flag": flag, "project_imported": "care" in sys.modules}))
"""


class Crash(RuntimeError):
    pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    shared = request.getfixturevalue("shared")
    root = tmp_path_factory.mktemp("reranker")
    texts, examples = make_training_files(root, shared, n_questions=24)
    start = save_tiny(root / "tiny-encoder", "bert")  # an encoder folder: the family adds the head

    def cfg(run: str, *extra: str):
        return load_config("train", [
            "model=me5_reranker", f"model.path={start}", "model.max_length=64", f"data.texts={texts}",
            f"data.examples={examples}", f"output_dir={root / run}", "validation.task=null",
            "trainer.batch_size=4", "trainer.group_size=3", "trainer.max_steps=3", "trainer.checkpoint_every=1",
            "trainer.lr=5e-4", "trainer.warmup_ratio=0.1", "trainer.freeze=[]", *extra])

    summary = train(cfg("reference"))
    return root, cfg, summary


def test_trains_three_steps_from_an_encoder_folder_and_resumes_bit_identically(runs):
    root, cfg, summary = runs
    assert summary["step"] == 3 and summary["stop_reason"] == "completed"
    losses = [json.loads(x)["loss/loss"] for x in (root / "reference" / "metrics.jsonl").read_text().splitlines()
              if "loss/loss" in x]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)

    def crash(trainer):
        if trainer.step == 1:
            raise Crash("killed after step 1")

    with pytest.raises(Crash):
        RerankerTrainer(reranker_config(cfg("crashed")), callbacks=[crash]).fit()
    resumed = train(cfg("crashed"))
    assert resumed["step"] == 3
    a, b = (load_file(root / run / "final" / "model.safetensors") for run in ("reference", "crashed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_final_folder_is_recognised_as_a_reranker(runs):
    root, _, _ = runs
    model = detect(root / "reference" / "final", {})
    assert model["kind"] == "reranker"
    card = (root / "reference" / "final" / "README.md").read_text(encoding="utf-8")
    assert "pipeline_tag: text-ranking" in card and 'CrossEncoder("reference/final")' in card
    assert isinstance(build_pair_scorer(model), CrossEncoder)  # build_encoder refuses it (test_family_refusals.py)


def test_loads_with_crossencoder_and_flagreranker_without_the_project_and_scores_as_the_project(runs, tmp_path):
    root, _, _ = runs
    folder = root / "reference" / "final"
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(folder), json.dumps(PAIRS, ensure_ascii=False)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("SCORES "))[len("SCORES "):])
    assert not out["project_imported"]
    ours = CrossEncoder(str(folder), max_length=64).score_pairs([q for q, _ in PAIRS], [p for _, p in PAIRS])
    assert len(set(ours.round(4).tolist())) == len(PAIRS)  # distinct scores: a real comparison
    for name in ("st", "flag"):
        assert out[name] == pytest.approx(ours.tolist(), abs=1e-5), name


def test_a_tiny_reranker_folder_keeps_its_own_head(tmp_path):
    folder = save_tiny(tmp_path / "tiny-reranker", "reranker")
    model = json.loads((folder / "config.json").read_text())
    assert model["architectures"] == ["BertForSequenceClassification"] and model["id2label"] == {"0": "LABEL_0"}
    scores = CrossEncoder(str(folder)).score_pairs(["头痛怎么办"] * 2, ["多喝水", "头痛可以先休息"])
    assert scores.shape == (2,) and scores[0] != scores[1]


def test_losses_against_their_definitions():
    scores = torch.tensor([[2.0, 1.0, -1.0], [0.5, 1.5, 0.0]])
    softmax = RerankerLoss(3)(scores)["loss"].item()
    by_hand = sum(-math.log(math.exp(r[0]) / sum(math.exp(x) for x in r)) for r in scores.tolist()) / 2
    assert softmax == pytest.approx(by_hand, rel=1e-6)
    bce = RerankerLoss(3, objective="bce")(scores)["loss"].item()
    sig = [[1 / (1 + math.exp(-x)) for x in r] for r in scores.tolist()]
    by_hand = -sum(math.log(r[0]) + math.log(1 - r[1]) + math.log(1 - r[2]) for r in sig) / 6
    assert bce == pytest.approx(by_hand, rel=1e-6)
    with pytest.raises(ValueError, match="group_size=1"):
        RerankerLoss(1)


def test_a_step_in_chunks_of_whole_groups_equals_the_whole_batch_at_once(runs, tmp_path, monkeypatch):
    """trainer.chunk_size bounds the pairs a forward; without dropout the step's loss and gradient are the
    whole batch's (the gradient itself: AdamW's first update is near lr x sign(g) whatever g's scale)."""
    _, cfg, _ = runs
    start = save_tiny(tmp_path / "no-dropout", "bert", dropout=0.0)
    seen = []

    def record(trainer, losses):
        seen.append(({k: float(v) for k, v in losses.items()},
                     {n: p.grad.clone() for n, p in trainer.towers[0].named_parameters() if p.grad is not None}))
        return {}

    monkeypatch.setattr(RerankerTrainer, "optimizer_step", record)
    for name, chunk in (("whole", "null"), ("chunked", "3")):
        trainer = RerankerTrainer(reranker_config(cfg(f"chunk-{name}", f"model.path={start}", f"trainer.chunk_size={chunk}")))
        trainer.train_step(next(iter(trainer.loader)))
    (loss_a, grad_a), (loss_b, grad_b) = seen
    assert loss_b["loss"] == pytest.approx(loss_a["loss"], rel=1e-6) and grad_a.keys() == grad_b.keys()
    assert any(g.abs().max() > 0 for g in grad_a.values())
    for k in grad_a:
        torch.testing.assert_close(grad_b[k], grad_a[k], rtol=1e-4, atol=1e-7)
