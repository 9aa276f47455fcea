"""The model families, in one place: how a model config is recognised (its `kind`), what each family is
(one backbone or two towers, its card's tag and words, where its backend option sits), and where each layer
finds the family's own code.  Every other module asks here instead of comparing `kind` with a name or
probing a config's keys (tests/test_family_seam.py greps for that); docs/design.md, "Adding a model family"
lists what a new family fills in.

    family_of(model)     the Family of a model config (a dict or DictConfig): its `kind`, `dense` when left out
    tower_configs(model) the configs of the parts that hold weights: the two towers, or the model itself
    hook(family, what)   a family's code for one layer, imported on demand (HOOK_LAYERS)

Hooks are "module:attribute" strings, imported by the layer that asks for them (the encoders' registry builds
an encoder, st_folder writes a folder, the training layer trains), so this module imports nothing of the
project and sits below every layer: a hook names code in its own layer or below (HOOK_LAYERS, held by
tests/test_family_seam.py), never above, as docs/design.md, "Layers" requires of an import.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass

#: the family of a model config that names no `kind` (every conf/model file names one)
DEFAULT_KIND = "dense"
#: the sides of a two-tower family, each with a tower config of its own (care.encoders.prompts.SIDES)
TWO_TOWERS = ("query", "document")
#: hook -> the layer its code lives in (and is imported from): never above the layer that resolves it
HOOK_LAYERS = {"encoder": "care.encoders.", "folder_files": "care.models.", "st_files": "care.encoders.",
               "trainer": "care.training.", "recipe": "care.training.", "scorer": "care.evaluation."}


@dataclass(frozen=True)
class Family:
    name: str            #: the `kind` of its model configs
    towers: tuple[str, ...]  #: () one backbone; TWO_TOWERS: a tower config per side, no top-level path
    tag: str             #: the model card's tag (care.export.card)
    description: str     #: what the model card calls it
    encoder: str         #: the Encoder class; `from_config(config, device)` builds it (care.encoders.registry)
    st_files: str        #: writes its sentence-transformers files: f(folder, config) -> folder (st_folder)
    trainer: str | None = None  #: its TrainableFamily class (care.training.families); None: not trainable
    recipe: str | None = None   #: the whole run train.py runs: f(cfg) -> summary; None: one Trainer run
    folder_files: str | None = None  #: the files that mark its folder (trained heads) without a training record
    citation: str | None = None  #: its paper's key in care.export.card_sections.CITATIONS
    flag_embedding: bool = False  #: FlagEmbedding's BGEM3FlagModel loads its folders (the card says how)
    backend: str | None = None  #: the config whose `backend:` picks torch or ONNX Runtime ("" the model's own)
    cuts: bool = True    #: `truncate_dim=` applies (a two-tower model's documents are already cut)
    #: scores a (query, passage) pair in one input and embeds nothing: its `encoder` is a pair scorer
    #: (score_pairs), a teacher or mining judge of raw logits, and evaluation's `scorer` hook builds its rows
    cross_encoder: bool = False
    #: evaluate.py's scorer of its rows instead of an EncoderScorer: f(entry, cfg, cache) -> scorer
    scorer: str | None = None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("dense", (), tag="dense", description="a dense sentence encoder",
           encoder="care.encoders.dense:HFDenseEncoder", st_files="care.encoders.st_folder:write_dense",
           trainer="care.training.model:M3Family", backend=""),  # trained with fresh sparse / ColBERT heads
    Family("m3", (), tag="bge-m3",
           description="a BGE-M3-style encoder (one backbone; dense, sparse and ColBERT heads)",
           encoder="care.encoders.m3:M3Encoder", st_files="care.encoders.st_folder:write_m3",
           trainer="care.training.model:M3Family", folder_files="care.models.m3:HEAD_FILES", citation="bge-m3",
           flag_embedding=True, backend=""),
    Family("care", TWO_TOWERS, tag="care",
           description="a CARE two-tower encoder (a small query tower, a large document tower; asymmetric retrieval)",
           encoder="care.encoders.care:CAREEncoder", st_files="care.encoders.st_folder:write_router",
           trainer="care.training.care_family:CAREFamily", recipe="care.training.care_recipe:run_care",
           citation="care", backend="query", cuts=False),
    Family("reranker", (), tag="reranker",
           description="a cross-encoder reranker (query and passage in one input, one relevance score out)",
           encoder="care.encoders.cross_encoder:CrossEncoder", st_files="care.encoders.st_folder:write_cross_encoder",
           trainer="care.training.reranker_family:RerankerFamily",
           recipe="care.training.reranker_recipe:run_reranker", cuts=False, cross_encoder=True,
           scorer="care.evaluation.rerank:reranker_scorer"),
)}


def family_of(model: Mapping) -> Family:
    """The family of a model config: the one rule, its `kind` (DEFAULT_KIND when it names none)."""
    kind = model.get("kind", DEFAULT_KIND)
    if kind not in FAMILIES:
        names = list(FAMILIES)
        raise ValueError(f"unknown model kind '{kind}' in model config (choose {', '.join(names[:-1])} or {names[-1]})")
    return FAMILIES[kind]


def tower_configs(model: Mapping) -> list:
    """The configs of a model's parts that hold weights (each has its `path`): a two-tower model's towers in
    side order, else the model config itself."""
    sides = family_of(model).towers
    return [model.get(side) or {} for side in sides] if sides else [model]


def hook(family: Family, what: str):
    """The code a family names for `what` (a HOOK_LAYERS key), imported now; None when it names none."""
    spec = getattr(family, what)
    if spec is None:
        return None
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)
