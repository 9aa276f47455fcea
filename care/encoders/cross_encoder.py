"""A cross-encoder: a query and a passage in one input, one relevance score out (the `reranker` family of
care.families).  It embeds nothing, so it is no Encoder: it scores pairs.  Its folder is a Hugging Face
sequence-classification folder with one label, the layout FlagEmbedding's FlagReranker and
sentence-transformers' CrossEncoder load (tests/test_reranker_family.py holds their scores equal to these).

A pair's score is the raw logit of the pair tokenized as a pair (truncated longest first to `max_length`), as
FlagReranker returns it without normalisation (no sigmoid).  This is the one scoring path of a cross-encoder:
evaluation (care.retrieval.rerank), the score stage's teacher and the mine stage's judge
(data_pipeline/teachers.py) all call `score_pairs`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from care.data.io import json_digest
from care.models.hub import resolve_model_path, weights_digest

TRUNCATION = "longest_first"  # a pair's tokens come off the longer text first


def pair_fingerprint(folder: str | Path, max_length: int) -> str:
    """What a folder's pair scores depend on: its weights, the token limit, the truncation and the score."""
    identity = {"kind": "cross-encoder", "weights": weights_digest(folder), "max_length": int(max_length),
                "truncation": TRUNCATION, "score": "logit"}
    return json_digest(identity, 16, sort_keys=True)


class CrossEncoder:
    """`score_pairs(queries, passages)` -> one float32 logit per pair.  `model` / `tokenizer`: a live module
    (training's validation) instead of the folder's weights."""

    def __init__(self, path: str, name: str | None = None, max_length: int = 512, device: str | None = None,
                 batch_size: int = 32, build_hint: str = "", model: torch.nn.Module | None = None, tokenizer=None):
        self.path, self.build_hint = str(path), build_hint
        self.name = name or Path(self.path).name
        self.max_length, self.batch_size, self.device = int(max_length), int(batch_size), device
        self.model, self.tokenizer = model, tokenizer
        self._fingerprint: str | None = None

    @classmethod
    def from_config(cls, c: dict, device: str | None = None) -> CrossEncoder:
        return cls(c["path"], name=c.get("name"), max_length=c.get("max_length", 512), device=device,
                   build_hint=c.get("build_hint", ""))

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = pair_fingerprint(resolve_model_path(self.path, self.build_hint), self.max_length)
        return self._fingerprint

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from care.encoders.dense import pick_device

        folder = resolve_model_path(self.path, self.build_hint)
        if self.model is None:
            device = pick_device(self.device)
            self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
            self.model = self.model.to(device).eval()
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str], batch_size: int | None = None,
                    progress=None) -> np.ndarray:
        """Raw logits of the pairs (queries[i], passages[i]), batched by length (less padding); `progress`, a
        tqdm bar, is advanced by each batch.  A NaN/inf score is an error naming its pair."""
        if len(queries) != len(passages):
            raise ValueError(f"{len(queries)} queries for {len(passages)} passages: pairs come in twos")
        if self.model is None or self.tokenizer is None:
            self.load()
        order = sorted(range(len(queries)), key=lambda i: -len(queries[i]) - len(passages[i]))
        out = np.empty(len(queries), np.float32)
        size = int(batch_size or self.batch_size)
        device = next(self.model.parameters()).device
        training = self.model.training
        self.model.eval()
        with torch.inference_mode():
            for s in range(0, len(order), size):
                idx = order[s:s + size]
                batch = self.tokenizer([queries[i] for i in idx], [passages[i] for i in idx], padding=True,
                                       truncation=TRUNCATION, max_length=self.max_length,
                                       return_tensors="pt").to(device)
                out[idx] = self.model(**batch).logits[:, 0].float().cpu().numpy()
                if progress is not None:
                    progress.update(len(idx))
        self.model.train(training)
        if not np.isfinite(out).all():
            i = int(np.flatnonzero(~np.isfinite(out))[0])
            raise FloatingPointError(f"cross-encoder {self.path}: NaN/inf score for the pair {queries[i][:40]!r} / "
                                     f"{passages[i][:40]!r}")
        return out

    @property
    def online_parameters(self) -> int:
        if self.model is None:
            self.load()
        return sum(p.numel() for p in self.model.parameters())

    @property
    def online_embedding_parameters(self) -> int:
        if self.model is None:
            self.load()
        return self.model.get_input_embeddings().weight.numel()
