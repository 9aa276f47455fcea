"""Running tasks: mteb's scores, evaluate.py's own numbers for the same tasks, and the two side by side.

    evaluate_tasks(encoder, tasks)    mteb.evaluate -> {task: {map_at_10, ndcg_at_10, cosine_pearson, ...}}
    project_scores(encoder, tasks)    evaluate.py's runners on the same data -> {task: {metric: value}}
    compare(encoder, tasks)           mteb's main score per task beside evaluate.py's own number, and the difference
    print_comparison(rows, header)    compare()'s rows as a Markdown table
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from care.encoders import Encoder
from care.encoders.cache import EmbeddingCache
from care.evaluation.mteb_adapter.data import care_spec, load_hub_task, task_data
from care.evaluation.mteb_adapter.model import MtebEncoder, dense_only, mteb_evaluate
from care.evaluation.mteb_adapter.scores import DATA_TYPES, project_metric


def evaluate_tasks(encoder: Encoder | MtebEncoder, tasks: Sequence, batch_size: int = 64,
                   scores: Sequence[str] | None = None, results: str | os.PathLike | None = None,
                   ) -> dict[str, dict[str, float]]:
    """mteb.evaluate on mteb tasks (benchmark_tasks, cmteb_task, mteb.get_task): {task name: {score: value}}
    of each task's first eval split, `scores` only (all numeric ones when None), and `main_score`.  Nothing is
    written, unless `results` names a folder: mteb's result cache there (mteb_evaluate, results.py)."""
    tasks = list(tasks)
    result = mteb_evaluate(encoder, tasks, batch_size, results=results)
    by_name = {r.task_name: r for r in result.task_results}
    out = {}
    for task in tasks:
        row = next(r for r in by_name[task.metadata.name].scores[task.eval_splits[0]] if r["hf_subset"] == "default")
        keep = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[task.metadata.name] = {k: keep[k] for k in scores if k in keep} if scores else keep
        out[task.metadata.name]["main_score"] = float(row["main_score"])
    return out


def project_scores(encoder: Encoder | MtebEncoder, tasks: Sequence, batch_size: int = 64,
                   cache: EmbeddingCache | None = None, depth: int = 1024, seed: int = 0) -> dict[str, dict[str, float]]:
    """evaluate.py's own numbers for the same tasks: its runners (care.evaluation.benchmarks.run_task) on each
    task's data (task_data) with its TaskSpec (care_spec), dense head: {task name: {metric: value}}."""
    from care.evaluation.benchmarks import run_task
    from care.retrieval.scorer import EncoderScorer

    encoder = encoder.encoder if isinstance(encoder, MtebEncoder) else dense_only(encoder)
    scorer = EncoderScorer(encoder, cache, batch_size=batch_size, heads=("dense",), show_progress=False)
    return {t.metadata.name: run_task(care_spec(t), task_data(t), scorer, depth=depth, seed=seed)["dense"]
            for t in tasks}


def compare(encoder: Encoder, tasks: Sequence, batch_size: int = 64, cache: EmbeddingCache | None = None,
            depth: int = 1024, seed: int = 0, similarity: str = "auto", results: str | os.PathLike | None = None,
            name: str | None = None, meta: Mapping | None = None) -> dict[str, dict]:
    """mteb's main score of each task next to the project's counterpart (project_metric), computed in the
    same process: {task name: {type, main_score, mteb, metric, project, diff (mteb - project), mteb_scores,
    project_scores, counts}}.  Tasks the project cannot score (an mteb Classification task, say) get
    project None.  `cache` (an EmbeddingCache) lets both sides share vectors.  `results`: a folder mteb's
    result cache writes mteb's results to (none by default); `name`, `meta`: its ModelMeta's name and
    caller-set fields (MtebEncoder)."""
    tasks = list(tasks)
    ours = {}
    for task in tasks:
        if getattr(task, "care_data", None) is not None or DATA_TYPES.get(task.metadata.type):
            ours.update(project_scores(encoder, [task], batch_size, cache, depth, seed))
        else:
            load_hub_task(task)
    model = MtebEncoder(encoder, cache=cache, similarity=similarity, name=name, meta=meta)
    theirs = evaluate_tasks(model, tasks, batch_size, results=results)
    rows = {}
    for task in tasks:
        name, main = task.metadata.name, task.metadata.main_score
        metric = project_metric(main)
        mine = ours.get(name, {}).get(metric)
        got = theirs[name]["main_score"]
        counts = task_data(task).counts if name in ours else {}
        rows[name] = {"type": task.metadata.type, "data": "project" if hasattr(task, "care_data") else "mteb", "main_score": main, "mteb": got, "metric": metric,
                      "project": mine, "diff": None if mine is None else got - mine, "mteb_scores": theirs[name],
                      "project_scores": ours.get(name), "counts": {k: v for k, v in counts.items() if k != "read"}}
    return rows


def print_comparison(rows: Mapping[str, dict], header: str) -> None:
    print(header)
    print("| task | type | mteb score | mteb | project metric | project | mteb - project |")
    print("|---|---|---|---:|---|---:|---:|")
    for name, r in rows.items():
        mine = "-" if r["project"] is None else f"{100 * r['project']:.2f}"
        diff = "-" if r["diff"] is None else f"{100 * r['diff']:+.4f}"
        print(f"| {name} | {r['type']} | {r['main_score']} | {100 * r['mteb']:.2f} | {r['metric'] or '-'} | {mine} "
              f"| {diff} |")
    notes = [f"{name}: {k} {v}" for name, r in rows.items() if r["data"] == "mteb" for k, v in r["counts"].items()
             if k in ("skipped_one_sided_lists", "positives_outside_candidates") and v]
    if notes:
        print("left out by the project's reading of mteb's data (mteb scores them): " + "; ".join(notes))
