"""Evaluate models on a benchmark: per-task scores, the benchmark Avg, efficiency, a table and a plot.

    python evaluate.py                          multilingual-e5-small on the open CMedTEB stand-in (+ cMedQA2)
    python evaluate.py model=tiny_m3            any conf/model/*.yaml
    python evaluate.py ckpt=outputs/train/run   a checkpoint folder, or a folder of several (side by side)
    python evaluate.py benchmark=cmedteb benchmark.tasks.cmed_v1.path=...   your own CMedTEB / C-MTEB copy
    python evaluate.py baselines=[]             no baseline rows (default: BM25 and zero-shot me5-small)

Every model runs through the same task runners (care.evaluation.tasks) via the Encoder interface, with
embeddings cached on disk (a re-run encodes nothing).  Outputs go to `out_dir` (outputs/eval/<run>/):
<model>/<benchmark>/<task>.json, summary.json, summary.md (printed) and slots.png; every path in the JSON
files is relative to out_dir.  A second run into an out_dir that holds a summary.json adds its rows to it (a
row of the same name and model folder is replaced) and says so; one scored on other benchmarks or settings, or
a row that would take the name of another model's row, is refused before any scoring
(care.evaluation.run_folder; overwrite=true replaces it).  With ckpt=, every scored model folder
this project trained (one holding care_training.json) gets the generated part of its README.md model card
rewritten with its row: the table, the gain intervals, the efficiency columns and the model-index
(care.export.card; the user's own text around it is kept).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.allocator import keep_freed_memory
from care.config import CONF_DIR
from care.data.io import write_json
from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache
from care.encoders.registry import TRAINING_RECORD
from care.errors import app_errors
from care.evaluation import corpora, efficiency, rerank, run_folder
from care.evaluation.benchmarks import averages, run_task
from care.evaluation.corpora import evaluation_model
from care.evaluation.entries import check_model_folders, model_entries, model_folders
from care.evaluation.report import benchmarks_json, columns, gains, plot_steps, write_summary
from care.evaluation.significance import cell_items, gain_interval
from care.export.card import refresh_card
from care.families import family_of, hook
from care.retrieval.bm25 import BM25Scorer
from care.retrieval.scorer import EncoderScorer
from care.runlock import locked_out_dir
from data_pipeline import benchmarks as builders


def build_scorer(entry: dict, cfg: dict, cache: EmbeddingCache):
    if entry.get("bm25"):
        return BM25Scorer(**cfg["bm25"], name=entry["name"], label=entry["label"])
    if (own := hook(family_of(entry["model"]), "scorer")) is not None:  # a family scored otherwise (a reranker)
        return own(entry, cfg, cache)
    encoder = build_encoder(evaluation_model(entry["model"], cfg.get("max_length")), device=cfg.get("device"),
                            backend=cfg.get("backend", "auto"))
    return EncoderScorer(encoder, cache, batch_size=cfg["batch_size"], heads=cfg.get("heads"),
                         hybrid_weights=cfg["hybrid_weights"], rerank_depth=cfg["rerank_depth"], label=entry["label"])


# ---- the run ---------------------------------------------------------------------------------------------

def load_benchmarks(cfg: dict) -> list[tuple]:
    """[(benchmark, [(task spec, task data)])]; stand-in files are built first when missing or stale."""
    return corpora.load_benchmarks(cfg, build=builders.build)


def evaluate_model(entry: dict, scorer, loaded: list[tuple], cfg: dict, out: Path) -> dict:
    """Scores of one model on every task; `items` (per-query values, STS predictions) for each table cell."""
    scores, details, by_cell = {}, {}, {}
    for bench, tasks in loaded:
        primary = {}
        for spec, data in tasks:
            if spec.type not in getattr(scorer, "tasks", (spec.type,)):
                continue  # a task the scorer does not apply to (a reranker's STS): the cell reads n/a
            start = time.perf_counter()
            items = {}
            try:
                per_method = run_task(spec, data, scorer, depth=cfg["depth"], seed=cfg["seed"], items=items)
            except FloatingPointError as e:
                raise FloatingPointError(f"task {bench.name}/{spec.key} ({spec.path}), model {entry['name']}: {e}") from None
            method = cfg["table_method"] if cfg["table_method"] in per_method else scorer.methods[0]
            primary[spec.key] = per_method[method][spec.primary]
            record = {
                "benchmark": bench.name, "task": spec.key, "slot": spec.slot, "type": spec.type,
                "open_stand_in": bench.open_stand_in, "source": spec.source,
                "path": run_folder.relative(spec.path, out), "split": spec.split,
                "model": entry["label"], "fingerprint": scorer.fingerprint, "table_method": method,
                "primary": spec.primary, "value": 100 * primary[spec.key], "scores": per_method,
                "counts": {k: v for k, v in data.counts.items() if k != "read"}, "reader": data.counts.get("read"),
                "seconds": round(time.perf_counter() - start, 2), "items": items.get(method)}
            write_json(out / entry["folder"] / bench.name / f"{spec.key}.json", record)
            details[f"{bench.name}/{spec.key}"] = per_method
            if spec.slot:
                scores[f"{bench.name}/{spec.key}"] = 100 * primary[spec.key]
                by_cell[f"{bench.name}/{spec.key}"] = cell_items(items.get(method), spec.primary)
            else:
                for m in spec.metrics:
                    scores[f"{bench.name}/{spec.key}/{m}"] = 100 * per_method[method][m]
                    by_cell[f"{bench.name}/{spec.key}/{m}"] = cell_items(items.get(method), m)
        for key, value in averages(bench, primary).items():
            scores[f"{bench.name}/{key}"] = value
    return {"name": entry["name"], "label": entry["label"], "fingerprint": scorer.fingerprint,
            "model_path": run_folder.relative(entry.get("model", {}).get("path"), out),
            "model_folders": entry.get("model_folders"), "folder": entry["folder"],
            "truncate_dim": entry.get("model", {}).get("truncate_dim"),
            "baseline": bool(entry.get("baseline")), "scores": scores, "methods": details, "items": by_cell}


TIMING_FILE = "timing.json"  # where the time went, per step and row (python -m bench timeline reads it)


def row_counts(cache: EmbeddingCache, before: tuple, seconds: dict) -> tuple[dict, dict]:
    """What one row encoded (texts per side, and texts the cache served) and where its time went: building the
    encoder, encoding each side, scoring (the tasks less their encoding), the efficiency columns.  A BM25 row
    encodes nothing: no counts."""
    encoded, encode_s, hits = before
    n = {side: cache.encoded[side] - encoded[side] for side in encoded}
    enc = {side: cache.encode_seconds[side] - encode_s[side] for side in encode_s}
    counts = {**n, "from_cache": cache.hits - hits} if any(n.values()) or cache.hits > hits else {}
    timing = {"build_s": seconds["build"], "encode_query_s": enc["query"], "encode_document_s": enc["document"],
              "score_s": seconds["tasks"] - sum(enc.values()), "efficiency_s": seconds["efficiency"]}
    return counts, {k: round(v, 2) for k, v in timing.items()}


def gain_intervals(rows: list[dict], seed: int = 0, over: str | None = None) -> None:
    """Each gain row's paired-bootstrap 95% interval per table cell (care.evaluation.significance), stored
    as row["gain"]; the per-item records are then dropped (they live in the per-task JSON files)."""
    for row, reference in gains(rows, over):
        row["gain"] = {"over": reference["name"], "intervals": {
            key: gain_interval(items, reference["items"].get(key), seed=seed) for key, items in row["items"].items()}}
    for row in rows:
        row.pop("items", None)


def efficiency_texts(loaded: list[tuple], cfg: dict) -> tuple[list[str], list[str]] | None:
    e = cfg["efficiency"]
    if not e.get("enabled", True) or not loaded:
        return None
    tasks = loaded[0][1]  # the named task, else the first retrieval task (a Nano benchmark names splits)
    chosen = next((t for t in tasks if t[0].key == e["task"]), None) or next((t for t in tasks if t[0].type == "retrieval"), None)
    if chosen is None or not chosen[1].queries:
        return None
    _, data = chosen
    return list(data.queries.values())[: e["queries"]], list(data.docs.values())[: e["docs"]]


def evaluate(cfg: DictConfig | dict) -> dict:
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    out = Path(cfg["out_dir"])
    run = out.name
    start = time.perf_counter()
    entries = model_entries(cfg)
    check_model_folders(entries, cfg)  # before the benchmarks are read (minutes): a wrong model.path fails at once
    rerank.check(entries, cfg)  # a cross-encoder row's rerank.k and rerank.retriever, likewise
    loaded = load_benchmarks(cfg)
    rerank.check(entries, cfg, loaded)  # ... and a task it scores
    steps = {"benchmarks_s": round(time.perf_counter() - start, 2)}
    benches = [b for b, _ in loaded]
    key = {"benchmarks": benchmarks_json(benches, out), "columns": columns(benches), "scoring": run_folder.scoring(cfg)}
    earlier, dropped, note = run_folder.earlier_rows(out, key, overwrite=bool(cfg.get("overwrite")))  # before scoring
    for entry in entries:  # what makes a row the same model as an earlier row of its name
        paths = model_folders(entry)
        entry["model_folders"] = None if paths is None else [run_folder.relative(p, out) for p in paths]
    run_folder.claim(out, entries, earlier)  # each row's per-task folder; another model under a row's name refused
    cache = EmbeddingCache(cfg["cache"]["dir"], enabled=cfg["cache"]["enabled"])
    timing_texts = efficiency_texts(loaded, cfg)
    rows = []
    for entry in entries:
        t0 = time.perf_counter()
        before = (dict(cache.encoded), dict(cache.encode_seconds), cache.hits)
        scorer = build_scorer(entry, cfg, cache)
        t1 = time.perf_counter()
        row = evaluate_model(entry, scorer, loaded, cfg, out)
        t2 = time.perf_counter()
        row["efficiency"] = efficiency.measure(scorer, *timing_texts) if timing_texts else {}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["encoded"], row["timing"] = row_counts(cache, before, {"build": t1 - t0, "tasks": t2 - t1,
                                                                   "efficiency": time.perf_counter() - t2})
        rows.append(row)
        del scorer
        gc.collect()
    kept, kept_notes = run_folder.with_items(out, earlier)
    merged, merged_note = run_folder.merge(kept, rows)
    t0 = time.perf_counter()
    gain_intervals(merged, seed=cfg["seed"], over=cfg.get("gain_over"))
    steps["gain_intervals_s"] = round(time.perf_counter() - t0, 2)
    settings = {"gain_over": cfg.get("gain_over"), "max_length": cfg.get("max_length"), "batch_size": cfg["batch_size"], "depth": cfg["depth"],
                "table_method": cfg["table_method"], "cache": cfg["cache"]["enabled"],
                "embeddings_encoded": cache.misses, "embeddings_from_cache": cache.hits,
                "seconds": round(time.perf_counter() - start, 1),
                # timings mean little on a busy machine: the 1-minute load average says how busy it was
                "load_average_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
    t0 = time.perf_counter()
    table = write_summary(out, run, benches, merged, settings, key["scoring"])
    run_folder.drop_folders(out, dropped, rows)
    cards = refresh_cards(entries, rows, out / "summary.json") if cfg.get("ckpt") else []
    if cfg.get("ckpt") and (curve := plot_steps(out / "steps.png", [b for b, _ in loaded], rows,
                                                Path(cfg["ckpt"]).expanduser() / "metrics.jsonl")):
        print(f"scores against the training step: {curve}")
    steps["report_s"] = round(time.perf_counter() - t0, 2)
    write_json(out / TIMING_FILE, {"run": run, **steps, "seconds": round(time.perf_counter() - start, 1),
                                   "rows": {r["name"]: {"encoded": r["encoded"], **r["timing"]} for r in rows}})
    print(table)
    for r in rows:
        if r["encoded"]:
            n = r["encoded"]
            print(f"{r['name']}: encoded {n['query']} query and {n['document']} document texts, "
                  f"{n['from_cache']} from the cache")
    for line in (note, merged_note, *kept_notes):
        if line:
            print(line)
    print(f"written to {out}")
    for card in cards:
        print(f"model card: {card}")
    return {"out_dir": str(out), "rows": rows, "settings": settings, "table": table, "cards": [str(c) for c in cards]}


def refresh_cards(entries: list[dict], rows: list[dict], summary_path: Path) -> list[Path]:
    """README.md (care.export.card) of every scored checkpoint folder that this project trained (one holding
    care_training.json), with its row of summary.json as stored; a baseline's folder is never written.
    A card that cannot be written is reported, and does not fail the evaluation."""
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    written = []
    for entry, row in zip(entries, rows):
        path = (entry.get("model") or {}).get("path")
        if entry.get("baseline") or not path or not (Path(path) / TRAINING_RECORD).is_file():
            continue
        if entry.get("untrained_head"):  # rerank.allow_untrained_head=true: not the folder's own scores
            print(f"model card of {row['name']} left as it was: scored with an untrained head", file=sys.stderr)
            continue
        try:
            card = refresh_card(path, summary, row["name"])
        except Exception as e:  # noqa: BLE001 (the scores are written; a card problem must not lose them)
            print(f"warning: model card of {row['name']} not written: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if card is not None:
            written.append(card)
    return written


@hydra.main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    keep_freed_memory()
    with app_errors("evaluate.py", cfg, writes_to=cfg.get("out_dir")):
        locked_out_dir(evaluate)(cfg)


if __name__ == "__main__":
    main()
