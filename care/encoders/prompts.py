"""Prefixes and instructions, applied in one place: the encoders at inference AND the trainer use
`Prompts.apply`, so a model is never trained on one text format and scored on another.

A model config gives `query_prefix` / `doc_prefix` (multilingual-e5: "query: " / "passage: ").  A prompt
that contains `{text}` is a template instead of a prefix; a query template may also contain
`{instruction}`, filled per task type (retrieval, reranking, sts) from `instructions`, as LLM embedders
(Qwen3-Embedding, CARE: "<instruct>{instruction}\\n<query>{text}") are used.  An instruction changes the
vectors, so it is part of the query side's fingerprint (care.encoders.base.Encoder.side_fingerprint).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SIDES = ("query", "document")
#: the task a query is embedded for when nobody says (training pairs are retrieval pairs)
DEFAULT_TASK = "retrieval"


@dataclass(frozen=True)
class Prompts:
    query: str = ""
    document: str = ""
    instructions: Mapping[str, str] = field(default_factory=dict)  # task type -> instruction

    @classmethod
    def from_config(cls, model_cfg: Mapping) -> Prompts:
        return cls(model_cfg.get("query_prefix", "") or "", model_cfg.get("doc_prefix", "") or "",
                   dict(model_cfg.get("instructions") or {}))

    def of(self, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        return self.query if side == "query" else self.document

    def instruction(self, side: str, task: str | None = None) -> str | None:
        """The instruction a `side` prompt gets for `task` (None when the prompt takes none)."""
        if "{instruction}" not in self.of(side):
            return None
        task = task or DEFAULT_TASK
        if task not in self.instructions:
            raise ValueError(f"no instruction for task type {task!r}: the model config's `instructions` has "
                             f"{sorted(self.instructions)}")
        return self.instructions[task]

    def apply(self, texts: Sequence[str], side: str, task: str | None = None) -> list[str]:
        prompt = self.of(side)
        instruction = self.instruction(side, task)
        if instruction is not None:
            prompt = prompt.replace("{instruction}", instruction)
        if "{text}" in prompt:
            return [prompt.replace("{text}", t) for t in texts]
        return [prompt + t for t in texts]
