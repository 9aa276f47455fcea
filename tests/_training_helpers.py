"""Tiny real training files (cEpilepsyQA) and the tiny-M3 train config, shared by the training tests."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from care.config import load_config
from care.data.io import write_jsonl
from care.models.m3 import tiny_m3

# Tiny models run fastest on one thread; two threads on a busy 2-core machine run ~15x slower.
torch.set_num_threads(1)


def make_training_files(root: Path, shared: Path, n_questions: int = 48, n_negs: int = 6, seed: int = 0):
    """Real cEpilepsyQA questions with their own answers as positives and, as negatives, answers of other
    questions (random, seeded): the id-referencing layout of docs/design.md ("Files between stages").  Returns (texts, train) paths."""
    folder = shared / "cepilepsyqa"
    with open(folder / "question.csv", encoding="utf-8-sig") as fh:
        questions = [r for _, r in zip(range(n_questions), csv.DictReader(fh))]
    wanted = {q["question_id"] for q in questions}
    answers: dict[str, list[dict]] = {}
    with open(folder / "answer.csv", encoding="utf-8-sig") as fh:
        for r in csv.DictReader(fh):
            if r["question_id"] in wanted:
                answers.setdefault(r["question_id"], []).append(r)
    questions = [q for q in questions if q["question_id"] in answers]
    texts = [{"id": f"q{q['question_id']}", "text": q["content"]} for q in questions]
    texts += [{"id": f"a{a['ans_id']}", "text": a["content"]} for q in questions for a in answers[q["question_id"]]]
    rng = np.random.default_rng(seed)
    examples = []
    for q in questions:
        pos = [f"a{a['ans_id']}" for a in answers[q["question_id"]]]
        others = [t["id"] for t in texts if t["id"].startswith("a") and t["id"] not in pos]
        negs = [str(x) for x in rng.choice(others, n_negs, replace=False)]
        examples.append({"query_id": f"q{q['question_id']}", "pos_ids": pos, "neg_ids": negs,
                         "neg_scores": [round(float(s), 3) for s in rng.uniform(0.5, 0.8, n_negs)]})
    write_jsonl(root / "texts.jsonl", texts)
    write_jsonl(root / "train.jsonl", examples)
    return root / "texts.jsonl", root / "train.jsonl"


def train_config(root: Path, texts: Path, train: Path, run: str, *extra: str):
    """The real conf/train.yaml with a tiny M3 model (dropout on) and the tiny files; no validation."""
    model_dir = root / "tiny-m3"
    if not model_dir.exists():
        tiny_m3().save(model_dir)
    return load_config("train", [
        "model=tiny_m3", f"model.path={model_dir}", f"data.texts={texts}", f"data.examples={train}",
        f"output_dir={root / run}", "validation.task=null", "trainer.batch_size=8", "trainer.group_size=3",
        "trainer.chunk_size=8", "trainer.query_max_length=32", "trainer.passage_max_length=48",
        "trainer.lr=5e-4", "trainer.warmup_ratio=0.1", *extra])
