"""Any project encoder as an mteb 2.x model, and mteb.evaluate on it.

    import_mteb()                     `import mteb`, its import-time result cache pointed at the project cache
    dense_only(encoder, app)          refuse, in one line, an encoder without a dense head (mteb scores vectors)
    default_similarity(encoder)       "dot" for encoders whose dense vectors are not unit length, else "cosine"
    parameter_counts(encoder)         {total, online, embedding, online_embedding} parameters (both towers of CARE)
    embed_width(encoder)              the dense width (a tower's dim, truncate_dim, the hidden size)
    model_meta(encoder, similarity)   mteb's ModelMeta for the encoder (no loader: never resolved by name)
    MtebEncoder(encoder)              the encoder as an mteb EncoderProtocol (prompt type -> query/document side)
    mteb_evaluate(encoder, tasks)     mteb.evaluate, no progress bars; results=<folder>: mteb's result cache there

What the model is (its networks, widths, token limit, whether its vectors are unit length) is asked of the
Encoder interface (care/encoders/base.py), never probed by class or attribute (tests/test_family_seam.py).
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from care.encoders import Encoder
from care.encoders.cache import EmbeddingCache, embed
from care.paths import cache_dir

#: mteb task type -> the project's task type (care.encoders.prompts: the query instruction it takes)
TASK_TYPES = {"Retrieval": "retrieval", "InstructionRetrieval": "retrieval", "Reranking": "reranking",
              "InstructionReranking": "reranking", "STS": "sts", "PairClassification": "sts"}
LANGUAGES = ["cmn-Hans"]


def import_mteb():
    """`import mteb` with its import-time result cache kept out of the user's home (see the package docstring:
    Caching)."""
    if "mteb" not in sys.modules:
        os.environ.setdefault("MTEB_CACHE", str(cache_dir() / "mteb"))
    import mteb

    return mteb


def dense_only(encoder: Encoder, app: str = "mteb") -> Encoder:
    """The encoder, when it gives dense vectors (what mteb and this adapter score); else one line saying so."""
    if "dense" not in encoder.heads:
        raise ValueError(f"{app}: {encoder.name} gives {', '.join(encoder.heads)} but no dense vectors, which mteb "
                         f"scores; evaluate.py scores it")
    return encoder


def default_similarity(encoder: Encoder) -> str:
    """"dot" for encoders whose dense vectors are not unit length by design (evaluate.py scores every encoder
    by the dot product), else "cosine"."""
    return "cosine" if encoder.unit_vectors else "dot"


def _modules(encoder: Encoder) -> list:
    """The torch modules whose weights make the encoder, each once (Encoder.networks: CARE's two towers, a
    dense or M3 model's network); none for an encoder that is no torch model (a test double)."""
    return list({id(m): m for m in encoder.networks.values()}.values())


def _embedding_weights(module) -> int:
    inner = getattr(module, "model", module)  # a Tower wraps its Hugging Face model
    for m in (inner, getattr(inner, "backbone", None)):  # M3Model keeps its transformer as .backbone
        get = getattr(m, "get_input_embeddings", None)
        if get is not None:
            with contextlib.suppress(Exception):
                return int(get().weight.numel())
    return 0


def parameter_counts(encoder: Encoder) -> dict[str, int | None]:
    """{total, online, embedding, online_embedding}: every weight of the model (both towers of a two-tower
    model, a weight shared between them counted once), those that run at query time (the query tower;
    `encoder.online_parameters`), and of each the token-embedding matrices (a lookup, not compute).
    A symmetric model's total is its online count; None where the encoder cannot say."""
    online = int(encoder.online_parameters)
    online_embedding = int(encoder.online_embedding_parameters or 0) or None
    modules = _modules(encoder)
    if len(modules) < 2:  # one network for both sides
        return {"total": online, "online": online, "embedding": online_embedding,
                "online_embedding": online_embedding}
    seen, total = set(), 0
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
    embedding = sum(_embedding_weights(m) for m in modules) or None
    return {"total": total, "online": online, "embedding": embedding, "online_embedding": online_embedding}


def embed_width(encoder: Encoder, probe: bool = False) -> int | None:
    """The width of the dense vectors the encoder returns (both sides have it: CARE cuts its document vectors
    to the query tower's width): from the model (Encoder.dense_width: a tower's `dim`, a dense model's
    `truncate_dim` or hidden size), else, with `probe`, from one encoded query; None when neither says."""
    if encoder.dense_width:
        return int(encoder.dense_width)
    if probe:
        with contextlib.suppress(Exception):
            return int(np.asarray(encoder.encode_queries(["维度"], heads=("dense",)).dense).shape[1])
    return None


def _memory_mb(encoder: Encoder) -> float | None:
    modules = _modules(encoder)
    if not modules:
        return None
    seen, size = set(), 0
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                size += t.numel() * t.element_size()
    return round(size / 2**20, 1)


#: ModelMeta fields a caller may set (model_meta's `extra`, MtebEncoder's `meta`); the rest come from the encoder
META_FIELDS = ("license", "training_datasets", "open_weights", "reference", "release_date", "adapted_from",
               "public_training_code", "public_training_data", "citation", "contacts", "embed_dim")


def model_meta(encoder: Encoder, similarity: str, name: str | None = None, revision: str | None = None,
               probe: bool = False, **extra):
    """mteb's ModelMeta for a project encoder: no loader (mteb never builds or looks the model up).

    name `care/<encoder name>` (any `org/name` given is kept), revision the encoder's fingerprint.
    What the model is, from the encoder (the package docstring, Results):
      model_type   ["router", "dense"] for CARE (a query tower and a document tower, one dense vector each),
                   ["dense"] for any other (an M3 model is scored by its dense head here)
      n_parameters both towers' weights (parameter_counts' total); a symmetric model's all
      n_embedding_parameters   their token-embedding matrices
      n_active_parameters_override   CARE only: the query tower's non-embedding weights (what runs per
                   query; mteb's `active` leaves embeddings out).  The online count (encoder.online_parameters)
                   is that plus the query tower's embedding matrix.  Symmetric models: mteb's own
                   n_parameters - n_embedding_parameters.
      embed_dim    the dense width (embed_width; `probe` encodes one query when the model does not say)
      max_tokens, memory_usage_mb, use_instructions, similarity_fn_name (cosine or dot, as scored)
    `extra`: META_FIELDS set by the caller: license (an mteb license id, e.g. "apache-2.0"; None = not
    stated), training_datasets (mteb task names the model trained on: a set, empty = none of mteb's; None =
    not stated), open_weights, reference, ..."""
    import_mteb()
    from mteb.models.model_meta import ModelMeta

    unknown = set(extra) - set(META_FIELDS)
    if unknown:
        raise TypeError(f"model_meta: unknown fields {sorted(unknown)} (settable: {', '.join(META_FIELDS)})")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name or encoder.name).strip("_") or "encoder"
    if name and "/" in name:
        org, _, rest = name.partition("/")
        slug = "/".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", p).strip("_") or "encoder" for p in (org, rest))
    prompts = encoder.prompts
    counts = parameter_counts(encoder)
    two_towers = len(_modules(encoder)) > 1  # CARE: a query and a document tower
    active = None
    if two_towers:
        active = counts["online"] - (counts["online_embedding"] or 0)
    training = extra.pop("training_datasets", None)
    backend = str(encoder.backend)
    fields = {
        "loader": None, "name": slug if "/" in slug else f"care/{slug}", "revision": revision or encoder.fingerprint,
        "release_date": None, "languages": LANGUAGES, "n_parameters": counts["total"],
        "n_active_parameters_override": active, "n_embedding_parameters": counts["embedding"],
        "memory_usage_mb": _memory_mb(encoder), "max_tokens": encoder.max_tokens,
        "embed_dim": embed_width(encoder, probe), "license": None, "open_weights": None,
        "public_training_code": None, "public_training_data": None,
        "framework": ["PyTorch", "ONNX"] if backend.startswith("onnx") else ["PyTorch"], "reference": None,
        "similarity_fn_name": similarity,
        "use_instructions": bool(prompts.query or prompts.document or prompts.instructions),
        "training_datasets": None if training is None else {training} if isinstance(training, str) else set(training),
        "modalities": ["text"], "model_type": ["router", "dense"] if two_towers else ["dense"]}
    fields.update({k: v for k, v in extra.items() if v is not None or k != "embed_dim"})
    return ModelMeta(**fields)


class MtebEncoder:
    """A project Encoder as an mteb 2.x encoder (EncoderProtocol): dense vectors, float32 numpy.

    task_types: {mteb task name or type: project task type}, ahead of TASK_TYPES.
    cache: a care.encoders.cache.EmbeddingCache to share vectors with evaluate.py (none by default).
    name, revision, meta: the ModelMeta's name, revision and caller-set fields (model_meta, META_FIELDS:
    license, training_datasets, ...)."""

    def __init__(self, encoder: Encoder, *, similarity: str = "auto", task_types: Mapping[str, str] | None = None,
                 cache: EmbeddingCache | None = None, batch_size: int | None = None, name: str | None = None,
                 revision: str | None = None, meta: Mapping[str, Any] | None = None):
        if similarity == "auto":
            similarity = default_similarity(encoder)
        if similarity not in ("cosine", "dot"):
            raise ValueError(f"similarity must be auto, cosine or dot, got {similarity!r}")
        self.encoder, self.similarity_name, self.cache, self.batch_size = dense_only(encoder), similarity, cache, batch_size
        self.task_types = dict(task_types or {})
        self.mteb_model_meta = model_meta(encoder, similarity, name, revision, **dict(meta or {}))

    def with_task_types(self, task_types: Mapping[str, str]) -> MtebEncoder:
        """A wrapper of the same encoder (shared, not copied) with more task-type overrides."""
        other = copy.copy(self)
        other.task_types = {**self.task_types, **task_types}
        return other

    def project_task(self, task_metadata) -> str | None:
        t = self.task_types
        return t.get(task_metadata.name) or t.get(task_metadata.type) or TASK_TYPES.get(task_metadata.type)

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None,
               **kwargs: Any) -> np.ndarray:
        texts = [t for batch in inputs for t in batch["text"]]
        side = "document" if str(getattr(prompt_type, "value", prompt_type)) == "document" else "query"
        batch_size = self.batch_size or kwargs.get("batch_size") or 32
        emb = embed(self.encoder, texts, side, self.cache, batch_size, ("dense",),
                    bool(kwargs.get("show_progress_bar", False)), self.project_task(task_metadata))
        return np.ascontiguousarray(emb.dense, dtype=np.float32)

    def similarity(self, embeddings1, embeddings2):
        from mteb.similarity_functions import cos_sim, dot_score

        return (cos_sim if self.similarity_name == "cosine" else dot_score)(embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2):
        from mteb.similarity_functions import pairwise_cos_sim, pairwise_dot_score

        pairwise = pairwise_cos_sim if self.similarity_name == "cosine" else pairwise_dot_score
        return pairwise(embeddings1, embeddings2)

    def __repr__(self) -> str:
        return f"MtebEncoder({self.encoder.name}, similarity={self.similarity_name})"


@contextlib.contextmanager
def _quiet_datasets():
    """No `datasets` progress bars while mteb maps its small in-memory datasets (restored afterwards)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def mteb_evaluate(encoder: Encoder | MtebEncoder, tasks: Sequence, batch_size: int = 64,
                  results: str | os.PathLike | None = None, overwrite: str = "always"):
    """mteb.evaluate of the encoder (an MtebEncoder, or an Encoder wrapped as one, each task's `care_task_type`
    as its project task type) on mteb tasks, no progress bars: mteb's result (a ModelResult).

    results: None writes nothing (cache=None); a folder is an mteb ResultCache (mteb's own writer):
    `<folder>/results/<org__name>/<revision>/<Task>.json`, `model_meta.json` and `run_settings.jsonl` beside
    them (care.evaluation.mteb_adapter.results).  `overwrite` is mteb's overwrite_strategy: "always" (default)
    scores every task afresh and replaces its file (mteb's own default, "only-missing", would hand back a stored
    result of a task of the same name even when its data changed since); "only-missing" reuses them."""
    mteb = import_mteb()
    model = encoder if isinstance(encoder, MtebEncoder) else MtebEncoder(encoder)
    model = model.with_task_types({t.metadata.name: t.care_task_type for t in tasks
                                   if getattr(t, "care_task_type", None)})
    cache = None
    if results is not None:
        from mteb.cache import ResultCache

        if model.mteb_model_meta.embed_dim is None:  # a width the model does not state: one query tells it
            width = embed_width(model.encoder, probe=True)
            model.mteb_model_meta = model.mteb_model_meta.model_copy(update={"embed_dim": width})
        cache = ResultCache(Path(results))
    with _quiet_datasets():
        return mteb.evaluate(model, tasks, cache=cache, overwrite_strategy=overwrite, co2_tracker=False,
                             show_progress_bar=False, encode_kwargs={"batch_size": batch_size,
                                                                     "show_progress_bar": False})
