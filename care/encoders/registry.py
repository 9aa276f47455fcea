"""Build an encoder from a `model=` config, and recognise checkpoint folders.  `kind` picks the class:

dense  one backbone, pooled and normalised (multilingual-e5-small, bge-large-zh, tiny test models)
m3     BGE-M3 style: one backbone, dense + sparse + ColBERT heads (care.encoders.m3)
care   two towers: a small query tower online, a large document tower offline (care.encoders.care);
       `query.backend: torch | onnx` runs the query tower's backbone in torch or ONNX Runtime

`detect(folder, model_cfg)` says which model config builds a folder: a training run's final/ records its
own, an M3 checkpoint has the head files, any other Hugging Face folder is built like `model_cfg`.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from care.data.io import read_json
from care.encoders.base import Encoder
from care.encoders.prompts import LEGACY_TOWER_KEY, Prompts
from care.models.m3 import HEAD_FILES

TRAINING_RECORD = "care_training.json"  # written by the trainer beside every model it saves
CHECKPOINT_MODEL = "model"  # inside a training checkpoint (checkpoints/step-N/): its weights as a model folder


def build_encoder(cfg: DictConfig | dict, device: str | None = None) -> Encoder:
    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    kind = c.get("kind", "dense")
    common = {"name": c.get("name", kind), "pooling": c.get("pooling", "cls"), "prompts": Prompts.from_config(c),
              "max_length": c.get("max_length", 512), "device": device, "build_hint": c.get("build_hint", "")}
    if kind == "dense":
        from care.encoders.dense import HFDenseEncoder

        return HFDenseEncoder(str(c["path"]), normalize=c.get("normalize", True), truncate_dim=c.get("truncate_dim"),
                              padding_side=c.get("padding_side", "right"), backend=c.get("backend", "torch"),
                              **common)
    if kind == "m3":
        from care.encoders.m3 import M3Encoder

        return M3Encoder(str(c["path"]), truncate_dim=c.get("truncate_dim"), **common)
    if kind == "care":
        from care.encoders.care import CAREEncoder, check_query_backend

        check_query_backend(c["query"], c["document"])  # model.query.backend: refused before any tower is built
        ensure_towers(c)
        return CAREEncoder(tower_config(c["query"]), tower_config(c["document"]), name=c.get("name", kind),
                           prompts=common["prompts"], device=device)
    raise ValueError(f"unknown model kind '{kind}' in model config (choose dense, m3 or care)")


#: keys of a tower config that are not the tower's own (care.models.towers): how to build it, and the older
#: per-tower prompt (care.encoders.prompts)
TOWER_ONLY = ("build", LEGACY_TOWER_KEY)


def tower_config(c: dict) -> dict:
    return {k: v for k, v in c.items() if k not in TOWER_ONLY}


def ensure_towers(c: dict) -> None:
    """Build a configured tower folder on first use when its config says how (`build:`), then check that
    both towers can be had, before anything loads: one error names every missing tower and its override."""
    from care.models.hub import resolve_model_path

    missing = []
    for side in ("query", "document"):
        tower = c[side]
        if tower.get("build") and not Path(tower["path"]).exists():
            from care.encoders.build.towers import build_from_spec

            build_from_spec(dict(tower["build"]))
        try:
            resolve_model_path(str(tower["path"]), tower.get("build_hint", ""))
        except FileNotFoundError as e:
            missing.append(f"  {side} tower {tower['path']!r}: {e}\n    -> model.{side}.path=/local/folder")
    if missing:
        raise FileNotFoundError(f"model {c.get('name', 'care')}: {len(missing)} tower(s) cannot be loaded:\n"
                                + "\n".join(missing))


def read_record(folder: str | Path) -> dict:
    """The training record (care_training.json) of a model folder the trainer wrote."""
    return read_json(Path(folder) / TRAINING_RECORD)


def record_model_config(folder: str | Path) -> dict:
    """The model config a training record names, its paths made absolute: a record's paths are relative to
    its own folder ("." for a one-backbone model, "query" / "document" for CARE's towers), so a copied or
    moved folder still loads; an absolute path (a record written before paths were relative) is kept."""
    folder = Path(folder).resolve()
    model = read_record(folder)["model"]
    if model.get("kind") == "care":
        return {**model, **{side: {**model[side], "path": str(folder / model[side]["path"])}
                            for side in ("query", "document")}}
    return {**model, "path": str(folder)}


def detect(folder: str | Path, model_cfg: dict) -> dict | None:
    """The model config that builds `folder`, or None when it is no model folder."""
    folder = Path(folder)
    if (folder / TRAINING_RECORD).is_file():
        return record_model_config(folder)
    if all((folder / f).is_file() for f in HEAD_FILES):
        return {**model_cfg, "kind": "m3", "path": str(folder)}
    if (folder / "config.json").is_file():
        return {**model_cfg, "path": str(folder)}
    return None
