"""CARE's two-tower family for the training loop (docs/facts.md s.1; the protocol: care.training.model).

Stage I (alignment): the document tower is frozen and never runs in the loop.  Its vectors of every training
text come from the embedding cache (computed once, or written beforehand by `encode.py`), held by
`CachedDocuments`; a batch's document side is just row numbers into that table.  Only the query tower is
in the optimizer.  Stage II (joint): the query tower starts from stage I's; a LoRA (peft) on the document
tower trains with it, on every attention and MLP projection of the document model, found per architecture.

A saved model folder holds query/ and document/ (each a Hugging Face folder with its tokenizer) and, after
stage II, the LoRA adapter in document_adapter/ beside the merged document/.  In stage I the document tower
is the frozen start, hard-linked into every folder (care.data.io.link_or_copy_tree): each folder loads
alone, and the links cost no disk; across filesystems they are copies (docs/export.md, "Disk").
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from omegaconf import DictConfig, OmegaConf
from torch import nn

from care.data.io import link_or_copy_tree, read_text_store, write_json
from care.encoders.cache import EmbeddingCache, embed
from care.encoders.care import CAREEncoder
from care.encoders.registry import ensure_towers, tower_config, tower_prompts
from care.export.provenance import portable
from care.models.hub import NOT_WEIGHTS, local_folder
from care.models.towers import Tower, care_towers
from care.training.model import freeze, training_dtype

STAGES = ("stage1", "stage2")
# A linear layer inside a numbered transformer block (BERT: encoder.layer.3.attention.self.query;
# Qwen3: layers.3.mlp.down_proj): an attention or MLP projection, the layers CARE's LoRA adapts.
BLOCK_LINEAR = re.compile(r"(^|\.)(layer|layers|h|block|blocks)\.\d+\.")


def lora_targets(model: nn.Module) -> list[str]:
    """Full names of every linear projection inside the model's transformer blocks."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and BLOCK_LINEAR.search(name)]
    if not names:
        raise ValueError(f"found no linear layer inside numbered transformer blocks of {type(model).__name__}: "
                         "cannot place the LoRA")
    return names


class CachedDocuments(nn.Module):
    """Stage I's document side: the frozen tower's vectors of the training texts; input = row numbers."""

    def __init__(self, vectors: np.ndarray):
        super().__init__()
        self.register_buffer("table", torch.from_numpy(np.ascontiguousarray(vectors, np.float32)), persistent=False)

    def forward(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"dense": self.table[rows]}


class CAREFamily:
    def __init__(self, cfg: DictConfig):
        m, t = OmegaConf.to_container(cfg.model, resolve=True), cfg.trainer
        self.model_cfg, self.stage = m, m.get("current_stage") or "stage1"
        if self.stage not in STAGES:
            raise ValueError(f"model.current_stage={self.stage!r}: choose one of {', '.join(STAGES)}")
        ensure_towers(m)
        self.prompts = tower_prompts(m)
        self.task = m.get("train_task", "retrieval")
        query, document = care_towers(tower_config(m["query"]), tower_config(m["document"]), training_dtype(t.get("dtype")))
        freeze(query, t.freeze)
        self.query_module, self.document_tower = query, document
        self.dense_width = query.dim  # the document side is cut to it (care.models.towers.care_towers)
        if t.gradient_checkpointing:
            query.gradient_checkpointing_enable()
        if self.stage == "stage1":
            document.requires_grad_(False).eval()
            self.cache = EmbeddingCache(cfg.cache.dir)  # document side only: validation encodes queries afresh
            texts = list(dict.fromkeys(read_text_store(cfg.data.texts).values()))
            state = PartialState()  # this process's accelerator device (the towers are still on the CPU)
            with state.main_process_first():  # one process encodes; the others then read its cache
                encoder = CAREEncoder(m["query"], m["document"], name=m["name"], prompts=self.prompts,
                                      device=str(state.device), towers=(query, document))
                vectors = embed(encoder, texts, "document", self.cache, batch_size=64).dense
            self.row = {text: i for i, text in enumerate(texts)}
            self.document_module = CachedDocuments(vectors)
        else:
            self.cache = None
            self.document_module = self._with_lora(document, m["stages"]["stage2"].get("lora") or {}, t)

    @staticmethod
    def _with_lora(document: Tower, lora: dict, t: DictConfig) -> Tower:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=lora.get("r", 32), lora_alpha=lora.get("alpha", 64), lora_dropout=lora.get("dropout", 0.1),
                            target_modules=lora_targets(document.model))
        document.model = get_peft_model(document.model, config)  # freezes everything but the adapter
        if t.gradient_checkpointing:
            document.model.enable_input_require_grads()
            document.gradient_checkpointing_enable()
        return document

    def tokenize(self, texts: Sequence[str], sides: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        if set(sides) == {"query"}:
            return self.query_module.tokenize(self.prompts.apply(texts, "query", self.task), max_length)
        if self.stage == "stage1":  # the document side is a lookup of cached vectors
            return {"rows": torch.tensor([self.row[t] for t in texts], dtype=torch.long)}
        return self.document_module.tokenize(self.prompts.apply(texts, "document"), max_length)

    def save(self, modules: Sequence[nn.Module], out_dir: Path) -> Path:
        out = Path(out_dir)
        modules[0].save(out / "query")
        if self.stage == "stage1":  # the frozen start: linked, never re-written
            spec = self.document_tower.spec
            link_or_copy_tree(local_folder(spec.path, spec.build_hint), out / "document",
                              skip=NOT_WEIGHTS - {"manifest.json"})
        else:
            tower = modules[1]
            tower.model.save_pretrained(out / "document_adapter")
            adapter = out / "document_adapter" / "adapter_config.json"  # peft records the base by its local path
            config = json.loads(adapter.read_text(encoding="utf-8"))
            write_json(adapter, {**config, "base_model_name_or_path": portable(config.get("base_model_name_or_path"))})
            merged = copy.deepcopy(tower.model).merge_and_unload()
            merged.save_pretrained(out / "document")
            tower.tokenizer.save_pretrained(out / "document")
        return out

    def merge_with_start(self, tuned_dir: Path, out_dir: Path, weight: float) -> Path:
        raise ValueError("trainer.merge_with_start is for one-backbone models; a CARE run keeps it null")

    def encoder(self, modules: Sequence[nn.Module], max_length: int | None) -> CAREEncoder:
        """Each tower keeps its own max_length (its config), whatever the loop passes."""
        document = self.document_tower if self.stage == "stage1" else modules[1]
        return CAREEncoder(self.model_cfg["query"], self.model_cfg["document"], name=self.model_cfg["name"],
                           prompts=self.prompts, device=str(next(modules[0].parameters()).device),
                           towers=(modules[0], document))

    def model_config(self) -> dict:
        """How evaluate.py builds a saved folder: its two towers, query/ and document/, relative to the folder
        (care.encoders.registry.record_model_config)."""
        m = {k: v for k, v in self.model_cfg.items() if k not in ("stages", "current_stage", "stage")}
        towers = {side: {k: v for k, v in m[side].items() if k not in ("build", "build_hint")} for side in ("query", "document")}
        return {**m, **{side: {**tower, "path": side} for side, tower in towers.items()}}
