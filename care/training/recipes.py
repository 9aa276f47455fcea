"""What `python train.py` runs: the whole recipe a model config asks for, named by its family (care.families) --
CARE's stages in order (`kind: care`, care.training.care_recipe.run_care), or one Trainer run for every family
that names no recipe of its own.
"""
from __future__ import annotations

from omegaconf import DictConfig

from care.families import family_of, hook
from care.training.checkpoint import AlreadyFinished
from care.training.trainer import Trainer


def train(cfg: DictConfig) -> dict:
    """Train (or resume) the run `cfg` describes; returns its summary (`best_metric` among it).  A run that
    finished before with the same config is not trained again: its summary is returned (make run re-runs)."""
    recipe = hook(family_of(cfg.model), "recipe")
    if recipe is not None:
        return recipe(cfg)
    try:
        trainer = Trainer(cfg)
    except AlreadyFinished as done:
        print(done)
        return done.summary
    return trainer.fit()
