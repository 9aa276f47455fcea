"""CARE asymmetric encoders (docs/facts.md s.1) behind the Encoder interface: `encode_queries` runs the
small query tower (online), `encode_documents` the large document tower (offline: its vectors are cached
by the document side's fingerprint, which depends on the document tower alone).  Queries are unit vectors;
document vectors are the normalised full vector's prefix at the query width, norms below 1 (not
re-normalised); the score is the dot product.

`query.backend` (QUERY_BACKENDS) says what runs the query tower's backbone, the online path:

torch  the Hugging Face model in PyTorch (the class's default; the only one that trains)
onnx   the backbone exported to ONNX and run by ONNX Runtime, fp32, on the CPU (care/encoders/onnx_backend.py,
       the dense encoder's `onnx` backend): tokenisation, pooling, normalisation and cut stay the tower's own
       (care.models.towers.Tower.vectors).  Vectors within fp32 rounding of torch's, and every evaluation
       score equal to 4 decimals (tests/test_care_onnx.py); batch-1 latency in bench/latency_bench.py.
       What an app builds for inference is `auto` (care/encoders/registry.py build_encoder): onnx on the CPU
       when onnxruntime is installed.  The export is cached per tower folder (care/encoders/onnx_backend.py).

The document side always runs torch (offline, on `device`; its towers include decoders with last-token
pooling and left padding whose export is not checked against torch here, and encode.py caches it ahead); an onnx query tower runs on the CPU whatever
`device` says.  The int8 backends of care/encoders/dense.py are not offered: they move scores and make a
vector depend on its batch.  An onnx query side adds `backend` to the query side's identity only (torch adds
nothing), so cached document vectors, and query vectors cached before backends existed, stay valid.
"""
from __future__ import annotations

import numpy as np
import torch

from care.encoders.base import Embeddings, Encoder
from care.encoders.dense import batched_forward, pick_device, progress_label
from care.encoders.onnx_backend import OnnxForward, export_identity, padded_example
from care.encoders.prompts import Prompts
from care.models.hub import weights_digest
from care.models.towers import Tower, care_towers

QUERY_BACKENDS = ("torch", "onnx")


def check_query_backend(query: dict, document: dict) -> str:
    """The query side's backend, refused in one line when unknown; the document side has none but torch."""
    backend = query.get("backend", "torch")
    if document.get("backend", "torch") != "torch":
        raise ValueError(f"model.document.backend={document['backend']!r}: the document tower runs offline in "
                         f"torch; only model.query.backend is an option ({' | '.join(QUERY_BACKENDS)})")
    if backend not in QUERY_BACKENDS:
        raise ValueError(f"unknown CARE query backend model.query.backend={backend!r} (choose "
                         f"{' or '.join(QUERY_BACKENDS)}; the int8 ones of care/encoders/dense.py move scores)")
    return backend


class CAREEncoder(Encoder):
    """`towers=` wraps live towers (training's validation) instead of loading the config's folders; those
    run torch (an export would hold weights that training then changes)."""

    @classmethod
    def from_config(cls, c: dict, device: str | None = None) -> CAREEncoder:
        """A `kind: care` model config's encoder (care.families): a bad query backend is refused before any
        tower is built, and a configured tower folder is built on first use (registry.ensure_towers)."""
        from care.encoders.registry import ensure_towers, tower_config

        check_query_backend(c["query"], c["document"])
        ensure_towers(c)
        return cls(tower_config(c["query"]), tower_config(c["document"]), name=c.get("name", "care"),
                   prompts=Prompts.from_config(c), device=device)

    def __init__(self, query: dict, document: dict, name: str = "care", prompts: Prompts | None = None,
                 device: str | None = None, towers: tuple[Tower, Tower] | None = None):
        self.name, self.prompts = name, prompts or Prompts()
        self.backend = check_query_backend(query, document)
        if towers is not None and self.backend != "torch":
            raise ValueError(f"model.query.backend={self.backend!r} only encodes saved towers; live (training) "
                             f"towers run torch (model.query.backend=torch)")
        self.device = pick_device(device)
        q, d = towers if towers is not None else care_towers(*({k: v for k, v in side.items() if k != "backend"}
                                                               for side in (query, document)))
        query_device = torch.device("cpu") if self.backend == "onnx" else self.device
        self.towers = {"query": q.to(query_device).eval(), "document": d.to(self.device).eval()}
        self.devices = {"query": query_device, "document": self.device}
        self._onnx: OnnxForward | None = None
        if self.backend == "onnx":
            self._onnx = OnnxForward(q.model, padded_example(q.tokenize), what="model.query.backend=onnx",
                                     weights=weights_digest(q.spec.path))

    def identity(self, side: str) -> dict:
        # the document side depends on the document tower (and the width it is cut to), never on the query tower
        ident = {"class": type(self).__name__, "side": side, "tower": self.towers[side].identity(),
                 "prompt": self.prompts.of(side)}
        # only a non-default backend is recorded (as care/encoders/dense.py does): torch keys stay the old ones
        # and an ONNX query side the digest of the export it runs (care/encoders/onnx_backend.py export_identity)
        return ({**ident, "backend": self.backend, **export_identity(self._onnx)}
                if side == "query" and self.backend != "torch" else ident)

    @property
    def online_parameters(self) -> int:
        return sum(p.numel() for p in self.towers["query"].parameters())

    @property
    def online_embedding_parameters(self) -> int:
        return self.towers["query"].model.get_input_embeddings().weight.numel()

    @property
    def networks(self) -> dict:
        return dict(self.towers)

    @property
    def dense_width(self) -> int | None:
        return int(self.towers["query"].dim) if self.towers["query"].dim else None  # documents are cut to it

    @property
    def max_tokens(self) -> int | None:
        """The longest text either tower takes (documents, in practice)."""
        return max((n for n in (t.spec.max_length for t in self.towers.values()) if n), default=None)

    @property
    def unit_vectors(self) -> bool:
        return False  # documents are cut after normalising (docs/facts.md s.1)

    def tokenize(self, texts: list[str], side: str) -> dict[str, torch.Tensor]:
        """Already-prompted texts as the side's tower takes them (on the CPU)."""
        return self.towers[side].tokenize(texts)

    @torch.inference_mode()
    def vectors(self, inputs: dict[str, torch.Tensor], side: str) -> torch.Tensor:
        """The side's vectors of a tokenised batch, by its backend: the model's part of encoding."""
        tower = self.towers[side]
        if side == "query" and self._onnx is not None:
            return tower.vectors(self._onnx(**inputs), inputs["attention_mask"])
        return tower(**{k: v.to(self.devices[side]) for k, v in inputs.items()})["dense"]

    @torch.inference_mode()
    def encode(self, texts, side, batch_size, heads, show_progress) -> Embeddings:
        def step(batch: list[str]):
            return self.vectors(self.tokenize(batch, side), side).float().cpu().numpy()

        rows = batched_forward(texts, batch_size, show_progress, progress_label(self.name, side), step)
        dim = self.towers[side].dim
        return Embeddings(dense=np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32))
