"""Any project encoder as an mteb 2.x model, and mteb.evaluate on it.

    import_mteb()                     `import mteb`, its import-time result cache pointed at the project cache
    default_similarity(encoder)       "dot" for encoders whose dense vectors are not unit length, else "cosine"
    model_meta(encoder, similarity)   mteb's ModelMeta for the encoder (no loader: never resolved by name)
    MtebEncoder(encoder)              the encoder as an mteb EncoderProtocol (prompt type -> query/document side)
    mteb_evaluate(encoder, tasks)     mteb.evaluate, nothing cached or written, no progress bars
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
from collections.abc import Mapping, Sequence
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


def default_similarity(encoder: Encoder) -> str:
    """"dot" for encoders whose dense vectors are not unit length by design (evaluate.py scores every encoder
    by the dot product), else "cosine"."""
    from care.encoders.care import CAREEncoder

    if isinstance(encoder, CAREEncoder) or not getattr(encoder, "normalize", True) \
            or getattr(encoder, "truncate_dim", None):
        return "dot"
    return "cosine"


def model_meta(encoder: Encoder, similarity: str, name: str | None = None, revision: str | None = None):
    """mteb's ModelMeta for a project encoder: no loader (mteb never builds or looks the model up)."""
    import_mteb()
    from mteb.models.model_meta import ModelMeta

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name or encoder.name).strip("_") or "encoder"
    prompts = encoder.prompts
    return ModelMeta(
        loader=None, name=slug if "/" in slug else f"care/{slug}", revision=revision or encoder.fingerprint,
        release_date=None, languages=LANGUAGES, n_parameters=encoder.online_parameters,
        n_embedding_parameters=encoder.online_embedding_parameters or None, memory_usage_mb=None,
        max_tokens=getattr(encoder, "max_length", None), embed_dim=None, license=None, open_weights=None,
        public_training_code=None, public_training_data=None, framework=["PyTorch"], reference=None,
        similarity_fn_name=similarity,
        use_instructions=bool(prompts.query or prompts.document or prompts.instructions),
        training_datasets=None, modalities=["text"], model_type=["dense"])


class MtebEncoder:
    """A project Encoder as an mteb 2.x encoder (EncoderProtocol): dense vectors, float32 numpy.

    task_types: {mteb task name or type: project task type}, ahead of TASK_TYPES.
    cache: a care.encoders.cache.EmbeddingCache to share vectors with evaluate.py (none by default)."""

    def __init__(self, encoder: Encoder, *, similarity: str = "auto", task_types: Mapping[str, str] | None = None,
                 cache: EmbeddingCache | None = None, batch_size: int | None = None, name: str | None = None,
                 revision: str | None = None):
        if similarity == "auto":
            similarity = default_similarity(encoder)
        if similarity not in ("cosine", "dot"):
            raise ValueError(f"similarity must be auto, cosine or dot, got {similarity!r}")
        self.encoder, self.similarity_name, self.cache, self.batch_size = encoder, similarity, cache, batch_size
        self.task_types = dict(task_types or {})
        self.mteb_model_meta = model_meta(encoder, similarity, name, revision)

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


def mteb_evaluate(encoder: Encoder | MtebEncoder, tasks: Sequence, batch_size: int = 64):
    """mteb.evaluate of the encoder (an MtebEncoder, or an Encoder wrapped as one, each task's `care_task_type`
    as its project task type) on mteb tasks, nothing cached or written, no progress bars: mteb's result."""
    mteb = import_mteb()
    model = encoder if isinstance(encoder, MtebEncoder) else MtebEncoder(encoder)
    model = model.with_task_types({t.metadata.name: t.care_task_type for t in tasks
                                   if getattr(t, "care_task_type", None)})
    with _quiet_datasets():
        return mteb.evaluate(model, tasks, cache=None, co2_tracker=False, show_progress_bar=False,
                             encode_kwargs={"batch_size": batch_size, "show_progress_bar": False})
