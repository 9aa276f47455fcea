"""Contrastive losses over a query batch and a passage pool (in-batch + hard negatives).

Pool layout: for each query, 1 positive followed by its (group_size - 1) negatives, so query i's positive
sits at pool index i * group_size and every other passage in the pool is a negative for it.

`M3Loss` is InfoNCE per head (dense, sparse, ColBERT), each with its own temperature, combined with
configurable weights.  Two presets in conf/loss/:
- equal.yaml (default, the source recipe, docs/facts.md s.1): L = L_dense + L_sparse + L_colbert;
- flagembedding.yaml (FlagEmbedding 1.4.2's M3 recipe, docs/facts.md s.2):
  main = (L_dense + L_ensemble + 0.1 L_sparse + L_colbert) / 4 with ensemble scores
  s_dense + 0.3 s_sparse + s_colbert, and self-distillation from the ensemble:
  L = (main + (D_dense + 0.1 D_sparse + D_colbert) / 3) / 2,
  D_head = cross-entropy of the head's scores against softmax(ensemble scores, detached).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from care.models.m3 import HEAD_SCORES, HEADS


def pool_group_size(n_queries: int, n_passages: int, group_size: int | None = None) -> int:
    """The passages per query, checked against the pool layout (a wrong layout gives wrong labels silently)."""
    if group_size is None:
        if n_queries == 0 or n_passages % n_queries:
            raise ValueError(f"a pool of {n_passages} passages does not split into groups for {n_queries} "
                             f"queries: the layout is 1 positive + its negatives per query, in query order")
        return n_passages // n_queries
    if n_passages != n_queries * group_size:
        raise ValueError(f"a pool of {n_passages} passages does not fit {n_queries} queries x group size "
                         f"{group_size} (1 positive + {group_size - 1} negatives each)")
    return group_size


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Softmax over large pools is done in fp32 or better (bf16/fp16 scores lose the ranking)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def info_nce(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Cross-entropy of each query's row of (temperature-scaled) scores against its positive."""
    labels = torch.arange(scores.size(0), device=scores.device) * group_size
    return F.cross_entropy(at_least_fp32(scores), labels)


def distill_ce(teacher_scores: torch.Tensor, student_scores: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the teacher's softmax (FlagEmbedding's "kl_div"; same gradient as KL)."""
    targets = torch.softmax(at_least_fp32(teacher_scores.detach()), dim=-1)
    return -(targets * torch.log_softmax(at_least_fp32(student_scores), dim=-1)).sum(-1).mean()


class M3Loss(nn.Module):
    """InfoNCE per head + optional ensemble term and self-distillation; returns the total and every term.

    temperature:      one value for all heads or {head: value}
    weights:          {dense, sparse, colbert, ensemble} weights of the InfoNCE terms; a head missing from
                      the model's representations must have weight 0
    ensemble_mix:     score weights of the ensemble head (FlagEmbedding: dense 1, sparse 0.3, colbert 1)
    self_distill:     add FlagEmbedding's self-distillation from the ensemble, L = (main + distill) / 2
    distill_weights:  per-head weights of the distillation terms, averaged over the heads
    group_size:       passages per query; None infers it from the pool and checks the layout
    """

    def __init__(self, temperature: float | Mapping = 0.02, weights: Mapping | None = None,
                 ensemble_mix: Mapping | None = None, self_distill: bool = False,
                 distill_weights: Mapping | None = None, group_size: int | None = None):
        super().__init__()
        temps = temperature if isinstance(temperature, Mapping) else {h: temperature for h in HEADS}
        self.temperature = {h: float(temps[h]) for h in HEADS}
        self.weights = {"dense": 1.0, "sparse": 1.0, "colbert": 1.0, "ensemble": 0.0, **(weights or {})}
        self.ensemble_mix = {"dense": 1.0, "sparse": 0.3, "colbert": 1.0, **(ensemble_mix or {})}
        self.self_distill = bool(self_distill)
        self.distill_weights = {"dense": 1.0, "sparse": 0.1, "colbert": 1.0, **(distill_weights or {})}
        self.group_size = group_size
        unknown = set(self.weights) - {*HEADS, "ensemble"}
        if unknown:
            raise ValueError(f"unknown loss weight(s) {sorted(unknown)}; use dense, sparse, colbert, ensemble")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"every loss weight is 0 ({self.weights}): nothing to train")

    def config(self) -> dict:
        return {"class": type(self).__name__, "temperature": self.temperature, "weights": self.weights,
                "ensemble_mix": self.ensemble_mix, "self_distill": self.self_distill,
                "distill_weights": self.distill_weights, "group_size": self.group_size}

    def _needed_heads(self) -> list[str]:
        mixed = self.weights["ensemble"] > 0 or self.self_distill
        return [h for h in HEADS if self.weights[h] > 0 or (mixed and self.ensemble_mix[h] > 0)]

    def forward(self, q: dict, p: dict) -> dict[str, torch.Tensor]:
        """q, p: representation dicts (M3Model.forward) of the queries and the whole pool."""
        group = pool_group_size(len(q["dense"]), len(p["dense"]), self.group_size)
        q, p = ({k: at_least_fp32(v) if v.is_floating_point() else v for k, v in r.items()} for r in (q, p))
        scores = {}
        for h in self._needed_heads():
            if h not in q:
                raise ValueError(f"loss weight for head '{h}' is > 0 but the model gives no {h} representations")
            scores[h] = HEAD_SCORES[h](q, p) / self.temperature[h]
        out = {h: info_nce(s, group) for h, s in scores.items()}
        if self.weights["ensemble"] > 0 or self.self_distill:
            ensemble = sum(self.ensemble_mix[h] * scores[h] for h in scores)
            out["ensemble"] = info_nce(ensemble, group)
        total = sum(self.weights[k] * v for k, v in out.items())
        if self.self_distill:
            distill = [self.distill_weights[h] * distill_ce(ensemble, scores[h]) for h in scores]
            out["distill"] = sum(distill) / len(distill)
            total = (total + out["distill"]) / 2
        return {"loss": total, **out}


class AsymmetricLoss(nn.Module):
    """CARE's loss between a query tower and a document tower (docs/facts.md s.1): InfoNCE over the query x
    pool dot products / temperature, plus `mse_weight` x the MSE between each query vector and its
    positive's document vector (squared L2 summed over dimensions, averaged over rows).  Stage I aligns
    same-text pairs (temperature 0.1, MSE on); stage II trains on mined hard negatives (0.02, no MSE)."""

    def __init__(self, temperature: float = 0.1, mse_weight: float = 1.0, group_size: int | None = None):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature, self.mse_weight, self.group_size = float(temperature), float(mse_weight), group_size

    def config(self) -> dict:
        return {"class": type(self).__name__, "temperature": self.temperature, "mse_weight": self.mse_weight,
                "group_size": self.group_size}

    def forward(self, q: dict, p: dict) -> dict[str, torch.Tensor]:
        # one dtype for both sides: stage I's cached document vectors are float32 whatever the query tower's
        dtype = torch.promote_types(torch.promote_types(q["dense"].dtype, p["dense"].dtype), torch.float32)
        qv, pv = q["dense"].to(dtype), p["dense"].to(dtype)
        if qv.size(1) != pv.size(1):
            raise ValueError(f"query vectors are {qv.size(1)}-d, document vectors {pv.size(1)}-d: cut the document "
                             f"side to the query width")
        group = pool_group_size(len(qv), len(pv), self.group_size)
        out = {"infonce": info_nce(qv @ pv.T / self.temperature, group)}
        if self.mse_weight:
            positives = pv[torch.arange(len(qv), device=pv.device) * group]
            out["mse"] = (qv - positives).pow(2).sum(-1).mean()
        total = out["infonce"] + self.mse_weight * out.get("mse", 0.0)
        return {"loss": total, **out}
