"""The mine stage's false-negative judge: a cross-encoder (`mine.judge=<folder>`: a reranker this project
trained, `python train.py model=me5_reranker`, or any one-label sequence classifier such as bge-reranker-v2-m3)
scores each example's query against its positives and its mined negatives, after the window has chosen them
and before train.jsonl is written (data_pipeline/mining.py).  A negative is flagged when its score s reaches
the example's positive score p less the margin:

    s >= p - mine.judge_margin     (p: the LOWEST of the example's positives, as mine.relative_margin takes;
                                    a tie is flagged: a negative as relevant as a positive is none)

`mine.judge_rule` says what happens to a flagged negative:
  drop     it leaves neg_ids (and neg_scores; a fallback one lowers `fallback`)
  relabel  it becomes a positive: appended to pos_ids, its miner similarity to pos_scores (RLHN, arXiv
           2505.16967, relabels hard negatives an LLM judges relevant)
stats.json "judge" counts the negatives judged and flagged, and what the rule did with them.  Scores go through
the score stage's teacher (data_pipeline/teachers.py: the one cross-encoder scoring path, its pair cache and
settings, conf/score/default.yaml).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.paths import portable
from data_pipeline.score import distinct_pairs
from data_pipeline.teachers import CrossEncoderTeacher, cross_fingerprint, folder_kind, resolve_teacher

JUDGE_KEYS = ("judge", "judge_rule", "judge_margin")  # conf/mine/default.yaml; off (and unfingerprinted) when judge is null
JUDGE_RULES = ("drop", "relabel")
SCORE_SETTINGS = ("max_length", "batch_size", "chunk_pairs", "cache", "device")  # taken from cfg.score


def judge_spec(opts: dict, cfg: DictConfig) -> dict | None:
    """The judge's teacher spec, checked before any work; None when mine.judge is null."""
    if not opts.get("judge"):
        return None
    if opts.get("judge_rule") not in JUDGE_RULES:
        raise ValueError(f"mine.judge_rule={opts.get('judge_rule')!r}: choose one of {', '.join(JUDGE_RULES)}")
    if float(opts.get("judge_margin") or 0.0) < 0:
        raise ValueError(f"mine.judge_margin={opts['judge_margin']}: a margin is >= 0 (0 = at or above the positive)")
    judge = str(opts["judge"])
    folder = Path(judge).expanduser()
    what = "a judge is a cross-encoder folder (a reranker's final/, or a one-label *ForSequenceClassification folder)"
    if not folder.is_dir():  # said here: the teacher's words would name teacher= and a conf/model file
        raise ValueError(f"mine.judge={judge}: no such folder ({folder.resolve()}); {what}")
    kind = folder_kind(folder.resolve())
    if kind != "cross-encoder":
        found = f"a sequence {kind}" if kind else "not a cross-encoder folder"
        raise ValueError(f"mine.judge={judge}: {folder.resolve()} is {found}; {what}, not a bi-encoder")
    return resolve_teacher(judge, cfg)


def score_options(cfg: DictConfig) -> dict:
    score = OmegaConf.to_container(cfg.score, resolve=True)
    return {k: score.get(k) for k in SCORE_SETTINGS}


def judge_identity(spec: dict, opts: dict, cfg: DictConfig) -> dict:
    """The judge's part of the stage fingerprint (its weights and token limit, the rule and margin)."""
    return {"fingerprint": cross_fingerprint(spec["folder"], score_options(cfg)), "rule": opts["judge_rule"],
            "margin": float(opts.get("judge_margin") or 0.0)}


def flagged(pos: np.ndarray, neg: np.ndarray, margin: float) -> np.ndarray:
    """Positions of the negatives whose score reaches the lowest positive score less the margin."""
    if not len(pos) or not len(neg):
        return np.zeros(len(neg), dtype=bool)
    return neg >= pos.min() - margin


def judge_rows(rows: list[dict], texts: dict[str, str], spec: dict, opts: dict, cfg: DictConfig) -> tuple[list, dict]:
    """The rows after the rule, and stats.json's "judge"."""
    teacher = CrossEncoderTeacher(spec, score_options(cfg))
    queries, docs, pairs, refs = distinct_pairs(rows, texts)
    scores = teacher.score(queries, docs, pairs)
    rule, margin = opts["judge_rule"], float(opts.get("judge_margin") or 0.0)
    out, hits, affected = [], 0, 0
    for row, (pos_refs, neg_refs) in zip(rows, refs):
        hit = flagged(scores[pos_refs], scores[neg_refs], margin)
        n = int(hit.sum())
        hits, affected = hits + n, affected + (n > 0)
        if not n:
            out.append(row)
            continue
        keep = np.flatnonzero(~hit).tolist()
        moved = np.flatnonzero(hit).tolist()
        first_fallback = len(row["neg_ids"]) - int(row.get("fallback") or 0)
        new = {**row, "neg_ids": [row["neg_ids"][i] for i in keep],
               "neg_scores": [row["neg_scores"][i] for i in keep],
               "fallback": sum(i >= first_fallback for i in keep)}
        if rule == "relabel":
            new["pos_ids"] = row["pos_ids"] + [row["neg_ids"][i] for i in moved]
            new["pos_scores"] = row["pos_scores"] + [row["neg_scores"][i] for i in moved]
        out.append(new)
    stats = {"judge": portable(str(spec["name"])), "fingerprint": teacher.fingerprint, "rule": rule,
             "margin": margin, "negatives_judged": int(sum(len(r["neg_ids"]) for r in rows)), "flagged": hits,
             "dropped": hits if rule == "drop" else 0, "relabelled": hits if rule == "relabel" else 0,
             "examples_affected": affected, "cache": portable(teacher.cache_stats())}
    return out, stats
