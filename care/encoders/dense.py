"""A dense encoder over any Hugging Face backbone: pooling, optional prefixes, L2 normalisation,
optional Matryoshka truncation.  multilingual-e5-small and the tiny test models use it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModel, AutoTokenizer

from care.encoders.base import Embeddings, Encoder, resolve_model_path, weights_digest
from care.encoders.pooling import pool


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def batched_forward(texts: Sequence[str], batch_size: int, show_progress: bool, desc: str, step):
    """Run `step(batch_texts)` over texts sorted by length (less padding), return results in input order."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out: list = [None] * len(texts)
    starts = range(0, len(order), batch_size)
    for s in tqdm(starts, desc=desc, disable=not show_progress, unit="batch"):
        idx = order[s:s + batch_size]
        for i, r in zip(idx, step([texts[i] for i in idx])):
            out[i] = r
    return out


class HFDenseEncoder(Encoder):
    """One backbone for queries and documents (symmetric)."""

    def __init__(self, path: str, name: str = "dense", pooling: str = "cls", query_prefix: str = "",
                 doc_prefix: str = "", max_length: int = 512, normalize: bool = True,
                 truncate_dim: int | None = None, device: str | None = None, padding_side: str = "right",
                 model: torch.nn.Module | None = None, tokenizer=None, build_hint: str = ""):
        self.path = str(path)
        self.name = name
        self.pooling = pooling
        self.query_prefix, self.doc_prefix = query_prefix, doc_prefix
        self.max_length = max_length
        self.normalize = normalize
        self.truncate_dim = truncate_dim
        self.device = pick_device(device)
        if model is None:
            local = resolve_model_path(path, build_hint)
            tokenizer = AutoTokenizer.from_pretrained(local)
            # No pooling mode uses a BERT-family pooler; a folder without one (me5_small) would otherwise
            # get a randomly initialised pooler, a warning and phantom online parameters.
            model_type = AutoConfig.from_pretrained(local).model_type
            extra = {"add_pooling_layer": False} if model_type in ("bert", "xlm-roberta", "roberta") else {}
            model = AutoModel.from_pretrained(local, **extra)
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = padding_side
        self.model = model.to(self.device).eval()

    def identity(self) -> dict:
        return {"class": type(self).__name__, "weights": weights_digest(self.path), "path": self.path,
                "pooling": self.pooling, "qp": self.query_prefix, "dp": self.doc_prefix,
                "max_length": self.max_length, "normalize": self.normalize, "dim": self.truncate_dim}

    @property
    def online_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Differentiable dense vectors for already-prefixed texts (used by training too)."""
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        hidden = self.model(**batch).last_hidden_state
        vec = pool(hidden, batch["attention_mask"], self.pooling)
        if self.normalize:
            vec = torch.nn.functional.normalize(vec.float(), dim=-1)
        if self.truncate_dim:
            vec = vec[:, : self.truncate_dim]  # after normalising, not re-normalised (CARE, facts.md s.1)
        return vec

    @torch.inference_mode()
    def _encode(self, texts: Sequence[str], prefix: str, batch_size: int, heads, show_progress, desc):
        self.check_heads(heads)
        rows = batched_forward([prefix + t for t in texts], batch_size, show_progress, desc,
                               lambda b: self.embed(b).float().cpu().numpy())
        dim = self.truncate_dim or self.model.config.hidden_size
        dense = np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32)
        if not np.isfinite(dense).all():
            raise FloatingPointError(f"{self.name} produced NaN/inf embeddings ({desc})")
        return Embeddings(dense=dense)

    def encode_queries(self, texts, batch_size=32, heads=("dense",), show_progress=False) -> Embeddings:
        return self._encode(texts, self.query_prefix, batch_size, heads, show_progress, f"{self.name} queries")

    def encode_documents(self, texts, batch_size=32, heads=("dense",), show_progress=False) -> Embeddings:
        return self._encode(texts, self.doc_prefix, batch_size, heads, show_progress, f"{self.name} documents")
