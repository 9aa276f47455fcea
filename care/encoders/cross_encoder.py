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

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from care.data.io import json_digest
from care.models.hub import resolve_model_path, weights_digest

TRUNCATION = "longest_first"  # a pair's tokens come off the longer text first


def pair_fingerprint(folder: str | Path, max_length: int, head_seed: int | None = None) -> str:
    """What a folder's pair scores depend on: its weights, the token limit, the truncation and the score; and
    `head_seed`, when a head the folder lacks may be made (allow_untrained_head), the seed that makes it."""
    identity = {"kind": "cross-encoder", "weights": weights_digest(folder), "max_length": int(max_length),
                "truncation": TRUNCATION, "score": "logit"}
    if head_seed is not None:
        identity["untrained_head_seed"] = int(head_seed)
    return json_digest(identity, 16, sort_keys=True)


def untrained_head(folder: str | Path, keys: list[str]) -> ValueError:
    """The one-line refusal of a folder whose classifier head is not in its weights (transformers would score
    with a random, unseeded head)."""
    return ValueError(
        f"{folder} is no trained cross-encoder: its weights lack {', '.join(keys[:4])}"
        f"{', ...' if len(keys) > 4 else ''}, which would be random (unseeded) here; we refuse. A fresh head "
        f"belongs to training (python train.py model=me5_reranker model.path={folder}, seeded); to score one "
        "untrained anyway, ask by name: rerank.allow_untrained_head=true (seeded by seed=)")


class CrossEncoder:
    """`score_pairs(queries, passages)` -> one float32 logit per pair.  `model` / `tokenizer`: a live module
    (training's validation) instead of the folder's weights.

    A folder whose weights lack any of the model's tensors (an encoder folder, or a reranker's final/ without
    its classifier.*) is refused when it loads: transformers would fill them at random, unseeded, and every
    run would score differently.  `untrained_head_seed` (a model config's `untrained_head_seed`, which
    evaluate.py sets from rerank.allow_untrained_head=true and `seed`) asks for such a head by name: made
    from that seed, the same on every run, and recorded in the fingerprint; `untrained` then says whether
    the folder lacked one."""

    def __init__(self, path: str, name: str | None = None, max_length: int = 512, device: str | None = None,
                 batch_size: int = 32, build_hint: str = "", model: torch.nn.Module | None = None, tokenizer=None,
                 untrained_head_seed: int | None = None):
        self.path, self.build_hint = str(path), build_hint
        self.name = name or Path(self.path).name
        self.max_length, self.batch_size, self.device = int(max_length), int(batch_size), device
        self.model, self.tokenizer = model, tokenizer
        self.head_seed = None if untrained_head_seed is None else int(untrained_head_seed)
        self.untrained: list[str] = []  # the tensors the folder lacked (made from head_seed)
        self._fingerprint: str | None = None

    @classmethod
    def from_config(cls, c: dict, device: str | None = None) -> CrossEncoder:
        return cls(c["path"], name=c.get("name"), max_length=c.get("max_length", 512), device=device,
                   build_hint=c.get("build_hint", ""), untrained_head_seed=c.get("untrained_head_seed"))

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = pair_fingerprint(resolve_model_path(self.path, self.build_hint), self.max_length,
                                                 self.head_seed)
        return self._fingerprint

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from care.encoders.dense import pick_device

        folder = resolve_model_path(self.path, self.build_hint)
        if self.model is None:
            from transformers.utils import logging as hf_logging

            device = pick_device(self.device)
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its table of MISSING tensors: said below in one line instead
            try:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.head_seed or 0)  # a head made here: the same on every run
                    model, info = AutoModelForSequenceClassification.from_pretrained(
                        folder, dtype=torch.float32, output_loading_info=True,
                        **({} if self.head_seed is None else {"num_labels": 1}))
            finally:
                hf_logging.set_verbosity(verbosity)
            fresh = sorted(info["missing_keys"]) + sorted(str(k[0]) for k in info["mismatched_keys"])
            if fresh and self.head_seed is None:
                raise untrained_head(folder, fresh)
            if fresh:
                print(f"warning: {folder}: {', '.join(fresh[:4])} not in its weights: made from seed "
                      f"{self.head_seed} (untrained_head_seed), an untrained head", file=sys.stderr)
            self.untrained = fresh
            self.model = model.to(device).eval()
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
