"""The model families, in one place: how a model config is recognised (its `kind`), what each family is
(one backbone or two towers, what its model gives, its card's tag and words, where its backend option sits),
and where each layer finds the family's own code.  Every other module asks here instead of comparing `kind`
with a name, probing a config's keys or probing an encoder's class (tests/test_family_seam.py scans for all
three); docs/design.md, "Adding a model family" lists what a new family fills in.

    family_of(model)     the Family of a model config (a dict or DictConfig): its `kind`, `dense` when left out
    tower_configs(model) the configs of the parts that hold weights: the two towers, or the model itself
    hook(family, what)   a family's code for one layer, imported on demand (HOOK_LAYERS)
    require(model, app, needs, one_backbone)   its Family when it can serve `app`, else one line saying why
                         and which kinds can (every app that embeds asks before it builds or fingerprints)
    register_family(f)   the one way a family enters FAMILIES (the project's four below, a user's or a test's)

What a family's model gives is its `outputs` (OUTPUTS): vectors per text (dense, sparse lexical weights,
ColBERT token vectors; its `encoder` is then a care.encoders.Encoder whose heads they are, the first the one
it gives by default) or one score per (query, passage) pair (its `encoder` is then a pair scorer).

Hooks are "module:attribute" strings, imported by the layer that asks for them (the encoders' registry builds
an encoder, st_folder writes a folder, the training layer trains), so this module imports nothing of the
project and sits below every layer: a hook names code in its own layer or below (HOOK_LAYERS, held by
tests/test_family_seam.py), never above, as docs/design.md, "Layers" requires of an import.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: the family of a model config that names no `kind` (every conf/model file names one)
DEFAULT_KIND = "dense"
#: the sides of a two-tower family, each with a tower config of its own (care.encoders.prompts.SIDES)
TWO_TOWERS = ("query", "document")
#: hook -> the layer its code lives in (and is imported from): never above the layer that resolves it
HOOK_LAYERS = {"encoder": "care.encoders.", "folder_files": "care.models.", "st_files": "care.encoders.",
               "trainer": "care.training.", "recipe": "care.training.", "scorer": "care.evaluation."}
#: what a model can give: vectors per text (EMBEDDINGS, the heads of care.models.HEADS) or PAIR_SCORES
DENSE, SPARSE, COLBERT, PAIR_SCORES = "dense", "sparse", "colbert", "pair_scores"
EMBEDDINGS = (DENSE, SPARSE, COLBERT)
OUTPUTS = (*EMBEDDINGS, PAIR_SCORES)
#: how a refusal names each output
OUTPUT_WORDS = {DENSE: "dense vectors", SPARSE: "sparse lexical weights", COLBERT: "ColBERT token vectors",
                PAIR_SCORES: "pair scores (one per query and passage)"}


@dataclass(frozen=True)
class Family:
    name: str            #: the `kind` of its model configs
    towers: tuple[str, ...]  #: () one backbone; TWO_TOWERS: a tower config per side, no top-level path
    tag: str             #: the model card's tag (care.export.card)
    description: str     #: what the model card calls it
    #: the class `from_config(config, device)` builds for inference (care.encoders.registry): an Encoder
    #: (build_encoder) when its outputs are vectors, a pair scorer (build_pair_scorer) for PAIR_SCORES
    encoder: str
    #: what its model gives (OUTPUTS): EMBEDDINGS in the order of its encoder's heads (the first: what it
    #: gives when asked for nothing in particular), or PAIR_SCORES alone
    outputs: tuple[str, ...] = (DENSE,)
    #: writes its sentence-transformers files: f(folder, config) -> folder (st_folder); None: a family whose
    #: folders this project never writes (no trainer)
    st_files: str | None = None
    trainer: str | None = None  #: its TrainableFamily class (care.training.model.build_family); None: not trainable
    recipe: str | None = None   #: the whole run train.py runs: f(cfg) -> summary; None: one Trainer run
    folder_files: str | None = None  #: the files that mark its folder (trained heads) without a training record
    citation: str | None = None  #: its paper's key in care.export.card_sections.CITATIONS
    flag_embedding: bool = False  #: FlagEmbedding's BGEM3FlagModel loads its folders (the card says how)
    backend: str | None = None  #: the config whose `backend:` picks torch or ONNX Runtime ("" the model's own)
    cuts: bool = True    #: `truncate_dim=` applies (a two-tower model's documents are already cut)
    #: evaluate.py's scorer of its rows instead of an EncoderScorer: f(entry, cfg, cache) -> scorer
    scorer: str | None = None

    @property
    def cross_encoder(self) -> bool:
        """Scores a (query, passage) pair in one input and embeds nothing: its `encoder` is a pair scorer
        (score_pairs), a teacher or mining judge of raw logits, and evaluation's `scorer` hook builds its rows."""
        return PAIR_SCORES in self.outputs

    @property
    def embeds(self) -> bool:
        """Gives vectors per text (any of EMBEDDINGS): its `encoder` is an Encoder."""
        return any(o in EMBEDDINGS for o in self.outputs)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family to FAMILIES (the project's own below; a user's or a test's the same way), checked first: a
    new kind, outputs among OUTPUTS (vectors, or pair scores alone), one backbone or TWO_TOWERS, and every
    hook a "module:attribute" string.  The family, for `X = register_family(Family(...))`."""
    where = f"model family '{family.name}'"
    if not family.name or family.name in FAMILIES:
        raise ValueError(f"{where}: {'a kind is needed' if not family.name else 'that kind is registered already'}")
    if not family.outputs or set(family.outputs) - set(OUTPUTS) or len(set(family.outputs)) < len(family.outputs):
        raise ValueError(f"{where}: outputs={family.outputs} must be distinct names among {', '.join(OUTPUTS)}")
    if family.cross_encoder and len(family.outputs) > 1:
        raise ValueError(f"{where}: {PAIR_SCORES} come alone (a pair scorer embeds nothing), not with "
                         f"{[o for o in family.outputs if o != PAIR_SCORES]}")
    if tuple(family.towers) not in ((), TWO_TOWERS):
        raise ValueError(f"{where}: towers={family.towers} must be () (one backbone) or {TWO_TOWERS}")
    for what in HOOK_LAYERS:
        spec = getattr(family, what)
        if spec is not None and (not isinstance(spec, str) or spec.count(":") != 1):
            raise ValueError(f"{where}: its {what} hook {spec!r} is no 'module:attribute' string")
    FAMILIES[family.name] = family
    return family


for _family in (
    Family("dense", (), tag="dense", description="a dense sentence encoder",
           encoder="care.encoders.dense:HFDenseEncoder", st_files="care.encoders.st_folder:write_dense",
           trainer="care.training.model:M3Family", backend=""),  # trained with fresh sparse / ColBERT heads
    Family("m3", (), tag="bge-m3",
           description="a BGE-M3-style encoder (one backbone; dense, sparse and ColBERT heads)",
           encoder="care.encoders.m3:M3Encoder", outputs=EMBEDDINGS, st_files="care.encoders.st_folder:write_m3",
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
           outputs=(PAIR_SCORES,), trainer="care.training.reranker_family:RerankerFamily",
           recipe="care.training.reranker_recipe:run_reranker", cuts=False,
           scorer="care.evaluation.rerank:reranker_scorer"),
):
    register_family(_family)
del _family


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


def require(model: Mapping, app: str, needs: Sequence[str] = (DENSE,), one_backbone: bool = False,
            instead: str | None = None) -> Family:
    """The family of a model config when it can serve `app` (what the refusal calls the use: "encode.py",
    "the mine stage"): its model gives one of `needs` (OUTPUTS) and, with `one_backbone`, is one network (a
    stage that keys its work by one weights folder, `model.path`).  Else a ValueError of one line naming the
    model, its family and what it gives, and `instead` (default: the kinds that can serve)."""
    family = family_of(model)
    lacks = not set(needs) & set(family.outputs)
    if not lacks and not (one_backbone and family.towers):
        return family

    def words(outputs: Sequence[str]) -> str:
        names = [OUTPUT_WORDS[o] for o in outputs]
        return ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]

    if lacks:
        why = f"gives {words(family.outputs).replace(' or ', ' and ')}, not {words(needs)}"
    else:
        why = f"has {len(family.towers)} towers ({' and '.join(family.towers)}), not the one network needed"
    if instead is None:
        kinds = [f.name for f in FAMILIES.values()
                 if set(needs) & set(f.outputs) and not (one_backbone and f.towers)]
        instead = "use a model of kind " + (", ".join(kinds[:-1]) + " or " if len(kinds) > 1 else "") + kinds[-1]
    name = model.get("name") or model.get("path") or family.name
    raise ValueError(f"model {name!r} cannot serve {app}: it is a {family.name} model, {family.description}, "
                     f"and {why}; {instead}")
