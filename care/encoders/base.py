"""The encoder interface every model implements (docs/design.md, "Layers").

`encode_queries` / `encode_documents` are written once, here: apply the side's prompt
(care.encoders.prompts), check the heads, call the implementation's `encode`, and refuse NaN/inf
embeddings naming the first bad text.  An implementation only says how to embed prompted texts.

What an encoder gives is its `heads` (a subset of care.models.HEADS, its family's `outputs` in
care/families.py): dense vectors, sparse lexical weights, ColBERT token vectors.  Nothing here assumes a
dense one: the first head is what it gives when asked for nothing in particular.  What the model is, for a
report (mteb's ModelMeta: its networks, widths, token limit), it says through the properties below, so no
caller probes an encoder's class or attributes.  A family that scores pairs instead is a `PairScorer`.

Identity is per side: `identity(side)` is everything that changes that side's vectors, and
`side_fingerprint(side)` hashes it.  A symmetric encoder returns the same for both sides; an asymmetric
one (a small query tower, a large document tower) keys its documents by the document tower alone, so the
embedding cache keeps a corpus when only the query tower changes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from care.data.io import json_digest
from care.encoders.prompts import SIDES, Prompts
from care.families import family_of
from care.models import HEADS


@dataclass
class Embeddings:
    """What an encoder returns for n texts: the heads it was asked for (at least one of the three).

    dense:   float32 [n, d], when the model has a dense head; L2-normalised unless the model says otherwise
             (CARE truncates after normalising, so its document vectors are not unit length).
    sparse:  one {token_id: weight} dict per text, when the model has a sparse head.
    colbert: one float32 [tokens, d'] array per text, when the model has a ColBERT head.
    """

    dense: np.ndarray | None = None
    sparse: list[dict[int, float]] | None = None
    colbert: list[np.ndarray] | None = None

    def __len__(self) -> int:
        for head in (self.dense, self.sparse, self.colbert):
            if head is not None:
                return len(head)
        raise ValueError("Embeddings hold no head (dense, sparse or colbert)")

    def select(self, rows: Sequence[int]) -> Embeddings:
        rows = list(rows)
        return Embeddings(dense=self.dense[rows] if self.dense is not None else None,
                          sparse=[self.sparse[r] for r in rows] if self.sparse is not None else None,
                          colbert=[self.colbert[r] for r in rows] if self.colbert is not None else None)


def check_finite(emb: Embeddings, texts: Sequence[str], what: str) -> None:
    """A NaN embedding must stop the run (and never reach a cache), naming the text that produced it."""
    rows = [np.zeros(len(emb), dtype=bool)]
    if emb.dense is not None:
        rows.append(~np.isfinite(emb.dense).all(axis=1))
    if emb.sparse is not None:
        rows.append(np.array([not np.isfinite(list(w.values())).all() for w in emb.sparse], dtype=bool))
    if emb.colbert is not None:
        rows.append(np.array([not np.isfinite(c).all() for c in emb.colbert], dtype=bool))
    bad = np.flatnonzero(np.any(rows, axis=0)) if len(emb) else []
    if len(bad):
        i = int(bad[0])
        raise FloatingPointError(f"{what}: NaN/inf for {len(bad)} of {len(texts)} texts, first #{i}: {texts[i][:60]!r}")


def config_args(c: dict, device: str | None) -> dict:
    """The keyword arguments every one-backbone encoder takes from its model config (`from_config`)."""
    return {"name": c.get("name", family_of(c).name), "pooling": c.get("pooling", "cls"),
            "prompts": Prompts.from_config(c), "max_length": c.get("max_length", 512), "device": device,
            "build_hint": c.get("build_hint", "")}


class Encoder(ABC):
    """Encode queries and documents.  Symmetric models use one network for both; asymmetric ones
    (CARE) use a small query network online and a large document network offline."""

    #: heads this encoder can produce, a subset of HEADS (its family's `outputs`); the first is what it gives
    #: when asked for nothing in particular (`heads=None`), and evaluation always scores it
    heads: tuple[str, ...] = ("dense",)
    #: a short human-readable name for tables ("me5_small", "bge-m3 (ft step 60)").
    name: str = "encoder"
    #: the prefixes / instructions of each side
    prompts: Prompts = Prompts()
    #: what runs its forward pass (torch, onnx, ...; care/encoders/dense.py BACKENDS)
    backend: str = "torch"

    @abstractmethod
    def encode(self, texts: list[str], side: str, batch_size: int, heads: Sequence[str],
               show_progress: bool) -> Embeddings:
        """Embeddings of already-prompted texts with the network of `side` ("query" or "document")."""

    @abstractmethod
    def identity(self, side: str) -> dict:
        """Everything that changes the vectors of one side (weights digest, pooling, prompt, max length)."""

    @property
    @abstractmethod
    def online_parameters(self) -> int:
        """Parameters that run at query time (the query tower of an asymmetric model)."""

    def _encode_side(self, texts: Sequence[str], side: str, batch_size: int, heads: Sequence[str] | None,
                     show_progress: bool, task: str | None) -> Embeddings:
        heads = self.default_heads if heads is None else tuple(heads)
        self.check_heads(heads)
        texts = list(texts)
        emb = self.encode(self.prompts.apply(texts, side, task), side, batch_size, heads, show_progress)
        check_finite(emb, texts, f"{self.name} {side} embedding")
        return emb

    def encode_queries(self, texts: Sequence[str], batch_size: int = 32, heads: Sequence[str] | None = None,
                       show_progress: bool = False, task: str | None = None) -> Embeddings:
        """`task`: the task type (retrieval, reranking, sts) whose instruction the query prompt takes;
        `heads`: those to give (None: `default_heads`)."""
        return self._encode_side(texts, "query", batch_size, heads, show_progress, task)

    def encode_documents(self, texts: Sequence[str], batch_size: int = 32, heads: Sequence[str] | None = None,
                         show_progress: bool = False, task: str | None = None) -> Embeddings:
        return self._encode_side(texts, "document", batch_size, heads, show_progress, task)

    @property
    def default_heads(self) -> tuple[str, ...]:
        """What it gives when asked for nothing in particular: its first head (dense for the project's
        encoders), so the embedding cache keys such a request as it always did."""
        return self.heads[:1]

    def select_heads(self, wanted: Sequence[str] | None) -> tuple[str, ...]:
        """The heads of `wanted` (None: all) this encoder has, in its order, its first head always among them:
        what evaluation scores (care.retrieval.scorer.EncoderScorer) and encode.py stores, one rule for both,
        since the tuple is part of the embedding cache's key."""
        heads = tuple(h for h in self.heads if wanted is None or h in wanted)
        if not heads or heads[0] != self.heads[0]:
            raise ValueError(f"{self.name}: heads={list(wanted)} leaves out its {self.heads[0]} head, which is "
                             f"always scored (it has {list(self.heads)})")
        return heads

    def side_fingerprint(self, side: str, task: str | None = None) -> str:
        """One side's identity, with the instruction `task` gives it when its prompt takes one."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        instruction = self.prompts.instruction(side, task)
        identity = self.identity(side)
        return _digest(identity if instruction is None else {**identity, "instruction": instruction})

    @property
    def online_embedding_parameters(self) -> int:
        """Of the online parameters, those of the token-embedding matrix: a lookup, not compute (with a
        small tower it dominates the count and hides what the tower costs)."""
        return 0

    # ---- what the model is, for reports (mteb's ModelMeta): each encoder says it, nobody probes it --------

    @property
    def networks(self) -> dict[str, Any]:
        """The torch module that encodes each side: {"query": m, "document": m}, the same module twice for one
        backbone, two for two towers; {} for an encoder that is no torch model (a test double)."""
        return {}

    @property
    def dense_width(self) -> int | None:
        """The width of its dense vectors (both sides), None when the model does not say (or has no dense head)."""
        return None

    @property
    def max_tokens(self) -> int | None:
        """The longest text (in tokens) it reads on either side, None when it does not say."""
        return None

    @property
    def unit_vectors(self) -> bool:
        """Its dense vectors are unit length by design (so cosine and dot product rank alike)."""
        return True

    @property
    def fingerprint(self) -> str:
        """The whole encoder: its one identity when both sides agree (symmetric), else both sides'."""
        q, d = self.identity("query"), self.identity("document")
        return _digest(q if q == d else {"query": q, "document": d})

    def check_heads(self, heads: Sequence[str]) -> None:
        missing = [h for h in heads if h not in self.heads]
        if missing:
            raise ValueError(f"{self.name} has no {missing} head(s); it has {list(self.heads)}")


def _digest(identity: dict) -> str:
    return json_digest(identity, 16, sort_keys=True, ensure_ascii=False)


class PairScorer(Protocol):
    """What a family whose outputs are pair scores builds (care.families PAIR_SCORES; build_pair_scorer in
    care/encoders/registry.py): one raw score per (query, passage) pair, no vectors (care.encoders.cross_encoder)."""

    name: str

    @property
    def fingerprint(self) -> str: ...

    @property
    def online_parameters(self) -> int: ...

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str], batch_size: int | None = None,
                    progress=None) -> np.ndarray: ...


__all__ = ["HEADS", "Embeddings", "Encoder", "PairScorer", "check_finite"]
