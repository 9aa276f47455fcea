"""CARE's two-tower family for the training loop (docs/facts.md s.1; the protocol: care.training.model).

Stage I (alignment): the document tower is frozen and never runs in the loop.  Its vectors of every training
text come from the embedding cache (computed once, or written beforehand by `encode.py`), held by
`CachedDocuments`; a batch's document side is just row numbers into that table.  Only the query tower is
in the optimizer.  Stage II (joint): the query tower starts from stage I's; a LoRA (peft) on the document
tower trains with it, on every attention and MLP projection of the document model, found per architecture.

Stage I's recipe-study options (care.training.care_recipe): with `query_text_max_length` /
`document_text_max_length` set, the query tower tokenizes each training text with its kind's limit (the
kind recorded in stage I's texts.jsonl), which may exceed model.query.max_length (the limit at inference,
unchanged); a kind left null keeps the loop's limit (trainer.query_max_length, capped by
model.query.max_length, as without the option).  `heldout` lists the held-out slice's texts.

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

from care.data.io import link_or_copy_tree, read_jsonl, read_text_store, write_json
from care.encoders.cache import EmbeddingCache, embed
from care.encoders.care import CAREEncoder
from care.encoders.prompts import Prompts
from care.encoders.registry import ensure_towers, tower_config
from care.export.provenance import portable
from care.models.hub import NOT_WEIGHTS, local_folder
from care.models.towers import Tower, care_towers
from care.training.model import freeze, training_dtype

STAGES = ("stage1", "stage2")
KINDS = ("query", "document")  # stage I's kinds of text (care.training.care_recipe.text_kind)
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


def tokenize_with_limits(tower: Tower, texts: Sequence[str], limits: Sequence[int]) -> dict[str, torch.Tensor]:
    """Tower.tokenize with a token limit per text (not capped by the tower's max_length): each text
    truncated to its own limit (the end token kept, as Tower.tokenize does), then the batch padded."""
    tok, features = tower.tokenizer, [None] * len(texts)
    for limit in sorted(set(limits)):
        at = [i for i, n in enumerate(limits) if n == limit]
        if tower.add_eos:
            eos = tok.eos_token_id
            ids = tok([texts[i] for i in at], truncation=True, max_length=limit - 1)["input_ids"]
            rows = [{"input_ids": r if r and r[-1] == eos else r + [eos]} for r in ids]
        else:
            enc = tok([texts[i] for i in at], truncation=True, max_length=limit)
            rows = [{k: v[j] for k, v in enc.items()} for j in range(len(at))]
        for i, row in zip(at, rows):
            features[i] = row
    return dict(tok.pad(features, padding=True, return_tensors="pt"))


def stage1_annotations(texts_path: str | Path) -> tuple[dict[str, str], list[str]]:
    """({text: kind}, held-out texts) from stage I's texts.jsonl (care.training.care_recipe writes both)."""
    rows = list(read_jsonl(texts_path))
    kinds = {r["text"]: r.get("kind") for r in rows}
    if any(k not in KINDS for k in kinds.values()):
        raise ValueError(f"{texts_path} gives no kind (query / document) to some texts: stage I's texts with "
                         "kinds are written by care.training.care_recipe.stage_config")
    return kinds, [r["text"] for r in rows if r.get("heldout")]


def check_cut_folders(m: dict) -> None:
    """Refuse a tower folder cut otherwise (layers, pick) than its `build:` asks: the model registry
    (care.encoders.registry.ensure_towers) builds a tower only when its folder is missing, so
    `build.pick=spread` over a folder cut with `first` would otherwise train the wrong tower."""
    for side in ("query", "document"):
        build, path = m[side].get("build") or {}, m[side].get("path")
        if build.get("tool") != "cut" or not path or Path(build.get("out") or "").resolve() != Path(path).resolve():
            continue
        try:
            key = json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        built, asked = (key.get("layers"), key.get("pick", "first")), (build.get("layers"), build.get("pick") or "first")
        if key.get("tool") == "cut" and built != asked:
            raise ValueError(f"model.{side}.path={path} was cut with layers={built[0]}, pick={built[1]}, and "
                             f"model.{side}.build asks layers={asked[0]}, pick={asked[1]}: give this cut its own "
                             f"folder (model.{side}.build.out and model.{side}.path) or delete {path}")


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
        check_cut_folders(m)
        self.prompts = Prompts.from_config(m)
        self.task = m.get("train_task", "retrieval")
        query, document = care_towers(tower_config(m["query"]), tower_config(m["document"]), training_dtype(t.get("dtype")))
        freeze(query, t.freeze)
        self.query_module, self.document_tower = query, document
        self.dense_width = query.dim  # the document side is cut to it (care.models.towers.care_towers)
        if t.gradient_checkpointing:
            query.gradient_checkpointing_enable()
        # stage I's per-kind query-tower limits, text -> kind (read when an option needs it), held-out texts
        self.kind_max_length, self.kind, self.heldout = dict.fromkeys(KINDS), {}, []
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
            self._stage1_options(m["stages"].get("stage1") or {}, cfg.data.texts)
        else:
            self.cache = None
            self.document_module = self._with_lora(document, m["stages"]["stage2"].get("lora") or {}, t)

    def _stage1_options(self, s1: dict, texts_path: str) -> None:
        self.kind_max_length = {k: s1.get(f"{k}_text_max_length") for k in KINDS}
        if not any(v is not None for v in self.kind_max_length.values()) and not (s1.get("heldout_texts") or 0):
            return
        self.kind, self.heldout = stage1_annotations(texts_path)
        positions = getattr(self.query_module.model.config, "max_position_embeddings", None)
        for k, limit in self.kind_max_length.items():
            if limit is not None and positions and limit > positions:
                raise ValueError(f"model.stages.stage1.{k}_text_max_length={limit}: the query tower has "
                                 f"{positions} positions")

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
            prompted = self.prompts.apply(texts, "query", self.task)
            if self.stage == "stage1" and any(v is not None for v in self.kind_max_length.values()):
                return self._tokenize_by_kind(texts, prompted, max_length)
            return self.query_module.tokenize(prompted, max_length)
        if self.stage == "stage1":  # the document side is a lookup of cached vectors
            return {"rows": torch.tensor([self.row[t] for t in texts], dtype=torch.long)}
        return self.document_module.tokenize(self.prompts.apply(texts, "document"), max_length)

    def _tokenize_by_kind(self, texts: Sequence[str], prompted: list[str], max_length: int | None) -> dict:
        spec = self.query_module.spec
        loop = min(max_length or spec.max_length, spec.max_length)  # Tower.tokenize's limit
        unknown = [t for t in texts if t not in self.kind]
        if unknown:
            raise KeyError(f"{len(unknown)} texts are not stage I's (no kind), e.g. {unknown[0][:40]!r}")
        limits = [self.kind_max_length[self.kind[t]] or loop for t in texts]
        return tokenize_with_limits(self.query_module, prompted, limits)

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
            base = config.get("base_model_name_or_path")
            write_json(adapter, {**config, "base_model_name_or_path": portable(base)})
            readme = adapter.with_name("README.md")  # peft's template card names it too ("adapter:/path"), so
            if base and readme.is_file():  # replaced as a whole string, not by path pattern
                readme.write_text(readme.read_text(encoding="utf-8").replace(base, portable(base)), encoding="utf-8")
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
