"""Prefixes and instructions, applied in one place: the encoders at inference AND the trainer use
`Prompts.apply`, so a model is never trained on one text format and scored on another.

A model config gives `query_prefix` / `doc_prefix` (multilingual-e5: "query: " / "passage: ").  A prompt
that contains `{text}` is a template instead of a prefix (an LLM embedder's instruction, e.g.
"<instruct>...\\n<query>{text}").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SIDES = ("query", "document")


@dataclass(frozen=True)
class Prompts:
    query: str = ""
    document: str = ""

    @classmethod
    def from_config(cls, model_cfg: Mapping) -> Prompts:
        return cls(model_cfg.get("query_prefix", "") or "", model_cfg.get("doc_prefix", "") or "")

    def of(self, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        return self.query if side == "query" else self.document

    def apply(self, texts: Sequence[str], side: str) -> list[str]:
        prompt = self.of(side)
        if "{text}" in prompt:
            return [prompt.replace("{text}", t) for t in texts]
        return [prompt + t for t in texts]
