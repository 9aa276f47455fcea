"""Contrastive losses over a query batch and a passage pool (in-batch + hard negatives); their building
blocks (InfoNCE, the soft-target cross-entropy, teacher distillation, Matryoshka prefixes) are in
care.training.loss_terms, whose docstring gives the pool layout.

`M3Loss` is InfoNCE per head (dense, sparse, ColBERT), each with its own temperature, combined with
configurable weights.  Two presets in conf/loss/:
- equal.yaml (default, the source recipe, docs/facts.md s.1): L = L_dense + L_sparse + L_colbert;
- flagembedding.yaml (FlagEmbedding 1.4.2's M3 recipe, docs/facts.md s.2):
  main = (L_dense + L_ensemble + 0.1 L_sparse + L_colbert) / 4 with ensemble scores
  s_dense + 0.3 s_sparse + s_colbert, and self-distillation from the ensemble:
  L = (main + (D_dense + 0.1 D_sparse + D_colbert) / 3) / 2,
  D_head = cross-entropy of the head's scores against softmax(ensemble scores, detached).
Both presets also carry the two extras, off by default: distillation from the training file's teacher
scores (`teacher_*`, `kd_loss_type`) and Matryoshka widths of the dense head (`matryoshka_*`).

`AsymmetricLoss` is CARE's (two towers), with the same two extras and in-batch score distillation from the
document tower's own scores (loss_terms.ScoreDistillation; stage I).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from care.models import HEADS
from care.training.head_scores import HEAD_SCORES
from care.training.loss_terms import (
    Matryoshka,
    ScoreDistillation,
    TeacherDistillation,
    at_least_fp32,
    distill_ce,
    info_nce,
    pool_group_size,
)

TERMS = (*HEADS, "ensemble")


def rows(representations: Mapping[str, torch.Tensor]) -> int:
    """The number of texts a representation dict (M3Model.forward) holds: the rows of the first head it has,
    whichever heads the model gives."""
    return len(next(representations[h] for h in HEADS if h in representations))


class M3Loss(nn.Module):
    """InfoNCE per head + optional ensemble term, self-distillation, teacher distillation and Matryoshka
    prefixes of the dense head; returns the total and every term.

    temperature:      one value for all heads or {head: value}
    weights:          {dense, sparse, colbert, ensemble} weights of the InfoNCE terms; a head missing from
                      the model's representations must have weight 0
    ensemble_mix:     score weights of the ensemble head (FlagEmbedding: dense 1, sparse 0.3, colbert 1)
    self_distill:     add FlagEmbedding's self-distillation from the ensemble, L = (main + distill) / 2
    distill_weights:  per-head weights of the self-distillation terms, averaged over the heads
    group_size:       passages per query; None infers it from the pool and checks the layout
    matryoshka_dims, matryoshka_weights: prefix widths of the dense head (loss_terms.Matryoshka): the dense
                      InfoNCE becomes L_dense + sum_d w_d L_dense[:d], all times weights["dense"]; the
                      ensemble, self-distillation and teacher terms use the full width only
    teacher_weight, teacher_temperature, kd_loss_type: distillation from the teacher scores passed to
                      forward (loss_terms.TeacherDistillation); main += teacher_weight x T with
                      T = sum over heads of teacher_heads[h] x KD_h (h's scores, already / its temperature),
                      added before self-distillation's average
    teacher_heads:    {dense, sparse, colbert, ensemble} weights of the distilled heads; None = `weights`,
                      i.e. each head the loss trains at its InfoNCE weight (FlagEmbedding's M3 distils every
                      head it trains, the ensemble included)

    FlagEmbedding 1.4.2's M3 (EncoderOnlyEmbedderM3Model.forward), given teacher scores, makes each head's
    term kl_div: KD_h + InfoNCE_h (added, as here: teacher_weight 1 and teacher_heads None give its loss);
    m3_kd_loss: KD_h alone, in place of InfoNCE_h (here: weights all 0, teacher_heads = the weights it
    would have had, teacher_weight 1).
    """

    def __init__(self, temperature: float | Mapping = 0.02, weights: Mapping | None = None,
                 ensemble_mix: Mapping | None = None, self_distill: bool = False,
                 distill_weights: Mapping | None = None, group_size: int | None = None,
                 matryoshka_dims: Sequence[int] | None = None, matryoshka_weights: Sequence[float] | None = None,
                 teacher_weight: float = 0.0, teacher_temperature: float = 1.0, kd_loss_type: str = "kl_div",
                 teacher_heads: Mapping | None = None):
        super().__init__()
        temps = temperature if isinstance(temperature, Mapping) else {h: temperature for h in HEADS}
        self.temperature = {h: float(temps[h]) for h in HEADS}
        self.weights = {"dense": 1.0, "sparse": 1.0, "colbert": 1.0, "ensemble": 0.0, **(weights or {})}
        self.ensemble_mix = {"dense": 1.0, "sparse": 0.3, "colbert": 1.0, **(ensemble_mix or {})}
        self.self_distill = bool(self_distill)
        self.distill_weights = {"dense": 1.0, "sparse": 0.1, "colbert": 1.0, **(distill_weights or {})}
        self.group_size = group_size
        self.matryoshka = Matryoshka(matryoshka_dims, matryoshka_weights)
        self.teacher = TeacherDistillation(teacher_weight, teacher_temperature, kd_loss_type, group_size)
        given = teacher_heads is not None
        self.teacher_heads = {t: float(w) for t, w in (teacher_heads if given else self.weights).items()}
        for name, table in (("loss weight", self.weights), ("teacher_heads", self.teacher_heads)):
            unknown = set(table) - set(TERMS)
            if unknown:
                raise ValueError(f"unknown {name}(s) {sorted(unknown)}; use dense, sparse, colbert, ensemble")
        if self.teacher.on and not any(w > 0 for w in self.teacher_heads.values()):
            raise ValueError(f"teacher_weight > 0 but every teacher_heads weight is 0 ({self.teacher_heads})")
        if not any(w > 0 for w in self.weights.values()) and not self.teacher.on:
            raise ValueError(f"every loss weight is 0 ({self.weights}): nothing to train")
        if self.matryoshka and self.weights["dense"] <= 0:
            raise ValueError(f"matryoshka_dims={self.matryoshka.dims} are prefixes of the dense head, whose "
                             f"loss weight is 0: set weights.dense > 0 or matryoshka_dims=[]")

    @property
    def distils_teacher(self) -> bool:
        """Whether forward needs teacher scores (the trainer then requires them in the training file)."""
        return self.teacher.on

    def check_width(self, width: int, where: str = "loss") -> None:
        """Refuse Matryoshka widths the model's `width`-d dense vectors cannot give (at the run's start)."""
        self.matryoshka.check_width(width, where)

    def _distilled(self) -> dict[str, float]:
        return {t: w for t, w in self.teacher_heads.items() if w > 0} if self.teacher.on else {}

    def _mixed(self) -> bool:
        return self.weights["ensemble"] > 0 or self.self_distill or "ensemble" in self._distilled()

    def _needed_heads(self) -> list[str]:
        mixed, distilled = self._mixed(), self._distilled()
        return [h for h in HEADS
                if self.weights[h] > 0 or h in distilled or (mixed and self.ensemble_mix[h] > 0)]

    def forward(self, q: dict, p: dict, teacher_scores: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """q, p: representation dicts (M3Model.forward) of the queries and the whole pool; teacher_scores:
        (queries, group_size) raw teacher scores of each query's group, needed when teacher_weight > 0."""
        group = pool_group_size(rows(q), rows(p), self.group_size)
        if self.teacher.on:
            self.teacher.check(teacher_scores, rows(q), group)
        q, p = ({k: at_least_fp32(v) if v.is_floating_point() else v for k, v in r.items()} for r in (q, p))
        scores = {}
        for h in self._needed_heads():
            if h not in q:
                raise ValueError(f"loss weight for head '{h}' is > 0 but the model gives no {h} representations")
            scores[h] = HEAD_SCORES[h](q, p) / self.temperature[h]
        out = {h: info_nce(s, group) for h, s in scores.items()}
        if self._mixed():
            scores["ensemble"] = sum(self.ensemble_mix[h] * scores[h] for h in scores)
            out["ensemble"] = info_nce(scores["ensemble"], group)
        total = sum(self.weights[k] * v for k, v in out.items())
        if self.matryoshka:
            prefixes = self.matryoshka.terms(q["dense"], p["dense"], self.temperature["dense"], group, "dense")
            total = total + self.weights["dense"] * self.matryoshka.weighted(prefixes)
            out.update(prefixes)
        if self.teacher.on:
            kd = {h: self.teacher(scores[h], teacher_scores, group) for h in self._distilled()}
            out["teacher"] = sum(self.teacher_heads[h] * v for h, v in kd.items())
            out.update({f"teacher_{h}": v for h, v in kd.items()})
            total = total + self.teacher.weight * out["teacher"]
        if self.self_distill:
            distill = [self.distill_weights[h] * distill_ce(scores["ensemble"], scores[h]) for h in HEADS if h in scores]
            out["distill"] = sum(distill) / len(distill)
            total = (total + out["distill"]) / 2
        return {"loss": total, **out}


class AsymmetricLoss(nn.Module):
    """CARE's loss between a query tower and a document tower (docs/facts.md s.1): InfoNCE over the query x
    pool dot products / temperature, plus `mse_weight` x the MSE between each query vector and its
    positive's document vector (squared L2 summed over dimensions, averaged over rows).  Stage I aligns
    same-text pairs (temperature 0.1, MSE on); stage II trains on mined hard negatives (0.02, no MSE).

    matryoshka_dims, matryoshka_weights: InfoNCE also on the first d coordinates of both sides' vectors
        (loss_terms.Matryoshka: the full-width unit vectors' prefixes, not re-normalised), summed onto the
        full width's; the MSE term stays at the full width (the query width the document side is cut to)
    teacher_weight, teacher_temperature, kd_loss_type: distillation from the training file's teacher
        scores (loss_terms.TeacherDistillation) of the full-width scores, added x teacher_weight; stage II
        only (stage I's same-text pairs carry no teacher scores)
    score_distill_weight, score_distill_temperature: in-batch score distillation (loss_terms.ScoreDistillation):
        + score_distill_weight x distill_ce(softmax(d_i . p_j / T), softmax(q_i . p_j / T)), d_i query i's
        positive, at the full width; T = score_distill_temperature (None: `temperature`); weight 0 = off
    """

    def __init__(self, temperature: float = 0.1, mse_weight: float = 1.0, group_size: int | None = None,
                 matryoshka_dims: Sequence[int] | None = None, matryoshka_weights: Sequence[float] | None = None,
                 teacher_weight: float = 0.0, teacher_temperature: float = 1.0, kd_loss_type: str = "kl_div",
                 score_distill_weight: float = 0.0, score_distill_temperature: float | None = None):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature, self.mse_weight, self.group_size = float(temperature), float(mse_weight), group_size
        self.matryoshka = Matryoshka(matryoshka_dims, matryoshka_weights)
        self.teacher = TeacherDistillation(teacher_weight, teacher_temperature, kd_loss_type, group_size)
        self.score_distill = ScoreDistillation(
            score_distill_weight, self.temperature if score_distill_temperature is None else score_distill_temperature)

    @property
    def distils_teacher(self) -> bool:
        return self.teacher.on

    def check_width(self, width: int, where: str = "loss") -> None:
        self.matryoshka.check_width(width, where)

    def forward(self, q: dict, p: dict, teacher_scores: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        # one dtype for both sides: stage I's cached document vectors are float32 whatever the query tower's
        dtype = torch.promote_types(torch.promote_types(q["dense"].dtype, p["dense"].dtype), torch.float32)
        qv, pv = q["dense"].to(dtype), p["dense"].to(dtype)
        if qv.size(1) != pv.size(1):
            raise ValueError(f"query vectors are {qv.size(1)}-d, document vectors {pv.size(1)}-d: cut the document "
                             f"side to the query width")
        group = pool_group_size(len(qv), len(pv), self.group_size)
        if self.teacher.on:
            self.teacher.check(teacher_scores, len(qv), group)
        scores = qv @ pv.T / self.temperature
        out = {"infonce": info_nce(scores, group)}
        if self.mse_weight:
            positives = pv[torch.arange(len(qv), device=pv.device) * group]
            out["mse"] = (qv - positives).pow(2).sum(-1).mean()
        total = out["infonce"] + self.mse_weight * out.get("mse", 0.0)
        if self.matryoshka:
            prefixes = self.matryoshka.terms(qv, pv, self.temperature, group, "infonce")
            total = total + self.matryoshka.weighted(prefixes)
            out.update(prefixes)
        if self.teacher.on:
            out["teacher"] = self.teacher(scores, teacher_scores, group)
            total = total + self.teacher.weight * out["teacher"]
        if self.score_distill.on:
            out["score_distill"] = self.score_distill(qv, pv, group)
            total = total + self.score_distill.weight * out["score_distill"]
        return {"loss": total, **out}
