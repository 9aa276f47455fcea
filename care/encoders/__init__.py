"""One interface for every model the project trains or evaluates (design.md, layer 3).

Evaluation and mining only talk to `Encoder`: encode queries, encode documents; dense vectors always,
sparse weights and ColBERT vectors when the model has those heads.
"""
from care.encoders.base import Embeddings, Encoder, resolve_model_path
from care.encoders.registry import build_encoder

__all__ = ["Embeddings", "Encoder", "build_encoder", "resolve_model_path"]
