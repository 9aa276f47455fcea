"""Stage "score": a teacher's score for every (query, positive) and (query, negative) pair of a training file,
for distillation (FlagEmbedding's pos_scores / neg_scores).  Not part of `stage=all`; it runs when asked:

    python -m data_pipeline stage=score teacher=FOLDER|MODEL_NAME [score.input_dir=...] [score.out_dir=...]

The teacher is a cross-encoder (raw pair logits) or any project encoder (evaluation's similarity); how they are
told apart and how each scores is data_pipeline/teachers.py, the keys conf/score/default.yaml.  Every distinct
pair is scored once, through a cache keyed by the teacher's fingerprint, so an interrupted run resumes where it
stopped; a run whose inputs, teacher and config are unchanged is skipped.

Reads {input_dir}/train.jsonl (rows {"query_id", "pos_ids", "neg_ids", ...}) and {input_dir}/texts.jsonl.
Writes {out_dir}/
  train.jsonl         the input rows as they are, plus teacher_pos_scores (aligned with pos_ids) and
                      teacher_neg_scores (aligned with neg_ids), rounded to 6 decimals
  texts.jsonl         the input's text store (a hard link, or a copy on another filesystem)
  flag_train.jsonl    data_pipeline.build.export_flag of the two (FlagEmbedding's format)
  teacher_scores.png  histogram of positive and negative teacher scores
  stats.json          the teacher (name, kind, fingerprint), pairs scored / cached, the score distributions and
                      the share of examples where a negative outscores the positive(s): a false-negative signal
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.data.examples import read_example_rows, write_examples
from care.data.io import link_or_copy, read_text_store, save_histogram
from care.data.stage_cache import fingerprint
from care.data.stage_start import stage_start
from data_pipeline.build import export_flag
from data_pipeline.teachers import load_teacher, resolve_teacher, teacher_identity

OUTPUTS = ("train.jsonl", "texts.jsonl", "flag_train.jsonl", "teacher_scores.png", "stats.json")
# Settings that change no score: left out of the stage fingerprint (a cache moved, another batch size: skipped).
RUN_SETTINGS = ("cache", "embedding_cache", "device", "batch_size", "chunk_pairs")


def read_training(path: Path, texts: dict[str, str]) -> list[dict]:
    """The rows to score, as they are (care.data.examples: one reader of the format); each names its
    negatives."""
    return [row for _, row in read_example_rows(path, texts, need=("neg_ids",))]


def distinct_pairs(rows: list[dict], texts: dict[str, str]) -> tuple[list[str], list[str], np.ndarray, list]:
    """(distinct query texts, distinct passage texts, distinct (query, passage) index pairs, per row the pair
    numbers of its positives and of its negatives): a text repeated across rows is scored once."""
    queries: dict[str, int] = {}
    docs: dict[str, int] = {}
    pairs: dict[tuple[int, int], int] = {}
    refs = []
    for row in rows:
        q = queries.setdefault(texts[row["query_id"]], len(queries))
        ref = []
        for fld in ("pos_ids", "neg_ids"):
            ref.append([pairs.setdefault((q, docs.setdefault(texts[t], len(docs))), len(pairs)) for t in row[fld]])
        refs.append(ref)
    return list(queries), list(docs), np.array(list(pairs), dtype=np.int64).reshape(-1, 2), refs


def distribution(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    v = np.asarray(values, dtype=np.float64)
    cuts = (5, 25, 50, 75, 95)
    return {"count": len(v), "mean": round(float(v.mean()), 4), "std": round(float(v.std()), 4),
            "min": round(float(v.min()), 4),
            **{f"p{p}": round(float(x), 4) for p, x in zip(cuts, np.percentile(v, cuts))},
            "max": round(float(v.max()), 4)}


def false_negative_signal(scored: list[dict]) -> dict:
    """Among examples with a positive and a negative: the share where some negative scores above every positive
    (above the best), and where some negative scores above some positive (above the worst)."""
    both = [(r["teacher_pos_scores"], r["teacher_neg_scores"]) for r in scored
            if r["teacher_pos_scores"] and r["teacher_neg_scores"]]
    n = len(both)
    above_best = sum(max(neg) > max(pos) for pos, neg in both)
    above_worst = sum(max(neg) > min(pos) for pos, neg in both)
    return {"examples": n, "neg_above_best_pos": above_best, "neg_above_any_pos": above_worst,
            "share_neg_above_best_pos": round(above_best / n, 4) if n else None,
            "share_neg_above_any_pos": round(above_worst / n, 4) if n else None}


def plot_histogram(path: Path, pos: list[float], neg: list[float], title: str, scale: str, bins: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    both = np.asarray(pos + neg, dtype=np.float64)
    edges = np.linspace(both.min(), both.max() + 1e-9, bins + 1) if len(both) else bins
    if neg:
        ax.hist(neg, bins=edges, density=True, color="tab:red", alpha=0.55, label=f"negatives ({len(neg):,})")
    if pos:
        ax.hist(pos, bins=edges, density=True, color="tab:blue", alpha=0.55, label=f"positives ({len(pos):,})")
    save_histogram(fig, ax, path, title, f"teacher score ({scale})", "density")


def run(cfg: DictConfig) -> dict:
    opts = OmegaConf.to_container(cfg.score, resolve=True)
    spec = resolve_teacher(opts.get("teacher"), cfg)  # no teacher, or not one: one line, before anything
    in_dir, out_dir = Path(opts["input_dir"]), Path(opts["out_dir"])
    inputs = [in_dir / "train.jsonl", in_dir / "texts.jsonl"]
    settings = {k: v for k, v in opts.items() if k not in RUN_SETTINGS}
    fp = fingerprint(inputs, {"score": settings, "teacher": teacher_identity(spec, opts)})
    with stage_start(cfg, "score", out_dir, fp, OUTPUTS) as start:
        if start.done:
            return start.skip(f"score: inputs, teacher and config unchanged, skipped ({out_dir})")
        return _score(opts, spec, in_dir, fp, start)


def _score(opts: dict, spec: dict, in_dir: Path, fp: str, start) -> dict:
    """The teacher's score of every distinct pair, the outputs and stats.json (last)."""
    out_dir = start.out
    t0 = time.perf_counter()
    texts = read_text_store(in_dir / "texts.jsonl")
    rows = read_training(in_dir / "train.jsonl", texts)
    queries, docs, pairs, refs = distinct_pairs(rows, texts)
    teacher = load_teacher(spec, opts)
    t1 = time.perf_counter()
    scores = teacher.score(queries, docs, pairs)
    t2 = time.perf_counter()
    scored = []
    for row, (pos, neg) in zip(rows, refs):
        scored.append({**row, "teacher_pos_scores": [round(float(scores[i]), 6) for i in pos],
                       "teacher_neg_scores": [round(float(scores[i]), 6) for i in neg]})

    start.writing()
    link_or_copy(in_dir / "texts.jsonl", out_dir / "texts.jsonl")
    write_examples(out_dir / "train.jsonl", scored)
    export_flag(out_dir / "train.jsonl", out_dir / "texts.jsonl", out_dir / "flag_train.jsonl")
    pos = [s for r in scored for s in r["teacher_pos_scores"]]
    neg = [s for r in scored for s in r["teacher_neg_scores"]]
    signal = false_negative_signal(scored)
    seconds = {"prepare": round(t1 - t0, 2), "score": round(t2 - t1, 2),
               "total": round(time.perf_counter() - t0, 2)}
    stats = {
        "stage": "score", "fingerprint": fp, "input_dir": str(in_dir), "examples": len(scored),
        "teacher": {"name": spec["name"], "kind": teacher.kind, "fingerprint": teacher.fingerprint,
                    "label": teacher.name, "score": teacher.scale},
        "pairs": {"total": len(pos) + len(neg), "distinct": len(pairs), "queries": len(queries),
                  "passages": len(docs)},
        "cache": teacher.cache_stats(),
        "positives": distribution(pos), "negatives": distribution(neg),
        "false_negative_signal": signal,
        "seconds": seconds, "pairs_per_s": round(len(pairs) / max(seconds["score"], 1e-9), 1),
    }
    title = f"{teacher.kind} teacher {teacher.name}\n{len(scored):,} examples, {len(pairs):,} distinct pairs"
    plot_histogram(out_dir / "teacher_scores.png", pos, neg, title, teacher.scale, int(opts["histogram_bins"]))
    stats = start.finish(stats)  # stats.json last: its fingerprint marks the outputs complete
    share = signal["share_neg_above_best_pos"]
    print(f"score: {len(scored):,} examples, {len(pairs):,} distinct pairs by {teacher.kind} {teacher.name} "
          f"({_cache_line(stats['cache'])}); positives mean {stats['positives'].get('mean')}, negatives mean "
          f"{stats['negatives'].get('mean')}; "
          + (f"{share:.1%} of examples have a negative above every positive (possible false negatives); "
             if share is not None else "")
          + f"{seconds['total']} s -> {out_dir}")
    return stats


def _cache_line(cache: dict) -> str:
    if "pairs_computed" in cache:
        return f"{cache['pairs_computed']:,} computed, {cache['pairs_cached']:,} from the cache"
    return f"{cache['texts_encoded']:,} texts encoded, {cache['texts_cached']:,} from the embedding cache"


def summary(stats: dict) -> str:
    t, signal = stats.get("teacher", {}), stats.get("false_negative_signal", {})
    share = signal.get("share_neg_above_best_pos")
    return (f"{stats.get('examples', 0):,} examples, {stats.get('pairs', {}).get('distinct', 0):,} pairs by "
            f"{t.get('kind')} {t.get('label')}" + (f", {share:.1%} with a negative above the positives"
                                                  if share is not None else ""))
