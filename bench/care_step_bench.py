"""CARE stage I's step cost against the query tower's own work (issue #23, item 3): `run() -> dict`,
registered as `python -m bench care_step` (bench/results/care_step.json).

Stage I's document side is a table lookup (care/training/care_family.py, CachedDocuments), so a training
step should cost little more than the query tower's forward and backward of the same batch (goal: <= 1.15x).
For each tower pair (the tiny CARE towers of conf/model/care_tiny.yaml, and the real care_me5 towers of
conf/model/care_me5.yaml when their document tower is there), in one process, on one torch thread:

  (b) a stage-I step as the trainer runs it: `Trainer.fit` of the stage's config (care/training/care_recipe.py
      stage_config: the model config's stage-I recipe, real cEpilepsyQA questions and answers as the training
      texts), timed between consecutive calls of a trainer callback: the data loader's batch, tokenization,
      the cached document vectors looked up, the loss, backward, clipping, AdamW and schedule steps, the log row;
  (a) the query tower's own forward + backward of that very batch (the same texts, prompt and max length,
      tokenized beforehand), with a plain loss on its output (the sum of its vectors' squares), run inside the
      same callback right after (b): the two alternate step by step, so machine load hits both alike.

ratio = median (b) / median (a).  Then the same number of steps again with timers around the step's parts
(data loading + collation, tokenization, the document lookup, the query tower's forwards, loss, backward,
clipping, optimizer, schedule, zero_grad, logging; `other` = what no timer covers), reported in ms per step:
what a step spends above (a).  Checkpoints are not in (b) (trainer.checkpoint_every is set past the run); one
checkpoint's time (median of three, at the last step) is reported apart and per step at the recipe's
checkpoint_every.

The machine is shared: take the ratios, not the seconds.  `CARE_STEP_BENCH_REPEATS` (default 10) sets the
timed steps per phase; `python bench/care_step_bench.py` prints the JSON without writing it.
"""
from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.15
WARMUP = 3
MODELS = ("care_tiny", "care_me5")
REAL_RUN = "CARE_STEP_BENCH_REPEATS=30 nice -n 5 .venv/bin/python -m bench care_step"


def real_texts(n: int, seed: int = 0) -> list[str]:
    """n distinct cEpilepsyQA questions and answers, seeded: stage I's queries are the training texts
    themselves (same-text pairs), questions and (truncated) answers alike."""
    from care.paths import shared_data

    folder = shared_data() / "cepilepsyqa"
    texts = []
    for name, field in (("question.csv", "content"), ("answer.csv", "content")):
        with open(folder / name, encoding="utf-8-sig", newline="") as fh:
            texts += [r[field] for r in csv.DictReader(fh) if r[field].strip()]
    texts = list(dict.fromkeys(texts))
    pick = np.random.default_rng(seed).choice(len(texts), n, replace=False)
    return [texts[i] for i in pick]


def stage1_trainer(model: str, tmp: Path, n_texts: int, total_steps: int):
    """A Trainer of `model`'s stage I, as `python train.py model=<model> model.stage=stage1` builds it, over
    n_texts real texts (no extra texts, no validation, an embedding cache of its own, no checkpoints)."""
    from care.config import load_config
    from care.data.io import write_jsonl
    from care.training.care_recipe import stage_config
    from care.training.trainer import Trainer

    texts = real_texts(n_texts)
    write_jsonl(tmp / "texts.jsonl", ({"id": f"t{i}", "text": t} for i, t in enumerate(texts)))
    write_jsonl(tmp / "train.jsonl", ({"query_id": f"t{i}", "pos_ids": [f"t{i}"]} for i in range(len(texts))))
    overrides = [f"model={model}", "model.stage=stage1", f"data.texts={tmp / 'texts.jsonl'}",
                 f"data.examples={tmp / 'train.jsonl'}", f"output_dir={tmp / 'run'}", "validation.task=null",
                 f"cache.dir={tmp / 'embeddings'}", "model.stages.stage1.extra_texts=[]",
                 f"model.stages.stage1.trainer.max_steps={total_steps}", "wandb.mode=disabled"]
    recipe = load_config("train", overrides)
    checkpoint_every = int(recipe.trainer.checkpoint_every)
    cfg = load_config("train", [*overrides, f"trainer.checkpoint_every={10 * total_steps}"])
    return Trainer(stage_config(cfg, "stage1", tmp / "run")), checkpoint_every


def measure(model: str, repeats: int) -> dict:
    total = WARMUP + 2 * repeats + 1  # the last step saves the run's checkpoint: not timed
    with tempfile.TemporaryDirectory(prefix=f"care-step-{model}-") as tmp:
        start = time.perf_counter()
        from bench.care_step_timers import StepClock
        from care.config import load_config

        batch = int(load_config("train", [f"model={model}"]).model.stages.stage1.trainer.batch_size)
        trainer, checkpoint_every = stage1_trainer(model, Path(tmp), batch * (total + 1), total)
        setup_s = time.perf_counter() - start
        clock = StepClock(trainer, repeats, WARMUP)
        trainer.callbacks.append(clock)
        trainer.fit(end_training=False)
        for _ in range(2):  # two more checkpoints of the last step: the median of three
            trainer.save_checkpoint()
        newest = max((Path(tmp) / "run" / "stage1" / "checkpoints").glob("step-*"))
        state_mb = (newest / "state.pt").stat().st_size / 2**20
        t = trainer.cfg.trainer
        tower, step = statistics.median(clock.tower_s), statistics.median(clock.step_s)
        names = [k for k in clock.profiled[0] if k != "total"]
        names = sorted({k for p in clock.profiled for k in p if k != "total"}, key=lambda k: names.index(k)
                       if k in names else len(names))
        parts_ms = {k: round(1000 * statistics.median(p.get(k, 0.0) for p in clock.profiled), 3) for k in names}
        profiled_total = statistics.median(p["total"] for p in clock.profiled)
        checkpoint = statistics.median(clock.checkpoint_s[-3:]) if clock.checkpoint_s else None
        n_trainable = sum(p.numel() for p in trainer.towers[0].parameters() if p.requires_grad)
        return {
            "model": model,
            "stage1_recipe": {"batch_size": t.batch_size, "chunk_size": t.chunk_size, "group_size": t.group_size,
                              "query_max_length": t.query_max_length, "freeze": list(t.freeze),
                              "trainable_params": n_trainable,
                              "query_params": sum(p.numel() for p in trainer.towers[0].parameters())},
            "steps_timed": len(clock.step_s), "warmup_steps": WARMUP,
            "tower_fwd_bwd_ms_median": round(1000 * tower, 3),
            "step_ms_median": round(1000 * step, 3),
            "ratio_step_over_tower": round(step / tower, 3),
            "goal": GOAL, "meets_goal": step / tower <= GOAL,
            "tower_fwd_bwd_ms": [round(1000 * x, 2) for x in clock.tower_s],
            "step_ms": [round(1000 * x, 2) for x in clock.step_s],
            "breakdown_ms_median": parts_ms,
            "breakdown_step_ms_median": round(1000 * profiled_total, 3),
            "breakdown_calls_per_step": clock.calls,
            "checkpoint_s": None if checkpoint is None else round(checkpoint, 3),
            "checkpoint_state_pt_mb": round(state_mb, 1),
            "checkpoint_every": checkpoint_every,
            "ratio_with_checkpoints_amortised": None if checkpoint is None else
            round((step + checkpoint / checkpoint_every) / tower, 3),
            "setup_s": round(setup_s, 1),
        }


def me5_absent() -> str | None:
    """Why the care_me5 towers cannot be measured here, or None.  Its document tower is `make model`'s (a
    download-and-convert); the 4-layer query tower is cut from it on first use (seconds), as train.py does."""
    from care.config import load_config

    m = load_config("train", ["model=care_me5"]).model
    if not (Path(m.document.path) / "config.json").exists():
        return (f"care_me5's document tower {m.document.path} is not built: `make model`, then "
                f"`{REAL_RUN}`")
    return None


def run(repeats: int | None = None) -> dict:
    repeats = repeats or int(os.environ.get("CARE_STEP_BENCH_REPEATS", "10"))
    torch.set_num_threads(1)
    out = {"what": "CARE stage I: a training step as the trainer runs it (b) against the query tower's own forward "
                   "+ backward of the same batch (a); ratio = median b / median a, goal <= 1.15",
           "machine_load": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "load_avg_1min": os.getloadavg()[0]},
           "repeats": repeats, "real_run": REAL_RUN, "models": {}}
    for model in MODELS:
        absent = me5_absent() if model == "care_me5" else None
        out["models"][model] = {"skipped": absent} if absent else measure(model, repeats)
    out["machine_load"]["load_avg_1min_after"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("WANDB_MODE", "disabled")
    print(json.dumps(run(), indent=2, ensure_ascii=False))
