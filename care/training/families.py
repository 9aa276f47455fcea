"""The model family one Trainer drives (care.training.model.TrainableFamily), picked by the model config's
`kind`: M3Family for `kind: dense | m3`, CAREFamily for one stage of `kind: care`.  The recipe above a family
(one run, or CARE's two stages) is picked in care.training.recipes.
"""
from __future__ import annotations

from omegaconf import DictConfig

from care.training.care_family import CAREFamily
from care.training.model import M3Family, TrainableFamily


def build_family(cfg: DictConfig) -> TrainableFamily:
    kind = cfg.model.get("kind", "dense")
    backend = cfg.model.get("backend", "torch")
    if backend != "torch":  # care/encoders/dense.py: the other backends run inference only
        raise ValueError(f"model {cfg.model.get('name')} has backend {backend!r}, which only encodes; "
                         f"train with the torch backend (model.backend=torch)")
    if kind in ("dense", "m3"):
        return M3Family(cfg)
    if kind == "care":
        return CAREFamily(cfg)
    raise ValueError(f"model kind '{kind}' cannot be trained (trainable kinds: dense, m3, care)")
