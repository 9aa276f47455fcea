"""Prefixes and instructions, applied in one place: the encoders at inference AND the trainer use
`Prompts.apply`, so a model is never trained on one text format and scored on another.

Every model config, whatever its kind, says its prompts the same way (sentence-transformers' word for them):

    prompts: {query: "query: ", document: "passage: "}      # multilingual-e5; "" or left out: none
    instructions: {retrieval: "...", sts: "..."}            # only for a query prompt with {instruction}

A prompt that contains `{text}` is a template instead of a prefix; a query template may also contain
`{instruction}`, filled per task type (retrieval, reranking, sts) from `instructions`, as LLM embedders
(Qwen3-Embedding, CARE: "<instruct>{instruction}\\n<query>{text}") are used.  An instruction changes the
vectors, so it is part of the query side's fingerprint (care.encoders.base.Encoder.side_fingerprint).

Older configs and saved training records (care_training.json) used two other vocabularies: `query_prefix` /
`doc_prefix` for one-backbone models, and a `prompt` inside each CARE tower (`query.prompt`, `document.prompt`).
They still load, with a deprecation message (`Prompts.from_config`); a config giving both vocabularies is
refused, since one of the two would be silently ignored.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from care.families import family_of

SIDES = ("query", "document")
#: the task a query is embedded for when nobody says (training pairs are retrieval pairs)
DEFAULT_TASK = "retrieval"
#: the older keys, per side: one-backbone models' top-level keys, and the key inside each CARE tower
LEGACY_KEYS = {"query": "query_prefix", "document": "doc_prefix"}
LEGACY_TOWER_KEY = "prompt"


def legacy_prompts(model_cfg: Mapping) -> dict[str, tuple[str, str]]:
    """The prompts a config gives in the older vocabularies, as side -> (the key's name, the prompt)."""
    found = {side: (key, model_cfg[key]) for side, key in LEGACY_KEYS.items() if model_cfg.get(key) is not None}
    for side in SIDES:
        tower = model_cfg.get(side)
        if isinstance(tower, Mapping) and tower.get(LEGACY_TOWER_KEY) is not None:
            found[side] = (f"{side}.{LEGACY_TOWER_KEY}", tower[LEGACY_TOWER_KEY])
    return found


def legacy_keyed(model_cfg: Mapping) -> dict:
    """The model config with its prompts under the older keys, which is what every run hash and stage
    fingerprint saw before `prompts:` was named: hashing this form keeps them valid (renaming a key must not
    make a finished run train again or a finished stage re-run).  A config in the older form is returned as is."""
    model = dict(model_cfg)
    if "prompts" not in model:
        return model
    prompts = Prompts.from_config(model)
    del model["prompts"]
    if family_of(model).towers:
        return {**model, **{side: {**model[side], LEGACY_TOWER_KEY: prompts.of(side)} for side in SIDES}}
    return {**model, **{LEGACY_KEYS[side]: prompts.of(side) for side in SIDES}}


@dataclass(frozen=True)
class Prompts:
    query: str = ""
    document: str = ""
    instructions: Mapping[str, str] = field(default_factory=dict)  # task type -> instruction

    @classmethod
    def from_config(cls, model_cfg: Mapping) -> Prompts:
        """A model config's prompts (any kind): `prompts: {query, document}` and `instructions`; the older keys
        (the module docstring) with a deprecation message."""
        given = model_cfg.get("prompts")
        legacy = legacy_prompts(model_cfg)
        names = " / ".join(f"`{name}`" for name, _ in legacy.values())
        if given is not None and legacy:
            raise ValueError(f"model {model_cfg.get('name', '')!r} gives its prompts twice: `prompts` and the older "
                             f"{names}; keep `prompts` (e.g. model.prompts.query=...)")
        if legacy:
            warnings.warn(f"model {model_cfg.get('name', '')!r}: {names} is the older name of `prompts: {{query: ..., "
                          f"document: ...}}` (still read; rename it to keep it working in later versions)",
                          FutureWarning, stacklevel=2)
            given = {side: prompt for side, (_, prompt) in legacy.items()}
        given = dict(given or {})
        if unknown := set(given) - set(SIDES):
            raise ValueError(f"model {model_cfg.get('name', '')!r}: prompts has unknown side(s) {sorted(unknown)} "
                             f"(the sides are {', '.join(SIDES)})")
        return cls(given.get("query") or "", given.get("document") or "", dict(model_cfg.get("instructions") or {}))

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
