"""The cross-encoder reranker as a trainable family (`kind: reranker`, care.families), and its loss.

The family starts from any folder the project can load: an encoder folder (multilingual-e5-small, a tiny
BERT) gets a fresh one-label head, seeded by `seed`; a reranker folder keeps its own.  Each training group
(care.training.data: the positive first, then its mined negatives) becomes group_size (query, passage) pairs,
tokenized as pairs to `model.max_length` tokens (the limit the saved folder scores with), and the group's
logits go to RerankerLoss: softmax cross-entropy over the group with the positive as the target, as
FlagEmbedding's reranker fine-tuning does (its CrossEncoder's compute_loss), or pointwise binary
cross-entropy (`objective: bce`: the positive labelled 1, each negative 0).  The step itself is
care.training.reranker_recipe; the saved folder is a sequence-classification folder
(care.encoders.cross_encoder).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from care.encoders.cross_encoder import TRUNCATION, CrossEncoder
from care.models.hub import resolve_model_path
from care.training.model import freeze, training_dtype

OBJECTIVES = ("softmax", "bce")


class RerankerLoss(nn.Module):
    """scores (batch, group_size): column 0 the positive's logit, the rest its negatives'."""

    distils_teacher = False

    def __init__(self, group_size: int, objective: str = "softmax", temperature: float = 1.0):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"model.loss.objective={objective!r}: choose one of {', '.join(OBJECTIVES)}")
        if group_size < 2:
            raise ValueError(f"trainer.group_size={group_size}: a reranker learns from a positive against its mined "
                             "negatives; give it at least one (trainer.group_size=2 or more)")
        self.group_size, self.objective, self.temperature = group_size, objective, float(temperature)

    def forward(self, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        scores = scores.view(-1, self.group_size).float()
        if self.objective == "softmax":
            target = torch.zeros(len(scores), dtype=torch.long, device=scores.device)
            loss = F.cross_entropy(scores / self.temperature, target)
        else:
            labels = torch.zeros_like(scores)
            labels[:, 0] = 1.0
            loss = F.binary_cross_entropy_with_logits(scores, labels)
        return {"loss": loss, self.objective: loss.detach()}


class RerankerFamily:
    """One sequence-classification module scores both sides at once (`document_module` None)."""

    document_module = None
    dense_width = 1  # one logit; no Matryoshka loss applies

    def __init__(self, cfg: DictConfig):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        m, t = cfg.model, cfg.trainer
        self.model_cfg = OmegaConf.to_container(m, resolve=True)
        self.max_length = int(m.get("max_length", 512))
        folder = resolve_model_path(str(m.path), m.get("build_hint", ""))
        torch.manual_seed(cfg.seed)  # a fresh head is the same for a seed (an encoder folder has none)
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1,
                                                                   dtype=training_dtype(t.get("dtype")) or torch.float32)
        freeze(model, t.freeze)
        if t.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.query_module, self.tokenizer = model, AutoTokenizer.from_pretrained(folder)

    def tokenize(self, texts: Sequence[str], sides: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        raise TypeError("a cross-encoder encodes pairs, not texts: care.training.reranker_recipe tokenizes them")

    def tokenize_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> dict[str, torch.Tensor]:
        """The pairs as care.encoders.cross_encoder scores them (truncation, token limit)."""
        return dict(self.tokenizer(list(queries), list(passages), padding=True, truncation=TRUNCATION,
                                   max_length=self.max_length, return_tensors="pt"))

    def save(self, modules: Sequence[nn.Module], out_dir: Path) -> Path:
        """A sequence-classification folder (weights + tokenizer); st_folder adds the activation."""
        modules[0].save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return Path(out_dir)

    def merge_with_start(self, tuned_dir: Path, out_dir: Path, weight: float) -> Path:
        raise ValueError("trainer.merge_with_start: a reranker's start has no trained head to merge with; "
                         "leave it null for model kind reranker")

    def encoder(self, modules: Sequence[nn.Module], max_length: int) -> CrossEncoder:
        """The live module as a pair scorer (validation); pairs keep the model's own token limit."""
        m = self.model_cfg
        return CrossEncoder(m["path"], name=m["name"], max_length=self.max_length, model=modules[0],
                            tokenizer=self.tokenizer, build_hint=m.get("build_hint", ""))

    def model_config(self) -> dict:
        """care_training.json's model: the folder itself ("."), scored as a reranker."""
        keep = {k: v for k, v in self.model_cfg.items() if k not in ("build_hint", "loss")}
        return {**keep, "kind": "reranker", "path": "."}
