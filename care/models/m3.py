"""BGE-M3 style encoder: one Hugging Face backbone, three heads (docs/facts.md s.2).

- dense:   the CLS (or mean-pooled) hidden state, L2-normalised; score = dot product.
- sparse:  Linear(hidden, 1) -> ReLU gives one weight per token; a token id that repeats keeps its largest
           weight; CLS/EOS/PAD/UNK are zeroed; score = sum over shared token ids of the weight products.
- ColBERT: Linear on every token but CLS, padding masked, L2-normalised; score = mean over query tokens
           of the best similarity with any passage token.

The definitions follow FlagEmbedding 1.4.2 (`finetune/embedder/encoder_only/m3/modeling.py`) exactly, and
`save` writes its checkpoint format (HF model folder + `colbert_linear.pt` + `sparse_linear.pt` +
tokenizer), so `FlagEmbedding.BGEM3FlagModel` loads what we train.  Two deliberate differences:

- training never builds a batch x length x vocabulary tensor for the sparse head (FlagEmbedding does, and
  it is its most reported out-of-memory cause): the model returns per-position weights and the training
  score (care/training/head_scores.py) scatters them into batch x (token ids present in the batch);
- `M3Model.load` refuses a folder without the head files (FlagEmbedding silently uses random heads).

`python -m care.tools.build_m3 tiny OUT` writes a tiny random M3 checkpoint (tests, smoke runs);
`python -m care.tools.build_m3 init OUT --backbone PATH` turns any backbone folder into an M3 checkpoint
with freshly initialised heads (the starting point for training from a plain encoder).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from care.data.io import atomic_folder
from care.models import HEADS
from care.models.hub import load_encoder_model, local_folder, read_torch
from care.models.pooling import pool

HEAD_FILES = ("colbert_linear.pt", "sparse_linear.pt")


def ensure_eos(tokenizer) -> None:
    """The M3 sparse head zeroes the EOS token, and FlagEmbedding reads `eos_token_id`; BERT vocabularies
    have no EOS, and there [SEP] plays that role (as in care.models.tiny.chinese_tokenizer)."""
    if tokenizer.eos_token_id is None:
        if tokenizer.sep_token is None:
            raise ValueError("the tokenizer has neither an EOS nor a SEP token; the M3 sparse head needs one")
        tokenizer.eos_token = tokenizer.sep_token


class M3Model(nn.Module):
    """Backbone + ColBERT and sparse heads.  `forward` returns the training representations:

    dense         [B, H]       normalised pooled vectors
    sparse        [B, L]       token weights, zero at special tokens and padding
    sparse_ids    [B, L]       the input ids the weights belong to (no gradient)
    colbert       [B, L-1, D]  normalised token vectors without CLS, zero at padding
    colbert_mask  [B, L-1]     1 for real tokens (no gradient)

    `backbone_heads` names the heads whose loss gradient reaches the backbone (all three by default, the
    source recipe).  A head left out reads the backbone's hidden states detached: it still learns, but its
    loss no longer moves the shared encoder, so fresh heads cannot drag a pretrained dense model around
    while they are still random (`trainer.backbone_heads`).
    """

    def __init__(self, backbone: nn.Module, tokenizer, pooling: str = "cls", colbert_dim: int = -1,
                 colbert_linear: nn.Linear | None = None, sparse_linear: nn.Linear | None = None):
        super().__init__()
        ensure_eos(tokenizer)
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler = None  # never used by M3; left in, it gets no gradient and DDP errors on it
        # ColBERT drops position 0 as CLS and keeps the real tokens that follow: right padding only.
        tokenizer.padding_side = "right"
        self.backbone, self.tokenizer, self.pooling = backbone, tokenizer, pooling
        hidden = backbone.config.hidden_size
        dtype = next(backbone.parameters()).dtype
        # nn.Linear's default initialisation, exactly what FlagEmbedding gives fresh heads.
        if colbert_linear is None:
            colbert_linear = nn.Linear(hidden, hidden if colbert_dim <= 0 else colbert_dim, dtype=dtype)
        self.colbert_linear = colbert_linear
        self.sparse_linear = sparse_linear if sparse_linear is not None else nn.Linear(hidden, 1, dtype=dtype)
        special = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        self.backbone_heads: tuple[str, ...] = HEADS
        self.register_buffer("special_ids", torch.tensor(sorted(i for i in special if i is not None)),
                             persistent=False)

    def set_backbone_heads(self, heads: Sequence[str]) -> None:
        unknown = sorted(set(heads) - set(HEADS))
        if unknown or not heads:
            raise ValueError(f"backbone_heads={list(heads)}: name one or more of {', '.join(HEADS)} (the heads "
                             f"whose loss trains the backbone; to train no backbone at all, freeze it instead)")
        self.backbone_heads = tuple(h for h in HEADS if h in heads)

    @property
    def config(self):
        return self.backbone.config

    def gradient_checkpointing_enable(self) -> None:
        # Non-reentrant checkpointing: works with frozen inputs, GradCache's re-forward and DDP (docs/facts.md s.3).
        self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **inputs) -> dict[str, torch.Tensor]:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        return self.heads(hidden, input_ids, attention_mask)

    def heads(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The three heads on the backbone's last hidden states (care/encoders/m3.py runs the backbone in ONNX
        Runtime and these in torch)."""
        detached = hidden.detach()
        features = {h: hidden if h in self.backbone_heads else detached for h in HEADS}
        dense = F.normalize(pool(features["dense"], attention_mask, self.pooling), dim=-1)
        keep = attention_mask.bool() & ~torch.isin(input_ids, self.special_ids)
        sparse = torch.relu(self.sparse_linear(features["sparse"])).squeeze(-1) * keep
        colbert_mask = attention_mask[:, 1:]
        colbert = F.normalize(self.colbert_linear(features["colbert"][:, 1:]) * colbert_mask.unsqueeze(-1), dim=-1)
        return {"dense": dense, "sparse": sparse, "sparse_ids": input_ids, "colbert": colbert,
                "colbert_mask": colbert_mask}

    # ---- checkpoints in FlagEmbedding's format -------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write the whole folder beside `out_dir`, then swap it in, so a crash never leaves half a
        checkpoint (the folder is replaced as a whole: give each checkpoint its own folder)."""
        with atomic_folder(out_dir) as tmp:
            self.backbone.save_pretrained(tmp)
            for name, head in zip(HEAD_FILES, (self.colbert_linear, self.sparse_linear)):
                torch.save({k: v.detach().clone().cpu() for k, v in head.state_dict().items()}, tmp / name)
            self.tokenizer.save_pretrained(tmp)
        return Path(out_dir)

    @classmethod
    def load(cls, name_or_path: str | Path, pooling: str = "cls", dtype: torch.dtype | None = None,
             build_hint: str = "") -> M3Model:
        folder = local_folder(name_or_path, build_hint)
        missing = [f for f in HEAD_FILES if not (folder / f).exists()]
        if missing:
            raise FileNotFoundError(
                f"{folder} is not an M3 checkpoint: {', '.join(missing)} missing. FlagEmbedding would silently "
                f"use randomly initialised heads here; we refuse. To start training from a plain encoder, "
                f"write fresh heads first: python -m care.tools.build_m3 init OUT --backbone {folder}")
        backbone = load_encoder_model(folder, dtype)
        heads = [read_torch(folder / f) for f in HEAD_FILES]  # a truncated one named (DataError)
        colbert = nn.Linear(heads[0]["weight"].shape[1], heads[0]["weight"].shape[0], dtype=backbone.dtype)
        sparse = nn.Linear(heads[1]["weight"].shape[1], 1, dtype=backbone.dtype)
        colbert.load_state_dict(heads[0])
        sparse.load_state_dict(heads[1])
        return cls(backbone, AutoTokenizer.from_pretrained(folder), pooling, colbert_linear=colbert,
                   sparse_linear=sparse)

    @classmethod
    def from_backbone(cls, name_or_path: str | Path, pooling: str = "cls", colbert_dim: int = -1,
                      seed: int = 0, dtype: torch.dtype | None = None) -> M3Model:
        """Any HF encoder with fresh (seeded) heads: the starting point for M3 training."""
        folder = local_folder(name_or_path)
        backbone = load_encoder_model(folder, dtype)
        torch.manual_seed(seed)
        return cls(backbone, AutoTokenizer.from_pretrained(folder), pooling, colbert_dim)


def load_backbone(name_or_path: str | Path, build_hint: str = "") -> nn.Module:
    """The plain encoder of a Hugging Face folder, an M3 checkpoint or a hub id, without heads: what a
    merge with the start needs (care.training.merge)."""
    return load_encoder_model(local_folder(name_or_path, build_hint))


def tiny_m3(hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0, dropout: float = 0.1,
            pooling: str = "cls") -> M3Model:
    """A tiny BERT with the bert-base-chinese vocabulary and seeded random heads (tests, smoke runs)."""
    from care.models.tiny import tiny_bert

    backbone, tok = tiny_bert(hidden=hidden, layers=layers, heads=heads, seed=seed, dropout=dropout)
    torch.manual_seed(seed + 1)
    return M3Model(backbone, tok, pooling)
