"""`dedup.engine=datatrove`: the exact and MinHash stages as datatrove tasks, the stage folder the native one.

The stage (data_pipeline/dedup/stage.py) hands over here after its config and lock checks.  In order:
1. the input is read once with the native engine's checks and filters (stage.filtered_rows), and the byte
   offset of every kept row recorded (store/), so a task reads its texts from the input itself;
2. each of dedup.stages' exact / minhash stages runs as datatrove steps (dedup_steps.py) on the executor of
   dedup.executor (executors.py), each step after every task of the one before finished;
3. this process writes clusters.jsonl (exact clusters, then MinHash clusters, each by kept position; a
   removed text's Jaccard to the kept one computed as the native engine does), kept.jsonl (the surviving
   rows, parsed and written as the native engine writes them) and stats.json, reading rows by position,
   never the whole input at once.  A semantic stage after them runs as the native one on the survivors.
Memory: the tasks hold their own range of texts (dedup.tasks: auto gives ~ROWS_PER_TASK each) or hash
range of a band (BUCKET_RECORDS records); this process holds the positions removed and one check set of
the ids while reading (read_text_rows).

The work folder: dedup.work_dir, else <cache_root>/datatrove/dedup/<stage fingerprint>-tasks_<dedup.tasks> (on
Slurm it must be on a filesystem every node sees), held by a run lock (care/runlock.py) while the stage runs.
A failed or stopped run leaves it, and the same command resumes: each step's finished tasks are skipped
(datatrove's completions/).  It is deleted when the stage has written its folder (dedup.keep_work=true
keeps it) and emptied at the start of a force=true run.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from itertools import chain, pairwise
from pathlib import Path

import numpy as np
from datatrove.io import get_datafolder
from omegaconf import DictConfig

from care.data.io import write_jsonl
from care.data.stage_cache import LOCK_FILES
from care.runlock import FORCE_KEY, locked_folder
from data_pipeline.dedup.clusters import survivors
from data_pipeline.dedup.minhash import choose_bands_rows, s_curve
from data_pipeline.dedup.minhash_reference import jaccard, shingles
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.distributed.dedup_steps import (
    MAX_POSITIONS,
    PAIRS,
    ExactFind,
    ExactSignature,
    MinhashBuckets,
    MinhashCluster,
    MinhashSignature,
    MinhashVerify,
    StoreReader,
    TextStore,
    read_array,
    write_array,
)
from data_pipeline.distributed.executors import make_executor, run_steps

ROWS_PER_TASK = 100_000     # dedup.tasks=auto: texts per task (a task's memory follows its texts)
BUCKET_RECORDS = 1 << 20    # band records per bucket unit (~32 MB of records before grouping)
LINE_BATCH = 20_000         # cluster members read by position at once while writing clusters.jsonl


def task_count(d: DictConfig, n: int) -> int:
    """dedup.tasks, or for `auto` one task per ROWS_PER_TASK texts; on the local executor with more than one,
    a multiple of the workers, so no round of a step runs one task alone."""
    tasks = d.get("tasks", "auto")
    if tasks == "auto":
        tasks = max(1, math.ceil(n / ROWS_PER_TASK))
        workers = int(d.get("workers", -1))
        workers = workers if workers > 0 else os.cpu_count() or 1
        if tasks > 1 and str(d.get("executor", "local")) == "local":
            tasks = math.ceil(tasks / workers) * workers
        return tasks
    if not isinstance(tasks, int) or isinstance(tasks, bool) or tasks < 1:
        raise ValueError(f"dedup.tasks={tasks!r}: a positive number of tasks or 'auto'")
    return tasks


def _line_offsets(path: Path, linenos: np.ndarray) -> np.ndarray:
    """Byte offset of each of these (1-based) line numbers, as care.data.io.text_lines numbers lines."""
    with open(path, "rb") as fh:
        lengths = np.fromiter(map(len, fh), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    return starts[linenos - 1]


def prepare_store(work, src: Path, filters, tasks_setting: DictConfig, filtered_rows) -> tuple[dict, int]:
    """Read the input with the native engine's checks and filters (`filtered_rows`: the stage's own reader);
    write store/ (offsets, manifest).  Returns the read counts and the number of tasks."""
    counts: dict = {}
    linenos = np.fromiter((ln for ln, _ in filtered_rows(src, *filters, counts)), dtype=np.int64)
    n = len(linenos)
    if n >= MAX_POSITIONS:
        raise ValueError(f"{src}: {n:,} texts; dedup.engine=datatrove numbers texts in 32 bits (fewer than 2^32)")
    tasks = task_count(tasks_setting, n)
    starts = [(n * r) // tasks for r in range(tasks + 1)]
    write_array(work, "store/offsets.bin", _line_offsets(src, linenos))
    with work.open("store/manifest.json", "wt") as fh:
        json.dump({"input": str(src.resolve()), "rows": n, "starts": starts}, fh)
    roles, sources = filters
    return {**counts, "roles": list(roles) if roles else None, "sources": list(sources) if sources else None}, tasks


def work_folder(cfg: DictConfig, fp: str) -> Path:
    """dedup.work_dir, else one folder per stage fingerprint and task setting (`auto` resolves from the
    number of texts, which the fingerprint fixes)."""
    d = cfg.dedup
    if d.get("work_dir"):
        return Path(d.work_dir)
    return Path(cfg.cache_root) / "datatrove" / "dedup" / f"{fp}-tasks_{d.get('tasks', 'auto')}"


def _exact_steps(d, work, logs: Path, tasks: int, before: list[str]):
    sig = make_executor(d, [StoreReader(work), ExactSignature(work, dict(d.normalize), tasks, before)],
                        logs / "exact_signature", tasks, "dedup_exact_signature")
    find = make_executor(d, [ExactFind(work)], logs / "exact_find", tasks, "dedup_exact_find")
    return [("exact: digests", sig), ("exact: groups", find)]


def _minhash_steps(d, work, logs: Path, tasks: int, before: list[str], alive: int, bands: int, rows: int):
    m = d.minhash
    ranges = max(1, math.ceil(alive / BUCKET_RECORDS))
    sig = make_executor(d, [StoreReader(work), MinhashSignature(work, dict(d.normalize), m.ngram, m.num_perm,
                                                                 m.seed, bands, rows, before)],
                        logs / "minhash_signature", tasks, "dedup_minhash_signature")
    buckets = make_executor(d, [MinhashBuckets(work, bands, rows, ranges)], logs / "minhash_buckets",
                            min(tasks, bands * ranges), "dedup_minhash_buckets")
    verify = make_executor(d, [MinhashVerify(work, dict(d.normalize), m.ngram, m.threshold)],
                           logs / "minhash_verify", tasks, "dedup_minhash_verify")
    cluster = make_executor(d, [MinhashCluster(work)], logs / "minhash_cluster", 1, "dedup_minhash_cluster")
    return [("minhash: signatures", sig), ("minhash: buckets", buckets), ("minhash: exact Jaccard", verify),
            ("minhash: clusters", cluster)]


def _cluster_pairs(work, stage: str) -> np.ndarray:
    """A stage's (kept, removed) positions, sorted by kept then removed."""
    files = [f for f in work.list_files(f"{stage}/clusters") if f.endswith(".bin")] if stage == "exact" else \
        ["minhash/clusters.bin"]
    pairs = np.concatenate([read_array(work, f, PAIRS) for f in files]) if files else np.zeros(0, dtype=PAIRS)
    return pairs[np.lexsort((pairs["removed"], pairs["kept"]))]


def _largest_at(store: TextStore, pairs: np.ndarray, k: int = 10) -> list[dict]:
    """stage._largest on positions: the k largest clusters (size, then kept position), kept text's start."""
    kept, sizes = np.unique(pairs["kept"], return_counts=True)
    top = np.lexsort((kept, -(sizes + 1)))[:k]
    rows = store.rows(kept[top].astype(np.int64))
    return [{"kept_id": r["id"], "size": int(s) + 1, "text": r["text"][:80]} for r, s in zip(rows, sizes[top])]


def _lines(store: TextStore, stage: str, pairs: np.ndarray, min_edge: dict | None, normalise, ngram: int
           ) -> Iterator[dict]:
    """stage._cluster_lines on positions, read in batches of whole clusters: exact clusters' similarities
    are 1.0; a MinHash cluster's are the exact Jaccard of each removed text to the kept one."""
    if not len(pairs):
        return
    bounds = np.flatnonzero(np.concatenate([[True], pairs["kept"][1:] != pairs["kept"][:-1], [True]]))
    starts = bounds[:-1]
    b0 = 0
    while b0 < len(starts):
        b1 = min(len(starts), b0 + max(1, LINE_BATCH // 4))
        lo, hi = int(starts[b0]), int(bounds[b1])
        part = pairs[lo:hi]
        needed = np.unique(np.concatenate([part["kept"], part["removed"]])).astype(np.int64)
        rows = dict(zip(needed.tolist(), store.rows(needed)))
        for c0, c1 in zip(starts[b0:b1].tolist(), bounds[b0 + 1:b1 + 1].tolist()):
            kept = int(pairs["kept"][c0])
            removed = pairs["removed"][c0:c1].tolist()
            if min_edge is None:
                sims, weakest = [1.0] * len(removed), 1.0
            else:
                own = shingles(normalise(rows[kept]["text"]), ngram)
                sims = [jaccard(own, shingles(normalise(rows[r]["text"]), ngram)) for r in removed]
                weakest = min_edge[kept]
            yield {"stage": stage, "kept_id": rows[kept]["id"], "removed_ids": [rows[r]["id"] for r in removed],
                   "similarity_to_kept": [round(float(s), 4) for s in sims],
                   "min_edge_similarity": round(weakest, 4)}
        b0 = b1


def datatrove_dedup(cfg: DictConfig, src: Path, fp: str, thresholds: dict | None, filters, start, parts) -> dict:
    """The stage's work on the datatrove engine (module docstring); returns start.finish's stats."""
    order = list(cfg.dedup.stages)
    if "semantic" in order and order[-1] != "semantic":
        raise ValueError(f"dedup.stages={order}: with dedup.engine=datatrove the semantic stage comes last "
                         "(exact and MinHash run as datatrove tasks first)")
    work_path = work_folder(cfg, fp)
    # one run per work folder: two runs of one input and config (into two out= folders) would share it
    with locked_folder(work_path, "dedup work folder", force=bool(cfg.get(FORCE_KEY, False))):
        if cfg.get("force"):   # a fresh run, nothing resumed
            for entry in [p for p in work_path.iterdir() if p.name not in LOCK_FILES]:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        result = _run(cfg, src, fp, thresholds, filters, start, work_path, parts)
    if not cfg.dedup.get("keep_work"):
        shutil.rmtree(work_path, ignore_errors=True)
    return result


def _run(cfg: DictConfig, src: Path, fp: str, thresholds: dict | None, filters, start, work_path: Path,
         parts) -> dict:
    # the stage's own parts, handed in by data_pipeline/dedup/stage.py (so this module never imports the stage
    # back): the same reader, cluster lines, largest clusters, semantic step and stats header as native
    _cluster_lines, _largest, _semantic, stats_header = (parts.cluster_lines, parts.largest, parts.semantic,
                                                         parts.stats_header)

    d, out, order = cfg.dedup, start.out, list(cfg.dedup.stages)
    t_read = time.perf_counter()
    work, logs = get_datafolder(str(work_path)), work_path / "logs"
    counts, tasks = prepare_store(work, src, filters, d, parts.filtered_rows)
    store = TextStore(work)
    n = store.manifest["rows"]
    stats = stats_header(src, out, fp, counts, order)
    stats["engine"] = {"name": "datatrove", "executor": str(d.get("executor", "local")), "tasks": tasks,
                       "read_seconds": round(time.perf_counter() - t_read, 3)}
    normalise = Normalizer(**d.normalize)
    removed = np.zeros(0, dtype=np.uint64)
    line_parts: list = []
    done: list[str] = []
    for name in [s for s in order if s != "semantic"]:
        t0 = time.perf_counter()
        alive = n - len(removed)
        extra = {}
        if name == "exact":
            steps = _exact_steps(d, work, logs, tasks, done) if alive else []
        else:
            m = d.minhash
            bands, rows = choose_bands_rows(m.threshold, m.num_perm, m.target_recall)
            steps = _minhash_steps(d, work, logs, tasks, done, alive, bands, rows) if alive else []
        run_steps(d, steps)
        pairs = _cluster_pairs(work, name) if steps else np.zeros(0, dtype=PAIRS)
        if name == "minhash":
            checked = [read_json(work, f) for f in work.list_files("minhash/verified") if f.endswith(".json")]
            grid = np.round(np.arange(0.5, 1.0001, 0.05), 2)
            extra = {"ngram": m.ngram, "threshold": m.threshold, "num_perm": m.num_perm, "bands": bands,
                     "rows_per_band": rows, "candidate_pairs": sum(c["candidates"] for c in checked),
                     "verified_pairs": sum(c["verified"] for c in checked),
                     "p_candidate_at_threshold": round(float(s_curve(m.threshold, bands, rows)), 4),
                     "s_curve": {f"{g:.2f}": round(float(p), 4) for g, p in zip(grid, s_curve(grid, bands, rows))}}
            edges = read_array(work, "minhash/clusters_edges.bin", [("kept", "<u8"), ("min_edge", "<f8")]) \
                if steps else np.zeros(0, dtype=[("kept", "<u8"), ("min_edge", "<f8")])
            min_edge = dict(zip(edges["kept"].tolist(), edges["min_edge"].tolist()))
        else:
            min_edge = None
        line_parts.append(_lines(store, name, pairs, min_edge, normalise, d.minhash.ngram))
        clusters = len(np.unique(pairs["kept"]))
        stats["stages"][name] = {"in": alive, "out": alive - len(pairs), "clusters": clusters,
                                 "largest_clusters": _largest_at(store, pairs) if len(pairs) else [],
                                 "seconds": round(time.perf_counter() - t0, 3), **extra}
        removed = np.union1d(removed, pairs["removed"])
        done.append(name)

    keep = np.setdiff1d(np.arange(n, dtype=np.uint64), removed)
    start.writing()
    if "semantic" in order:
        t0 = time.perf_counter()
        rows = store.rows(keep.astype(np.int64))
        ids, texts = [r["id"] for r in rows], [r["text"] for r in rows]
        clusters, sim_to_kept, extra = _semantic(cfg, texts, thresholds, out)
        line_parts.append(_cluster_lines("semantic", clusters, ids, sim_to_kept))
        alive_local = survivors(len(keep), clusters)
        stats["stages"]["semantic"] = {"in": len(keep), "out": len(alive_local), "clusters": len(clusters),
                                       "largest_clusters": _largest(clusters, ids, texts),
                                       "seconds": round(time.perf_counter() - t0, 3), **extra}
        keep = keep[alive_local]
        del rows, ids, texts
    else:
        (out / "nn_similarity.png").unlink(missing_ok=True)
    write_jsonl(out / "clusters.jsonl", chain.from_iterable(line_parts))
    write_jsonl(out / "kept.jsonl", _kept_rows(store, keep))
    stats.update(texts_in=n, texts_out=len(keep), thresholds=thresholds)
    return start.finish(stats)


def read_json(work, path: str) -> dict:
    with work.open(path, "rt") as fh:
        return json.load(fh)


def _kept_rows(store: TextStore, keep: np.ndarray) -> Iterator[dict]:
    """The rows at the kept positions in order, read range by range and parsed by json as the native engine
    parses them (so kept.jsonl is written from the very same values)."""
    starts = store.manifest["starts"]
    for lo, hi in pairwise(starts):
        a, b = np.searchsorted(keep, lo), np.searchsorted(keep, hi)
        if a == b:
            continue
        wanted = set(keep[a:b].tolist())
        for pos, line in store.range_lines(lo, hi):
            if pos in wanted:
                yield json.loads(line.decode("utf-8"))


