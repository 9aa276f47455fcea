"""CARE asymmetric encoders (docs/facts.md s.1) behind the Encoder interface: `encode_queries` runs the
small query tower (online), `encode_documents` the large document tower (offline: its vectors are cached
by the document side's fingerprint, which depends on the document tower alone).  Queries are unit vectors;
document vectors are the normalised full vector's prefix at the query width, norms below 1 (not
re-normalised); the score is the dot product."""
from __future__ import annotations

import numpy as np
import torch

from care.encoders.base import Embeddings, Encoder
from care.encoders.dense import batched_forward, pick_device, progress_label
from care.encoders.prompts import Prompts
from care.models.towers import Tower, care_towers


class CAREEncoder(Encoder):
    """`towers=` wraps live towers (training's validation) instead of loading the config's folders."""

    def __init__(self, query: dict, document: dict, name: str = "care", prompts: Prompts | None = None,
                 device: str | None = None, towers: tuple[Tower, Tower] | None = None):
        self.name, self.prompts = name, prompts or Prompts()
        self.device = pick_device(device)
        q, d = towers if towers is not None else care_towers(query, document)
        self.towers = {"query": q.to(self.device).eval(), "document": d.to(self.device).eval()}

    def identity(self, side: str) -> dict:
        # the document side depends on the document tower (and the width it is cut to), never on the query tower
        return {"class": type(self).__name__, "side": side, "tower": self.towers[side].identity(),
                "prompt": self.prompts.of(side)}

    @property
    def online_parameters(self) -> int:
        return sum(p.numel() for p in self.towers["query"].parameters())

    @property
    def online_embedding_parameters(self) -> int:
        return self.towers["query"].model.get_input_embeddings().weight.numel()

    @torch.inference_mode()
    def encode(self, texts, side, batch_size, heads, show_progress) -> Embeddings:
        tower = self.towers[side]

        def step(batch: list[str]):
            inputs = {k: v.to(self.device) for k, v in tower.tokenize(batch).items()}
            return tower(**inputs)["dense"].float().cpu().numpy()

        rows = batched_forward(texts, batch_size, show_progress, progress_label(self.name, side), step)
        return Embeddings(dense=np.stack(rows).astype(np.float32) if rows else np.zeros((0, tower.dim), np.float32))
