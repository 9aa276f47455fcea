"""The model protocol the training loop drives, so one loop trains any family with no model-specific branch.

A family says how to tokenize texts per side (prompts applied by care.encoders.prompts, the same as at
inference), which modules encode each side (`document_module` None: one module for both, as M3), how to
save a trained model folder, and how to wrap a module as an Encoder for validation.  build_family builds the
one a model config names (its family's `trainer` hook, care.families).  The M3 family (`M3Family`) covers
`kind: m3` checkpoints and plain encoders (`kind: dense`), which become M3 backbones with fresh, seeded heads.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from care.encoders.base import Encoder
from care.encoders.m3 import M3Encoder
from care.encoders.prompts import Prompts
from care.families import FAMILIES, family_of, hook
from care.models.m3 import M3Model, load_backbone
from care.training.merge import merge_with_start


class TrainableFamily(Protocol):
    query_module: nn.Module
    document_module: nn.Module | None  # None: query_module encodes both sides
    dense_width: int  # the width of the dense vectors the loss sees (Matryoshka prefixes must be shorter)

    def tokenize(self, texts: Sequence[str], sides: Sequence[str], max_length: int) -> dict[str, torch.Tensor]: ...

    def save(self, modules: Sequence[nn.Module], out_dir: Path) -> Path: ...

    def merge_with_start(self, tuned_dir: Path, out_dir: Path, weight: float) -> Path: ...

    def encoder(self, modules: Sequence[nn.Module], max_length: int) -> Encoder: ...

    def model_config(self) -> dict: ...


def build_family(cfg: DictConfig) -> TrainableFamily:
    """The TrainableFamily of the run's model config (its family's `trainer` hook), loaded; one line when its
    backend or its family cannot be trained."""
    family = family_of(cfg.model)
    backend = cfg.model.get("backend", "torch")
    if backend != "torch":  # care/encoders/dense.py: the other backends run inference only
        raise ValueError(f"model {cfg.model.get('name')} has backend {backend!r}, which only encodes; "
                         f"train with the torch backend (model.backend=torch)")
    trainable = hook(family, "trainer")
    if trainable is None:
        names = ", ".join(f.name for f in FAMILIES.values() if f.trainer)
        raise ValueError(f"model kind '{family.name}' cannot be trained (trainable kinds: {names})")
    return trainable(cfg)


def freeze(model: nn.Module, patterns: Sequence[str]) -> None:
    """Stop training every parameter whose name contains one of `patterns` (e.g. the 96M-parameter
    vocabulary matrix of multilingual-e5-small, which dominates a CPU optimizer step and which a short
    run barely moves)."""
    for pattern in patterns:
        hits = [p for name, p in model.named_parameters() if pattern in name]
        if not hits:
            raise ValueError(f"trainer.freeze: no parameter name contains {pattern!r}")
        for p in hits:
            p.requires_grad_(False)


def training_dtype(name: str | None) -> torch.dtype | None:
    """`trainer.dtype` (float32, float64, ...): the precision the weights are loaded and trained in;
    null = the default (float32).  float64 makes the distributed loop's tests exact enough to compare."""
    if not name:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"trainer.dtype={name!r} is not a torch floating-point dtype (e.g. float32, float64)")
    return dtype


class M3Family:
    """BGE-M3: one backbone with dense, sparse and ColBERT heads (care.models.m3)."""

    document_module = None

    def __init__(self, cfg: DictConfig):
        m, t = cfg.model, cfg.trainer
        self.model_cfg = OmegaConf.to_container(m, resolve=True)
        self.pooling = m.get("pooling", "cls")
        self.prompts = Prompts.from_config(m)
        self.dtype = training_dtype(t.get("dtype"))
        if family_of(m).folder_files:  # a checkpoint with trained heads (an M3 folder's head files)
            model = M3Model.load(m.path, self.pooling, dtype=self.dtype, build_hint=m.get("build_hint", ""))
        else:  # a plain encoder (e.g. multilingual-e5-small) with fresh, seeded heads
            model = M3Model.from_backbone(m.path, self.pooling, seed=cfg.seed, dtype=self.dtype)
        freeze(model, t.freeze)
        model.set_backbone_heads(list(t.backbone_heads))
        if t.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.query_module, self.tokenizer = model, model.tokenizer
        self.dense_width = model.config.hidden_size  # the pooled hidden state, normalised (care.models.m3)

    def tokenize(self, texts: Sequence[str], sides: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        prompted = [self.prompts.apply([t], side)[0] for t, side in zip(texts, sides)]
        return dict(self.tokenizer(prompted, padding=True, truncation=True, max_length=max_length,
                                   return_tensors="pt"))

    def save(self, modules: Sequence[nn.Module], out_dir: Path) -> Path:
        """FlagEmbedding's M3 folder, loadable by evaluate.py ckpt=... and BGEM3FlagModel."""
        return modules[0].save(out_dir)

    def merge_with_start(self, tuned_dir: Path, out_dir: Path, weight: float) -> Path:
        """weight x the tuned backbone + (1 - weight) x the start's (care.training.merge), heads as tuned."""
        merged = M3Model.load(tuned_dir, self.pooling, dtype=self.dtype)
        merge_with_start(merged, load_backbone(self.model_cfg["path"], self.model_cfg.get("build_hint", "")), weight)
        return merged.save(out_dir)

    def encoder(self, modules: Sequence[nn.Module], max_length: int) -> Encoder:
        m = self.model_cfg
        return M3Encoder(m["path"], name=m["name"], pooling=self.pooling, prompts=self.prompts,
                         max_length=max_length,
                         device=str(next(modules[0].parameters()).device), model=modules[0])

    def model_config(self) -> dict:
        """How evaluate.py builds a saved folder (recorded in its care_training.json): the path is the folder
        itself, "." (care.encoders.registry.record_model_config)."""
        return {**{k: v for k, v in self.model_cfg.items() if k != "build_hint"}, "kind": "m3", "path": "."}
