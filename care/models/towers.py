"""One tower of an asymmetric (two-tower) model: any Hugging Face model with its own tokenizer, pooling,
max length, padding side and `trust_remote_code` flag, returning L2-normalised vectors, optionally cut to
their first `truncate_dim` dimensions after normalising (a Matryoshka prefix, not re-normalised: CARE's
document side, docs/facts.md s.1).

A decoder (LLM) tower pools its last token, so every text must end in the tokenizer's EOS there:
`append_eos` adds the tokenizer's EOS when the tokenizer appends no end token itself (Qwen3-Embedding's
tokenizer.json appends `<|endoftext|>`, which is its pad token, not its eos_token `<|im_end|>`; transformers'
Qwen2 tokenizer classes add nothing), and left padding keeps the last position real in every row; the last
real token is found from the attention mask, never by comparing ids with the pad id (they coincide there).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer

from care.models.hub import POOLER_FAMILIES, local_folder, weights_digest
from care.models.pooling import pool

POOLING = ("cls", "mean", "last_token")


@dataclass
class TowerSpec:
    path: str
    pooling: str = "cls"
    max_length: int = 512
    padding_side: str = "right"
    trust_remote_code: bool = False
    append_eos: bool = False
    build_hint: str = ""

    @classmethod
    def from_config(cls, c: dict, where: str) -> TowerSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(c) - known - {"build", "backend"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known | {'build', 'backend'})})")
        # `backend` says what runs a query tower when it encodes (care/encoders/care.py strips it before loading);
        # a tower loaded here otherwise is trained or wrapped live, and that is torch
        if c.get("backend", "torch") != "torch":
            raise ValueError(f"{where}.backend={c['backend']!r} only encodes; train with {where}.backend=torch")
        spec = cls(**{k: v for k, v in c.items() if k in known})
        if spec.pooling not in POOLING:
            raise ValueError(f"{where}.pooling={spec.pooling!r}: choose one of {', '.join(POOLING)}")
        if spec.padding_side not in ("left", "right"):
            raise ValueError(f"{where}.padding_side={spec.padding_side!r}: choose left or right")
        if spec.pooling == "cls" and spec.padding_side == "left":
            raise ValueError(f"{where}: CLS pooling reads position 0, which left padding fills with padding")
        return spec


def _load(spec: TowerSpec, where: str, dtype: torch.dtype | None):
    folder = local_folder(spec.path, spec.build_hint)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=spec.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=spec.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            # `++` sets the key or adds it: a plain `key=value` override is refused by Hydra where the model
            # config does not name trust_remote_code (most do not), `+key=value` where it does
            raise ValueError(f"{spec.path} needs its own modelling code: pass ++{where}.trust_remote_code=true "
                             f"(off by default: it runs code shipped with the model)") from None
        raise
    # the tokenizer's faults first: said in seconds, not after loading billions of weights
    if tokenizer.pad_token_id is None:
        raise ValueError(f"the tokenizer of {spec.path} ({where}) has no pad token: batches cannot be padded; "
                         f"save one with a pad token (e.g. tokenizer.pad_token = tokenizer.eos_token)")
    if spec.append_eos and tokenizer.eos_token_id is None:
        raise ValueError(f"{where}.append_eos=true but the tokenizer of {spec.path} has no EOS token")
    extra = {"add_pooling_layer": False} if config.model_type in POOLER_FAMILIES else {}
    model = AutoModel.from_pretrained(folder, dtype=dtype, trust_remote_code=spec.trust_remote_code, **extra)
    tokenizer.padding_side = spec.padding_side
    return model, tokenizer


def appends_eos(tokenizer) -> bool:
    """Whether the tokenizer already ends every encoded text with an end token of its own.  Compared with
    the text's plain tokens, not with `eos_token_id`: Qwen3-Embedding's tokenizer appends <|endoftext|>
    (151643) while its eos_token is <|im_end|> (151645), so an id check would append a second end token."""
    plain = tokenizer("头痛", add_special_tokens=False)["input_ids"]
    full = tokenizer("头痛")["input_ids"]
    return len(full) > len(plain) and full[-len(plain) - 1:-1] == plain if plain else len(full) > 0


class Tower(nn.Module):
    def __init__(self, model: nn.Module, tokenizer, spec: TowerSpec, truncate_dim: int | None = None):
        super().__init__()
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.truncate_dim = truncate_dim
        self.add_eos = spec.append_eos and not appends_eos(tokenizer)

    @classmethod
    def load(cls, spec: TowerSpec, where: str, dtype: torch.dtype | None = None) -> Tower:
        return cls(*_load(spec, where, dtype), spec)

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    @property
    def dim(self) -> int:
        """The width of the vectors it returns."""
        return self.truncate_dim or self.width

    def tokenize(self, texts: list[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        length = min(max_length or self.spec.max_length, self.spec.max_length)
        if not self.add_eos:
            return dict(self.tokenizer(texts, padding=True, truncation=True, max_length=length, return_tensors="pt"))
        eos = self.tokenizer.eos_token_id
        ids = self.tokenizer(texts, truncation=True, max_length=length - 1)["input_ids"]
        ids = [row if row and row[-1] == eos else row + [eos] for row in ids]
        return dict(self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **inputs) -> dict[str, torch.Tensor]:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        return {"dense": self.vectors(hidden, attention_mask)}

    def vectors(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The tower's vectors from its backbone's last hidden states, whatever ran the backbone (torch here,
        ONNX Runtime for an `onnx` query tower, care/encoders/care.py): pooled, normalised, cut."""
        pooled = pool(hidden, attention_mask, self.spec.pooling)
        # at least fp32 (bf16 vectors lose the ranking), never below the weights' own: a float64 run stays exact
        vec = F.normalize(pooled.to(torch.promote_types(pooled.dtype, torch.float32)), dim=-1)
        return vec[:, : self.truncate_dim] if self.truncate_dim else vec

    def identity(self) -> dict:
        """What changes its vectors: the weights (their digest, not where they lie: a copied or hard-linked
        folder keeps its cache) and how texts become vectors."""
        spec = {k: v for k, v in asdict(self.spec).items() if k not in ("path", "build_hint")}
        return {"weights": weights_digest(self.spec.path), **spec, "dim": self.dim, "eos_added": self.add_eos}

    def gradient_checkpointing_enable(self) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def save(self, out_dir: str | Path) -> Path:
        """A Hugging Face folder with its tokenizer: it reloads as a tower (and in evaluate.py ckpt=)."""
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return Path(out_dir)


def care_towers(query: dict, document: dict, dtype: torch.dtype | None = None) -> tuple[Tower, Tower]:
    """The two towers of a CARE model: the document vector is cut to the query tower's width."""
    q = Tower.load(TowerSpec.from_config(query, "model.query"), "model.query", dtype)
    d = Tower.load(TowerSpec.from_config(document, "model.document"), "model.document", dtype)
    if q.width > d.width:
        raise ValueError(f"the query tower ({query['path']}, {q.width}-d) is wider than the document tower "
                         f"({document['path']}, {d.width}-d): document vectors are cut to the query width, so "
                         f"the document tower must be at least as wide")
    d.truncate_dim = q.width if q.width < d.width else None
    return q, d
