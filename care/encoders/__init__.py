"""One interface for every model the project trains or evaluates (docs/design.md, "Layers").

Evaluation and mining only talk to `Encoder`: encode queries, encode documents; the heads its family gives
(care.families `outputs`: dense vectors, sparse weights, ColBERT vectors).  A family that scores pairs
instead builds a `PairScorer` (build_pair_scorer).
"""
from care.encoders.base import Embeddings, Encoder, PairScorer
from care.encoders.registry import build_encoder, build_pair_scorer, detect

__all__ = ["Embeddings", "Encoder", "PairScorer", "build_encoder", "build_pair_scorer", "detect"]
