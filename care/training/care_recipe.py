"""The CARE recipe: `python train.py model=care_X` runs stage I then stage II (docs/facts.md s.1), each a run
of the ordinary loop with the stage's settings from the model config (`stages.stage1`, `stages.stage2`),
into outputs/train/<run>/stage1/ and stage2/; outputs/train/<run>/final/ then holds the last stage's model
(hard links to its files, its care_training.json naming both stages, which evaluate.py ckpt= reads).  `model.stage=stage1` (or stage2) runs one stage.

Stage I's examples are same-text pairs over the training text store (plus `stages.stage1.extra_texts`,
text stores of unlabelled texts the leakage rule admits): no labels needed.  Stage II trains on the mined
training file, starting from stage I's query tower; it alone can distil teacher scores
(`stages.stage2.loss.teacher_weight`: the mined file's `teacher_*_scores`).  Matryoshka widths
(`stages.<stage>.loss.matryoshka_dims`) apply to either stage.
"""
from __future__ import annotations

import gc
import os
import random
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from care.data.io import atomic_folder, link_or_copy_tree, read_text_store, write_json, write_jsonl
from care.encoders.registry import TRAINING_RECORD, ensure_towers, read_record
from care.export.card import write_model_card
from care.training.care_family import STAGES
from care.training.checkpoint import AlreadyFinished
from care.training.data import require_training_files
from care.training.trainer import Trainer

# The M3 recipe's knobs that mean nothing for two towers: neutral in every CARE stage.
NEUTRAL = {"merge_with_start": None, "query_side_pools": []}


def same_text_pairs(training: str, extra: list[str], out: Path, max_extra: int | None = None,
                    seed: int = 0) -> tuple[Path, Path]:
    """texts.jsonl + train.jsonl of one example per distinct text (the text is its own positive): every
    training text, plus up to `max_extra` texts of the `extra` stores (a seeded sample, in store order)."""
    texts: dict[str, str] = {}  # text -> the first id it came with, in store order
    for tid, text in read_text_store(training).items():
        texts.setdefault(text, tid)
    extras: dict[str, str] = {}
    for store in extra:
        for tid, text in read_text_store(store).items():
            if text not in texts:
                extras.setdefault(text, tid)
    pool = list(extras.items())
    if max_extra is not None and len(pool) > max_extra:
        keep = sorted(random.Random(seed).sample(range(len(pool)), max_extra))
        pool = [pool[i] for i in keep]
    texts.update(pool)
    write_jsonl(out / "texts.jsonl", ({"id": tid, "text": text} for text, tid in texts.items()))
    write_jsonl(out / "train.jsonl", ({"query_id": tid, "pos_ids": [tid]} for tid in texts.values()))
    return out / "texts.jsonl", out / "train.jsonl"


def stage_config(cfg: DictConfig, stage: str, run_dir: Path) -> DictConfig:
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    spec = c.model.stages[stage]
    with open_dict(c):
        c.trainer = OmegaConf.merge(c.trainer, NEUTRAL, spec.get("trainer") or {})
        c.loss = spec.loss
        c.model.current_stage = stage
        c.model.stages = {stage: spec}  # a stage's config (and hash) never depends on another stage's settings
        c.output_dir = str(run_dir / stage)
        c.run_name = f"{cfg.run_name}-{stage}"
        if stage == "stage1":
            require_training_files(cfg.data.texts, cfg.data.examples)
            if (spec.loss.get("teacher_weight") or 0) > 0:
                raise ValueError("model.stages.stage1.loss.teacher_weight > 0: stage I trains on same-text pairs, "
                                 "which have no teacher scores; distil in stage II "
                                 "(model.stages.stage2.loss.teacher_weight), or set it to 0")
            for extra in spec.get("extra_texts") or []:
                if not Path(extra).exists():
                    raise FileNotFoundError(
                        f"model.stages.stage1.extra_texts names {extra}, which does not exist: the build stage of "
                        f"`python -m data_pipeline` writes unlabelled_texts.jsonl; or pass "
                        f"model.stages.stage1.extra_texts=[] to align the training texts only")
            files = same_text_pairs(cfg.data.texts, list(spec.get("extra_texts") or []), run_dir / "stage1-data",
                                    spec.get("extra_texts_max"), cfg.seed)
            c.data.texts, c.data.examples = (str(p) for p in files)
        else:
            start = Path(spec.get("query_from") or run_dir / "stage1" / "final" / "query")
            if not (start / "config.json").exists():
                raise FileNotFoundError(
                    f"stage II starts from stage I's query tower, and {start} holds none: run stage I first "
                    f"(model.stage=stage1, or model.stage=all) or name one with model.stages.stage2.query_from=PATH")
            c.model.query.path = str(start)
            c.model.query.pop("build", None)
    return c


def run_care(cfg: DictConfig) -> dict:
    ensure_towers(OmegaConf.to_container(cfg.model, resolve=True))  # missing towers: said in seconds
    run_dir = Path(cfg.output_dir)
    chosen = cfg.model.get("stage", "all")
    stages = list(STAGES) if chosen == "all" else [chosen]
    if any(s not in STAGES for s in stages):
        raise ValueError(f"model.stage={chosen!r}: choose stage1, stage2 or all")
    summaries = {}
    for stage in stages:
        try:
            trainer = Trainer(stage_config(cfg, stage, run_dir))
        except AlreadyFinished as done:
            print(f"{stage}: {done}")
            summaries[stage] = done.summary
            continue
        # Under torchrun the process group must outlive stage I (the next Accelerator would not re-create it).
        summaries[stage] = trainer.fit(end_training=stage == stages[-1])
        del trainer  # stage I's towers and optimizer, before stage II loads its own
        gc.collect()
    last = run_dir / stages[-1] / "final"
    # one process writes it (two would race on the folder swap); by the launcher's RANK, since the last
    # stage's end_training has already torn down accelerate's process group
    if os.environ.get("RANK", "0") == "0":
        # the last stage's model, whole (hard links: no second copy of the towers on disk), its record naming
        # each stage's folder relative to the run
        record = {**read_record(last), "stages": {s: f"{s}/final" for s in stages}}
        with atomic_folder(run_dir / "final") as tmp:
            link_or_copy_tree(last, tmp, skip=frozenset({TRAINING_RECORD, "README.md"}))
            write_json(tmp / TRAINING_RECORD, record)
        write_model_card(run_dir / "final", record)
    best = summaries[stages[-1]].get("best_metric")
    return {"stages": summaries, "final": str(run_dir / "final"), "best_metric": best}
