"""The terms the training losses (care.training.losses) are built from: the pool layout, InfoNCE, the one
soft-target cross-entropy every distillation uses, FlagEmbedding's m3_kd_loss, the two optional extras
both losses share: distillation from the training file's teacher scores (`TeacherDistillation`) and
Matryoshka prefixes of the dense vectors (`Matryoshka`), and CARE's in-batch score distillation from the
document tower's own scores (`ScoreDistillation`).

Pool layout: for each query, 1 positive followed by its (group_size - 1) negatives, so query i's positive
sits at pool index i * group_size and every other passage in the pool is a negative for it.  Scores are a
(queries x pool) matrix, already divided by the head's temperature.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from care.training.data import TEACHER_WRITTEN_BY

KD_LOSS_TYPES = ("kl_div", "m3_kd_loss")


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


def soft_targets(teacher_scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(teacher scores / temperature) over the last dimension, with no gradient."""
    scores = at_least_fp32(teacher_scores.detach())
    return torch.softmax(scores if temperature == 1.0 else scores / temperature, dim=-1)


def distill_ce(teacher_scores: torch.Tensor, student_scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Cross-entropy of the student's log_softmax against softmax(teacher / temperature), averaged over rows
    (FlagEmbedding's "kl_div"; KL minus the teacher's entropy, so the same gradient).  The project's one
    soft-target term: self-distillation (teacher = the ensemble's scores) and teacher-score distillation
    (teacher = the file's scores of each query's group) both use it."""
    targets = soft_targets(teacher_scores, temperature)
    return -(targets * torch.log_softmax(at_least_fp32(student_scores), dim=-1)).sum(-1).mean()


def own_group(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(queries, group_size): each query's scores of its own group (its positive, then its negatives)."""
    n = scores.size(0)
    cols = torch.arange(n, device=scores.device)[:, None] * group_size + torch.arange(group_size, device=scores.device)
    return scores.gather(1, cols)


def m3_kd_loss(targets: torch.Tensor, scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """FlagEmbedding 1.4.2's "m3_kd_loss" (AbsEmbedderModel.distill_loss): for each position i of the group,
    the cross-entropy of every query's row of the whole pool's scores against its group member i, weighted
    by the teacher's probability of that member and averaged over queries, with the group members before i
    masked out of the row (so member i competes with the later members and every other query's passages)."""
    scores = at_least_fp32(scores)
    n = scores.size(0)
    rows = torch.arange(n, device=scores.device)
    labels = rows * group_size
    masked = torch.zeros_like(scores, dtype=torch.bool)
    floor = torch.finfo(scores.dtype).min  # FlagEmbedding's mask value
    loss = scores.new_zeros(())
    for i in range(group_size):
        ce = F.cross_entropy(scores.masked_fill(masked, floor), labels + i, reduction="none")
        loss = loss + (targets[:, i].to(ce.dtype) * ce).mean()
        masked = masked.index_put((rows, labels + i), torch.tensor(True, device=scores.device))
    return loss


class TeacherDistillation:
    """Distillation from teacher scores of each query's group (the training file's `teacher_pos_scores` /
    `teacher_neg_scores` of the drawn positive and negatives, a (queries, group_size) tensor).

    weight:       weight of the term added to the loss's total; 0 = off (no teacher scores needed)
    temperature:  the teacher scores are divided by it before the softmax that makes the targets; the
                  student's scores keep their own head temperature.  1.0 = FlagEmbedding (no such knob)
    kd_loss_type: "kl_div": distill_ce of the targets against the student's scores of the query's own group;
                  "m3_kd_loss": FlagEmbedding's per-position cross-entropy over the whole pool (m3_kd_loss)
    """

    def __init__(self, weight: float = 0.0, temperature: float = 1.0, kd_loss_type: str = "kl_div",
                 group_size: int | None = None):
        self.weight, self.temperature, self.kind = float(weight), float(temperature), str(kd_loss_type)
        if self.weight < 0:
            raise ValueError(f"teacher_weight must be >= 0 (0 = no distillation), got {weight}")
        if self.temperature <= 0:
            raise ValueError(f"teacher_temperature must be > 0, got {temperature}")
        if self.kind not in KD_LOSS_TYPES:
            raise ValueError(f"kd_loss_type={kd_loss_type!r}: choose one of {', '.join(KD_LOSS_TYPES)}")
        if self.weight > 0 and group_size == 1:
            raise ValueError("teacher_weight > 0 with group size 1: a group of one positive leaves the teacher "
                             "nothing to rank; train with hard negatives (trainer.group_size >= 2)")

    @property
    def on(self) -> bool:
        return self.weight > 0

    def check(self, teacher_scores: torch.Tensor | None, n_queries: int, group_size: int) -> None:
        if teacher_scores is None:
            raise ValueError(f"teacher_weight={self.weight} but the batch carries no teacher scores: the training "
                             f"file needs teacher_pos_scores and teacher_neg_scores, written by {TEACHER_WRITTEN_BY}")
        if tuple(teacher_scores.shape) != (n_queries, group_size):
            raise ValueError(f"teacher scores of shape {tuple(teacher_scores.shape)} for {n_queries} queries x "
                             f"group size {group_size}: one score per passage of each query's group")

    def __call__(self, scores: torch.Tensor, teacher_scores: torch.Tensor, group_size: int) -> torch.Tensor:
        """The term for one head's (queries x pool) scores, already divided by the head's temperature.  A
        query whose row of teacher scores is NaN (its group borrowed random passages, which no teacher scored)
        is left out: the term is the mean over the scored queries (0 when none is)."""
        teacher = teacher_scores.detach().to(scores.device, at_least_fp32(scores).dtype)
        scored = ~torch.isnan(teacher).any(dim=1)
        if not bool(scored.all()):
            if not bool(scored.any()):
                return scores.sum() * 0.0  # keeps the graph: every process runs the same backward
            teacher = teacher.masked_fill(~scored[:, None], 0.0)
        if self.kind == "kl_div":
            return distill_ce(teacher[scored], own_group(scores, group_size)[scored], self.temperature)
        targets = soft_targets(teacher, self.temperature) * scored[:, None]  # an unscored row weighs nothing
        return m3_kd_loss(targets, scores, group_size) * (len(scored) / int(scored.sum()))


class ScoreDistillation:
    """In-batch score distillation for a two-tower loss (CARE's stage I): the query tower's distribution of
    scores over the pool, softmax_j(q_i . p_j / T), is pulled (distill_ce) towards the document tower's own
    distribution for the same row, softmax_j(d_i . p_j / T), where d_i is query i's positive (its document
    vector: in stage I the same text's) and p_j every vector of the pool (in stage I, group size 1: the
    batch's document vectors, so the target is the document-document distribution).  The target is a
    constant (distill_ce detaches it); the term is distill_ce's cross-entropy, KL(target || student) plus
    the target's entropy, so the same gradient as the KL.

    weight:       weight of the term added to the loss's total; 0 = off
    temperature:  T, for both distributions
    """

    def __init__(self, weight: float = 0.0, temperature: float = 0.1):
        self.weight, self.temperature = float(weight), float(temperature)
        if self.weight < 0:
            raise ValueError(f"score_distill_weight must be >= 0 (0 = off), got {weight}")
        if self.temperature <= 0:
            raise ValueError(f"score_distill_temperature must be > 0, got {temperature}")

    @property
    def on(self) -> bool:
        return self.weight > 0

    def __call__(self, q: torch.Tensor, p: torch.Tensor, group_size: int) -> torch.Tensor:
        """q: (queries, d) query vectors; p: (queries x group_size, d) the pool, in the pool layout."""
        positives = p[torch.arange(len(q), device=p.device) * group_size]
        return distill_ce(positives @ p.T, q @ p.T / self.temperature, self.temperature)


class Matryoshka:
    """InfoNCE on prefixes of the dense vectors (Matryoshka representation learning), added to the full width's.

    The project's convention (docs/facts.md s.1, care/models/towers.py, care/encoders/dense.py `truncate_dim`):
    vectors are L2-normalised at FULL width, then the first d coordinates are kept WITHOUT re-normalising, so
    a prefix's score is q[:d] . p[:d] of the full-width unit vectors, divided by the head's temperature.
    FlagEmbedding's MRL (decoder-only embedders; its M3 model refuses use_mrl) truncates and then
    re-normalises, averages the loss over its listed widths (the full width only when listed) and clamps a
    width above the model's to the full width; here the prefixes are summed onto the full width's term, each
    weighted by `weights` (1 each by default), and a width >= the model's is refused.

    dims:     prefix widths, each 0 < d < the model's width; empty = off
    weights:  one weight per width; None = 1 each
    """

    def __init__(self, dims: Sequence[int] | None = None, weights: Sequence[float] | None = None):
        dims = list(dims or [])
        if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
            raise ValueError(f"matryoshka_dims={dims}: each width must be a positive integer (a prefix 0 < d < "
                             f"the model's width; the full width is always trained)")
        if len(set(dims)) != len(dims):
            raise ValueError(f"matryoshka_dims={dims}: a width is listed twice")
        if weights is None:
            weights = [1.0] * len(dims)
        weights = [float(w) for w in weights]
        if len(weights) != len(dims):
            raise ValueError(f"matryoshka_weights={weights} has {len(weights)} weights for {len(dims)} "
                             f"matryoshka_dims={dims}: one each (or null = 1 each)")
        if any(w < 0 for w in weights):
            raise ValueError(f"matryoshka_weights={weights}: weights must be >= 0")
        self.dims, self.weights = dims, weights

    def __bool__(self) -> bool:
        return bool(self.dims)

    def check_width(self, width: int, where: str = "loss") -> None:
        """Refuse a width the model's vectors (`width`-d) do not leave a shorter prefix of."""
        wide = [d for d in self.dims if d >= width]
        if wide:
            raise ValueError(f"{where}.matryoshka_dims={self.dims}: {wide} not below the model's {width}-d vectors; "
                             f"list prefix widths 0 < d < {width} (the full width is always trained)")

    def terms(self, q: torch.Tensor, p: torch.Tensor, temperature: float, group_size: int,
              name: str) -> dict[str, torch.Tensor]:
        """{f"{name}_dim{d}": InfoNCE of q[:, :d] . p[:, :d] / temperature} for each listed d."""
        self.check_width(q.size(1))
        return {f"{name}_dim{d}": info_nce(q[:, :d] @ p[:, :d].T / temperature, group_size) for d in self.dims}

    def weighted(self, terms: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(w * t for w, t in zip(self.weights, terms.values()))
