"""The names the two sides use: project task types and mteb's, project metrics (care.evaluation.metrics) and
mteb's scores, and the TaskSpec the project's runners score a task with that has none (a C-MTEB task).

    mteb_score(metric)       ndcg_cut_10 -> ndcg_at_10, pearson -> cosine_pearson, ... (None without one)
    project_metric(score)    the other way
    default_spec(data, ...)  DEFAULT_METRICS, primary = the counterpart of mteb's main score
"""
from __future__ import annotations

import re

from care.data.tasks import TaskData

#: project task type (care.data.tasks) -> mteb task type
MTEB_TYPES = {"retrieval": "Retrieval", "reranking": "Reranking", "candidates": "Reranking", "sts": "STS"}
#: mteb task type -> the project task type its data is read as
DATA_TYPES = {"Retrieval": "retrieval", "Reranking": "reranking", "STS": "sts"}
#: what the project reports for a C-MTEB task, beside the counterpart of mteb's main score
DEFAULT_METRICS = {"retrieval": ["ndcg_cut_10", "map_cut_10", "mrr_10", "recall_100", "recall_1000"],
                   "reranking": ["map_cut_10", "map_cut_1000", "mrr_10", "ndcg_cut_10"],
                   "sts": ["pearson", "spearman"]}
#: project metric family -> mteb score prefix (both trec_eval's measures through pytrec_eval, docs/facts.md s.6)
FAMILIES = {"ndcg_cut": "ndcg_at", "map_cut": "map_at", "mrr": "mrr_at", "recall": "recall_at",
            "success": "hit_rate_at"}
#: the project's STS correlations are of cosines (care.evaluation.tasks.run_sts): mteb's cosine_* scores
STS_SCORES = {"pearson": "cosine_pearson", "spearman": "cosine_spearman"}


def mteb_score(metric: str) -> str | None:
    """The mteb score equal to a project metric (care.evaluation.metrics names): ndcg_cut_10 -> ndcg_at_10,
    map_cut_10 -> map_at_10, success_k -> hit_rate_at_k, pearson -> cosine_pearson; None without one
    (acc_N, map_min_r_k)."""
    if metric in STS_SCORES:
        return STS_SCORES[metric]
    match = re.fullmatch(r"([a-z_]+?)_(\d+)", metric)
    if not match or match.group(1) not in FAMILIES:
        return None
    return f"{FAMILIES[match.group(1)]}_{match.group(2)}"


def project_metric(score: str) -> str | None:
    """The project metric an mteb score equals, or None (precision_at_k, naucs...).  mteb's plain `pearson` and
    `spearman` use the model's similarity: the project's (cosine) numbers only for a cosine model."""
    for metric, cosine in STS_SCORES.items():
        if score in (cosine, metric):
            return metric
    for family, prefix in FAMILIES.items():
        if match := re.fullmatch(rf"{prefix}_(\d+)", score):
            return f"{family}_{match.group(1)}"
    return None


def default_spec(data: TaskData, name: str, split: str, main_score: str | None = None):
    """A TaskSpec for the project's runners on a task that has none (a C-MTEB task): DEFAULT_METRICS, primary =
    the counterpart of mteb's main score."""
    from care.evaluation.benchmarks import TaskSpec

    kind = "reranking" if data.type == "candidates" else data.type
    metrics = list(DEFAULT_METRICS[kind])
    primary = project_metric(main_score) if main_score else None
    if primary is None:
        primary = metrics[0]
    elif primary not in metrics:
        metrics.insert(0, primary)
    return TaskSpec(key=name, type=data.type, path=data.path, metrics=metrics, primary=primary, split=split)
