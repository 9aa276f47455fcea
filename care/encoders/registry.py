"""Build an encoder from a `model=` config, and recognise checkpoint folders.  `kind` picks the family
(care.families), and the family its Encoder class:

dense  one backbone, pooled and normalised (multilingual-e5-small, bge-large-zh, tiny test models)
m3     BGE-M3 style: one backbone, dense + sparse + ColBERT heads (care.encoders.m3)
care   two towers: a small query tower online, a large document tower offline (care.encoders.care);
       `query.backend: torch | onnx` runs the query tower's backbone in torch or ONNX Runtime
reranker  a cross-encoder: one score per (query, passage) pair, no vectors (care.encoders.cross_encoder)

One contract per output (care.families `outputs`): `build_encoder` returns an Encoder, for every family that
gives vectors; `build_pair_scorer` a PairScorer, for a family that gives pair scores.  Each refuses the other
kind of family in one line naming it.

`detect(folder, model_cfg)` says which model config builds a folder: a training run's final/ records its
own, a folder holding a family's marker files (an M3 checkpoint's head files) is of that family, any other
Hugging Face folder is built like `model_cfg`.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from care.data.io import read_json
from care.encoders.base import Encoder, PairScorer
from care.encoders.onnx_backend import resolve_backend
from care.encoders.prompts import LEGACY_TOWER_KEY
from care.families import EMBEDDINGS, FAMILIES, PAIR_SCORES, family_of, hook, require

TRAINING_RECORD = "care_training.json"  # written by the trainer beside every model it saves
CHECKPOINT_MODEL = "model"  # inside a training checkpoint (checkpoints/step-N/): its weights as a model folder


def best_weights(step: int) -> str:
    """The training record's `weights` of a folder holding the best validation's weights (step `step`)."""
    return f"best (step {step})"


def holds_starting_weights(record: dict) -> bool:
    """The record's run trained, yet its folder holds the weights it started from: no validation after step 0
    beat the start (a tie keeps it)."""
    return record.get("weights") == best_weights(0) and (record.get("steps") or 0) > 0


def build_encoder(cfg: DictConfig | dict, device: str | None = None, backend: str = "auto") -> Encoder:
    """The encoder of a model config for inference: its family's Encoder class (care.families) built by
    `from_config`.  `backend` fills the family's backend option when the config names none (`auto`: ONNX
    Runtime fp32 on the CPU when onnxruntime is installed, else torch; care/encoders/onnx_backend.py
    resolve_backend); a backend the config names is kept.  Training builds its encoders itself, in torch.
    A family that gives no vectors (a reranker's pair scores) is refused in one line: build_pair_scorer."""
    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    family = require(c, "as an Encoder (build_encoder)", needs=EMBEDDINGS, instead="it is built by build_pair_scorer "
                     "(care/encoders/registry.py), scored by evaluate.py and serves the score stage as a teacher")
    if family.backend is not None:
        side = dict(c[family.backend]) if family.backend else c
        side["backend"] = resolve_backend(side.get("backend", backend), device)
        c = {**c, family.backend: side} if family.backend else side
    return hook(family, "encoder").from_config(c, device)


def build_pair_scorer(cfg: DictConfig | dict, device: str | None = None) -> PairScorer:
    """The pair scorer of a model config whose family gives pair scores (care.families PAIR_SCORES: a
    cross-encoder reranker), built by its class's `from_config`; any other family is refused in one line."""
    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    family = require(c, "as a pair scorer (build_pair_scorer)", needs=(PAIR_SCORES,), instead="build_encoder builds it")
    return hook(family, "encoder").from_config(c, device)


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
            from care.encoders.builders.towers import build_from_spec

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
    if sides := family_of(model).towers:
        return {**model, **{side: {**model[side], "path": str(folder / model[side]["path"])} for side in sides}}
    return {**model, "path": str(folder)}


def detect(folder: str | Path, model_cfg: dict) -> dict | None:
    """The model config that builds `folder`, or None when it is no model folder."""
    folder = Path(folder)
    if (folder / TRAINING_RECORD).is_file():
        return record_model_config(folder)
    for family in FAMILIES.values():
        marks = hook(family, "folder_files")
        if marks and all((folder / f).is_file() for f in marks):
            return {**model_cfg, "kind": family.name, "path": str(folder)}
    if (folder / "config.json").is_file():
        return {**model_cfg, "path": str(folder)}
    return None
