"""The model family one Trainer drives (care.training.model.TrainableFamily), named by the model config's family
(care.families): M3Family for `kind: dense | m3`, CAREFamily for one stage of `kind: care`.  The recipe above a
family (one run, or CARE's two stages) is picked in care.training.recipes.
"""
from __future__ import annotations

from omegaconf import DictConfig

from care.families import FAMILIES, family_of, hook
from care.training.model import TrainableFamily


def build_family(cfg: DictConfig) -> TrainableFamily:
    family = family_of(cfg.model)
    backend = cfg.model.get("backend", "torch")
    if backend != "torch":  # care/encoders/dense.py: the other backends run inference only
        raise ValueError(f"model {cfg.model.get('name')} has backend {backend!r}, which only encodes; "
                         f"train with the torch backend (model.backend=torch)")
    trainable = hook(family, "trainer")
    if trainable is None:
        names = ", ".join(f.name for f in FAMILIES.values() if f.trainer)
        raise ValueError(f"model kind '{family.name}' cannot be trained (trainable kinds: {names})")
    return trainable(cfg)
