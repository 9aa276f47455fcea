"""Build an encoder from a `model=` config.  `kind` picks the implementation:

dense  one backbone, pooled and normalised (multilingual-e5-small, bge-large-zh, tiny test models)
m3     BGE-M3 style: one backbone, dense + sparse + ColBERT heads (care.models.m3)
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from care.encoders.base import Encoder


def build_encoder(cfg: DictConfig | dict, path: str | None = None, device: str | None = None) -> Encoder:
    """`path` overrides cfg.path (evaluate.py's `ckpt=`)."""
    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    kind = c.get("kind", "dense")
    path = str(path or c["path"])
    hint = c.get("build_hint", "")
    if kind == "dense":
        from care.encoders.dense import HFDenseEncoder

        return HFDenseEncoder(
            path, name=c.get("name", "dense"), pooling=c.get("pooling", "cls"),
            query_prefix=c.get("query_prefix", ""), doc_prefix=c.get("doc_prefix", ""),
            max_length=c.get("max_length", 512), normalize=c.get("normalize", True),
            truncate_dim=c.get("truncate_dim"), device=device, padding_side=c.get("padding_side", "right"),
            build_hint=hint)
    if kind == "m3":
        from care.models.m3 import M3Encoder

        return M3Encoder.from_config(c, path=path, device=device)
    raise ValueError(f"unknown model kind '{kind}' in model config (choose dense or m3)")
