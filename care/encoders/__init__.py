"""One interface for every model the project trains or evaluates (docs/design.md, "Layers").

Evaluation and mining only talk to `Encoder`: encode queries, encode documents; dense vectors always,
sparse weights and ColBERT vectors when the model has those heads.
"""
from care.encoders.base import Embeddings, Encoder
from care.encoders.registry import build_encoder, detect

__all__ = ["Embeddings", "Encoder", "build_encoder", "detect"]
