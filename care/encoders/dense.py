"""A dense encoder over any Hugging Face backbone: pooling, optional prefixes, L2 normalisation,
optional Matryoshka truncation.  multilingual-e5-small and the tiny test models use it."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from care.encoders.base import Embeddings, Encoder
from care.encoders.prompts import Prompts
from care.models.hub import load_encoder_model, resolve_model_path, weights_digest
from care.models.pooling import pool


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def batched_forward(texts: Sequence[str], batch_size: int, show_progress: bool, desc: str,
                    step: Callable[[list[str]], list]) -> list:
    """Run `step(batch_texts)` over texts sorted by length (less padding), return results in input order."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out: list = [None] * len(texts)
    starts = range(0, len(order), batch_size)
    for s in tqdm(starts, desc=desc, disable=not show_progress, unit="batch"):
        idx = order[s:s + batch_size]
        for i, r in zip(idx, step([texts[i] for i in idx])):
            out[i] = r
    return out


def progress_label(name: str, side: str) -> str:
    return f"{name} {'queries' if side == 'query' else 'documents'}"


class HFDenseEncoder(Encoder):
    """One backbone for queries and documents (symmetric)."""

    def __init__(self, path: str, name: str = "dense", pooling: str = "cls", query_prefix: str = "",
                 doc_prefix: str = "", max_length: int = 512, normalize: bool = True,
                 truncate_dim: int | None = None, device: str | None = None, padding_side: str = "right",
                 build_hint: str = ""):
        self.path = str(path)
        self.name = name
        self.pooling = pooling
        self.prompts = Prompts(query_prefix, doc_prefix)
        self.max_length = max_length
        self.normalize = normalize
        self.truncate_dim = truncate_dim
        self.device = pick_device(device)
        local = resolve_model_path(path, build_hint)
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        self.tokenizer.padding_side = padding_side
        self.model = load_encoder_model(local).to(self.device).eval()

    def identity(self, side: str) -> dict:
        return {"class": type(self).__name__, "weights": weights_digest(self.path), "path": self.path,
                "pooling": self.pooling, "qp": self.prompts.query, "dp": self.prompts.document,
                "max_length": self.max_length, "normalize": self.normalize, "dim": self.truncate_dim}

    @property
    def online_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def online_embedding_parameters(self) -> int:
        return self.model.get_input_embeddings().weight.numel()

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Differentiable dense vectors for already-prompted texts."""
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        hidden = self.model(**batch).last_hidden_state
        vec = pool(hidden, batch["attention_mask"], self.pooling)
        if self.normalize:
            vec = torch.nn.functional.normalize(vec.float(), dim=-1)
        if self.truncate_dim:
            vec = vec[:, : self.truncate_dim]  # after normalising, not re-normalised (CARE, docs/facts.md s.1)
        return vec

    @torch.inference_mode()
    def encode(self, texts, side, batch_size, heads, show_progress) -> Embeddings:
        rows = batched_forward(texts, batch_size, show_progress, progress_label(self.name, side),
                               lambda b: self.embed(b).float().cpu().numpy())
        dim = self.truncate_dim or self.model.config.hidden_size
        return Embeddings(dense=np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32))
