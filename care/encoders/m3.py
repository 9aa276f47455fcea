"""BGE-M3 checkpoints (care.models.m3) behind the Encoder interface: dense vectors, sparse token weights
and ColBERT vectors per text, as FlagEmbedding's BGEM3FlagModel returns them.

`backend` (M3_BACKENDS) says what runs the backbone: torch (the class's default; training's validation wraps
the live model, always torch) or onnx, the backbone exported to ONNX Runtime fp32 on the CPU
(care/encoders/onnx_backend.py) with the three heads still in torch on its last hidden states
(M3Model.heads), so only the backbone's arithmetic differs.  Only onnx enters the side identity: torch keys
stay the ones cached before backends existed.  The int8 backends of care/encoders/dense.py are not offered.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from care.encoders.base import Embeddings, config_args
from care.encoders.dense import OneBackboneEncoder, batched_forward, pick_device, progress_label
from care.encoders.onnx_backend import OnnxForward, export_identity, padded_example
from care.encoders.prompts import Prompts
from care.models import HEADS
from care.models.hub import weights_digest
from care.models.m3 import M3Model

M3_BACKENDS = ("torch", "onnx")


class M3Encoder(OneBackboneEncoder):
    """`model=` wraps a live M3Model (training's validation) instead of loading `path`.  `truncate_dim`: keep
    the first d coordinates of the dense vector, normalised at full width and not re-normalised (the project's
    one Matryoshka convention, as `kind: dense` and CARE towers cut, and as `loss.matryoshka_dims` trains
    them); the sparse and ColBERT heads are unchanged."""

    heads = HEADS

    @classmethod
    def from_config(cls, c: dict, device: str | None = None) -> M3Encoder:
        """A `kind: m3` model config's encoder (care.families)."""
        return cls(str(c["path"]), truncate_dim=c.get("truncate_dim"), backend=c.get("backend", "torch"),
                   **config_args(c, device))

    def __init__(self, path: str, name: str = "m3", pooling: str = "cls", prompts: Prompts | None = None,
                 max_length: int = 512, device: str | None = None,
                 model: M3Model | None = None, build_hint: str = "", truncate_dim: int | None = None,
                 backend: str = "torch"):
        self.path, self.name, self.pooling = str(path), name, pooling
        self.prompts = prompts or Prompts()
        self.max_length = max_length
        if backend not in M3_BACKENDS or (backend != "torch" and model is not None):
            raise ValueError(f"M3 backend {backend!r}: choose {' or '.join(M3_BACKENDS)} (a live training model "
                             f"runs torch)")
        self.backend = backend
        self.device = torch.device("cpu") if backend == "onnx" else pick_device(device)
        if backend == "onnx" and self.device.type != "cpu":
            raise ValueError(f"backend 'onnx' runs on the CPU only, the encoder was given device {device}")
        model = model if model is not None else M3Model.load(path, pooling, build_hint=build_hint)
        self.model = model.to(self.device).eval()
        self.tokenizer = model.tokenizer
        self._onnx: OnnxForward | None = None
        if backend == "onnx":
            example = padded_example(lambda t: self.tokenizer(t, padding=True, return_tensors="pt"))
            self._onnx = OnnxForward(self.model.backbone, example, what="the M3 onnx backend",
                                     weights=weights_digest(self.path))
        width = self.model.config.hidden_size
        if truncate_dim is not None and not 0 < int(truncate_dim) <= width:
            raise ValueError(f"truncate_dim={truncate_dim}: the dense vectors of {self.path} are {width}-d; "
                             f"choose 0 < truncate_dim <= {width}")
        self.truncate_dim = int(truncate_dim) if truncate_dim and int(truncate_dim) < width else None

    def identity(self, side: str) -> dict:
        ident = {"class": type(self).__name__, "weights": weights_digest(self.path),
                 "pooling": self.pooling, "qp": self.prompts.query, "dp": self.prompts.document,
                 "max_length": self.max_length}
        # only a cut or a backend other than torch is recorded, so uncut torch encoders keep the fingerprints (and
        # caches) they had before
        ident = {**ident, "dim": self.truncate_dim} if self.truncate_dim else ident
        # an ONNX side adds the digest of the export it runs (care/encoders/onnx_backend.py export_identity)
        return ident if self.backend == "torch" else {**ident, "backend": self.backend, **export_identity(self._onnx)}

    @property
    def online_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def online_embedding_parameters(self) -> int:
        return self.model.backbone.get_input_embeddings().weight.numel()

    def _step(self, texts: list[str], heads: Sequence[str]) -> list[tuple]:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        if self._onnx is not None:
            forward = self.model.heads(self._onnx(**batch), batch["input_ids"], batch["attention_mask"])
        else:
            forward = self.model(**batch)
        out = {k: v.float().cpu().numpy() if v.is_floating_point() else v.cpu().numpy() for k, v in forward.items()}
        rows = []
        for i in range(len(texts)):
            sparse = colbert = None
            if "sparse" in heads:
                sparse = {}
                for t, w in zip(out["sparse_ids"][i].tolist(), out["sparse"][i].tolist()):
                    if w > sparse.get(t, 0.0):  # positive weights only, max over repeats
                        sparse[t] = w
            if "colbert" in heads:
                colbert = out["colbert"][i][out["colbert_mask"][i].astype(bool)]
            rows.append((out["dense"][i], sparse, colbert))
        return rows

    @torch.inference_mode()
    def encode(self, texts, side, batch_size, heads, show_progress) -> Embeddings:
        rows = batched_forward(texts, batch_size, show_progress, progress_label(self.name, side),
                               lambda b: self._step(b, heads))
        dim = self.truncate_dim or self.model.config.hidden_size
        dense = (np.stack([r[0][:dim] for r in rows]).astype(np.float32) if rows
                 else np.zeros((0, dim), np.float32))
        return Embeddings(dense=dense,
                          sparse=[r[1] for r in rows] if "sparse" in heads else None,
                          colbert=[r[2].astype(np.float32) for r in rows] if "colbert" in heads else None)
