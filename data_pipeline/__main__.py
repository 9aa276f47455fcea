"""`python -m data_pipeline` runs every stage in order on the configured data; `stage=NAME` runs one,
`stage=[a,b,...]` those (in the order given), `stage=training` the ones training and evaluation read (every
stage but nano: what `make run` needs).
A stage of ON_REQUEST (score: a teacher's scores for distillation, which needs `teacher=...`) runs only when
named, never as part of `stage=all`.

Each stage is a module with `run(cfg) -> dict` (its stats) and `summary(stats) -> str` (one line of what it
produced, for the table printed at the end); stages read and write documented files under `cfg.data_dir`,
so any one can be re-run, inspected or replaced.
"""
from __future__ import annotations

import importlib
import sys
import time

import hydra
from omegaconf import DictConfig

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.allocator import keep_freed_memory
from care.config import CONF_DIR
from care.errors import app_errors
from care.families import require

APP = "python -m data_pipeline"

STAGES = {
    "import": "data_pipeline.import_stage",      # raw sources -> texts / pairs / candidates
    "dedup": "data_pipeline.dedup.stage",         # exact -> MinHash -> semantic, clusters
    "build": "data_pipeline.build",               # training examples, leakage rule against eval sets
    "mine": "data_pipeline.mining",               # FAISS hard negatives in the encoder's window
    "benchmarks": "data_pipeline.benchmarks",     # open stand-in evaluation task files
    "nano": "data_pipeline.nano.stage",           # Nano-style splits: 200 queries, 10K docs, candidate lists
    "score": "data_pipeline.score",               # a teacher's pair scores (on request: needs teacher=...)
}
ON_REQUEST = ("score",)  # not part of stage=all
ORDER = [name for name in STAGES if name not in ON_REQUEST]
# Named sets of stages: `all`, and `training` = what train.py and evaluate.py read (the Nano splits are
# `make nano`'s: no table of `make run` uses them, and they take most of a fresh pipeline's time).
SETS = {"all": ORDER, "training": [name for name in ORDER if name != "nano"]}
# The nano stage's `model=` must give dense vectors from one network (its candidate lists, keyed by one weights
# folder), asked here before it starts: the stage's own code is part of its fingerprint (nano/stage.py CODE), so a
# check there would rebuild every stored Nano folder.  The dedup and mine stages ask in their run().
NEEDS_ONE_DENSE_NETWORK = ("nano",)


def stage_names(stage) -> list[str]:
    """The stages `stage=` names: a set's name, one stage, or a list of stages."""
    if isinstance(stage, str):
        return SETS.get(stage, [stage])
    return [str(s) for s in stage]


@hydra.main(config_path=str(CONF_DIR), config_name="data_pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    keep_freed_memory()
    names = stage_names(cfg.stage)
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        print(f"{APP}: error: unknown stage '{unknown[0]}' (choose one of {', '.join(STAGES)}, a list of them, or "
              + "; ".join(f"{k}: {', '.join(v)}" for k, v in SETS.items()) + " in that order)", file=sys.stderr)
        sys.exit(1)
    rows = []
    for name in names:
        start = time.perf_counter()
        # bad input (the message names file and item), a full disk, a corrupt file, Ctrl-C: one line
        with app_errors(APP, cfg, writes_to=cfg.get("data_dir"), where=f"in stage {name}"):
            if name in NEEDS_ONE_DENSE_NETWORK:
                require(cfg.model, f"the {name} stage", one_backbone=True)
            stage = importlib.import_module(STAGES[name])
            stats = stage.run(cfg)
        rows.append((name, time.perf_counter() - start, stage.summary(stats or {})))
    if len(rows) > 1:  # the whole pipeline: one table of what each stage gave (a skipped stage takes ~0 s)
        print(f"\n{'stage':<11} {'seconds':>8}  result")
        for name, seconds, line in rows:
            print(f"{name:<11} {seconds:>8.1f}  {line}")


if __name__ == "__main__":
    main()
