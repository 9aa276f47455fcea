"""A fourth model family, written only here (issue #42): sparse lexical weights alone, no dense vector.

Each token's weight is log(1 + relu(w . h_t + b)) over a (tiny) BERT's last hidden states h_t, max-pooled over
the positions of the same token id (special tokens and zero weights left out): the MLM-free SPLADE variant,
which is BGE-M3's sparse head (care/models/m3.py) with a log saturation.  The linear head is seeded
(`seed` in the model config), so a model is its backbone folder plus its seed.

It enters the registry the way any family does, `care.families.register_family(SPARSE)` (`registered()`
below), and touches no production file: its encoder is an Encoder (care/encoders/base.py) whose one head is
`sparse`, so evaluate.py scores it through the sparse scorer, encode.py writes its chunks, the embedding cache
keys them by that head, and the apps that need dense vectors refuse it in one line (care.families.require).

`reference_weights` computes the same weights another way (one text at a time, no padding, numpy max over a
dict), the independent reference of the tests.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from care.encoders.base import Embeddings, Encoder, config_args
from care.families import FAMILIES, Family, register_family
from care.models.hub import weights_digest

NAME = "sparse_test"
SPARSE = Family(NAME, (), tag="sparse", encoder="_sparse_family:SparseEncoder", outputs=("sparse",),
                description="a sparse lexical encoder (log(1 + relu(linear)) of a BERT's tokens, max-pooled; tests only)")


@contextlib.contextmanager
def registered() -> Iterator[Family]:
    """The family in FAMILIES for the block (the registry's one entry point), taken out afterwards."""
    register_family(SPARSE)
    try:
        yield SPARSE
    finally:
        FAMILIES.pop(NAME, None)


def model_config(path, **extra) -> dict:
    """A model config of the family over a backbone folder (conftest.py's tiny BERT)."""
    return {"kind": NAME, "name": "sparse_tiny", "path": str(path), "max_length": 64, "seed": 0, **extra}


class SparseModel(torch.nn.Module):
    """The backbone and its one-output linear head, seeded."""

    def __init__(self, path: str, seed: int):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(path)
        generator = torch.Generator().manual_seed(int(seed))
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=generator) * 0.5)
            self.head.bias.fill_(0.1)

    def forward(self, **batch) -> torch.Tensor:
        """(texts, tokens) weights, 0 where the mask is."""
        hidden = self.backbone(**batch).last_hidden_state
        return torch.log1p(torch.relu(self.head(hidden).squeeze(-1))) * batch["attention_mask"]


class SparseEncoder(Encoder):
    heads = ("sparse",)

    @classmethod
    def from_config(cls, c: dict, device: str | None = None) -> SparseEncoder:
        return cls(str(c["path"]), seed=int(c.get("seed", 0)), **config_args(c, device))

    def __init__(self, path: str, seed: int = 0, name: str = NAME, pooling: str = "max", prompts=None,
                 max_length: int = 512, device: str | None = None, build_hint: str = ""):
        from care.encoders.prompts import Prompts

        self.path, self.seed, self.name, self.max_length = path, seed, name, max_length
        self.prompts = prompts or Prompts()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = SparseModel(path, seed).eval()
        self.special = set(self.tokenizer.all_special_ids)

    def identity(self, side: str) -> dict:
        return {"class": type(self).__name__, "weights": weights_digest(self.path), "seed": self.seed,
                "qp": self.prompts.query, "dp": self.prompts.document, "max_length": self.max_length}

    @property
    def online_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def networks(self) -> dict:
        return {"query": self.model, "document": self.model}

    @property
    def max_tokens(self) -> int:
        return self.max_length

    @torch.inference_mode()
    def encode(self, texts, side, batch_size, heads, show_progress) -> Embeddings:
        rows: list[dict[int, float]] = []
        for s in range(0, len(texts), batch_size):
            batch = self.tokenizer(list(texts[s:s + batch_size]), padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
            weights = self.model(**batch)
            for ids, w in zip(batch["input_ids"].tolist(), weights.tolist()):
                row: dict[int, float] = {}
                for t, x in zip(ids, w):
                    if t not in self.special and x > row.get(t, 0.0):
                        row[t] = x
                rows.append(row)
        return Embeddings(sparse=rows)


def reference_weights(path, texts: Sequence[str], seed: int = 0, max_length: int = 64) -> list[dict[int, float]]:
    """The family's weights computed one text at a time (no padding), the head applied in numpy, the max over
    repeated tokens taken per token id from all its positions: the independent reference."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = SparseModel(str(path), seed).eval()
    w, b = model.head.weight.detach().double().numpy()[0], float(model.head.bias.detach().double())
    special = set(tokenizer.all_special_ids)
    out = []
    with torch.inference_mode():
        for text in texts:
            batch = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
            hidden = model.backbone(**batch).last_hidden_state[0].double().numpy()
            weights = np.log1p(np.maximum(hidden @ w + b, 0.0))
            ids = batch["input_ids"][0].tolist()
            row = {t: float(max(weights[i] for i, u in enumerate(ids) if u == t)) for t in set(ids) - special}
            out.append({t: x for t, x in row.items() if x > 0})
    return out
