"""Pooling of token states into one vector: CLS (BERT/BGE), mean (E5), last token (Qwen3-Embedding)."""
from __future__ import annotations

import torch


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if mode == "last_token":
        # Works for left padding (the last position is real for every row) and right padding alike.
        if bool(attention_mask[:, -1].all()):
            return hidden[:, -1]
        last = attention_mask.sum(1) - 1
        return hidden[torch.arange(hidden.size(0), device=hidden.device), last]
    raise ValueError(f"unknown pooling '{mode}' (choose cls, mean or last_token)")
