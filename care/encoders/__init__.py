"""One interface for every model the project trains or evaluates (docs/design.md, "Layers").

Evaluation and mining only talk to `Encoder`: encode queries, encode documents; the heads its family gives
(care.families `outputs`: dense vectors, sparse weights, ColBERT vectors).  A family that scores pairs
instead builds a `PairScorer` (build_pair_scorer).
"""
from care.encoders.base import Embeddings, Encoder, PairScorer
from care.encoders.registry import build_encoder, build_pair_scorer, detect

# The identity of a model folder's weights, for the layers above that talk to encoders only (an evaluation row
# that names the same weights under another folder is the same model: care/evaluation/run_folder.py).
from care.models.hub import weights_digest

__all__ = ["Embeddings", "Encoder", "PairScorer", "build_encoder", "build_pair_scorer", "detect", "weights_digest"]
