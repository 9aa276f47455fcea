"""What `python train.py` runs: the whole recipe a model config asks for, picked by its `kind` in this one place --
CARE's stages in order (`kind: care`, care.training.care_recipe), or one Trainer run for every other kind.
"""
from __future__ import annotations

from omegaconf import DictConfig

from care.training.care_recipe import run_care
from care.training.checkpoint import AlreadyFinished
from care.training.trainer import Trainer


def train(cfg: DictConfig) -> dict:
    """Train (or resume) the run `cfg` describes; returns its summary (`best_metric` among it).  A run that
    finished before with the same config is not trained again: its summary is returned (make run re-runs)."""
    if cfg.model.get("kind") == "care":
        return run_care(cfg)
    try:
        trainer = Trainer(cfg)
    except AlreadyFinished as done:
        print(done)
        return done.summary
    return trainer.fit()
