"""An evaluation's out_dir across runs: a second evaluate.py into a folder that already holds a summary.json
adds its rows to that summary instead of replacing it, so no row is dropped without a word.

    slug(name) -> str                        the folder of a model's per-task JSON (<out>/<slug>/<bench>/<task>.json)
    relative(path, out) -> str | None        a path as summary.json and the per-task JSON store it: relative to
                                             the evaluation folder, so the folder names no machine
    earlier_rows(out, key, overwrite)        the rows of the summary.json already in `out` that the new run keeps;
                                             refused in one line when that summary was scored on other
                                             benchmarks or settings (its rows and the new ones would not compare)
    merge(earlier, rows) -> (rows, line)     the new rows over the earlier ones: a row of the same name is
                                             replaced in place, the others are added after them
    with_items(out, row)                     a kept row with its per-item records read back from its per-task
                                             JSON, so the merged table's gain intervals cover every row

Rows of one summary must be comparable: the same benchmarks (tasks, files, primary metrics), the same
columns and the same scoring settings (`scoring` in summary.json: token limit, depth, heads, the table's
method, the Acc@N seed, BM25's settings).  overwrite=true starts the summary afresh: the earlier rows are
dropped, and their per-task folders removed, with a line saying so.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from care.evaluation.significance import cell_items

SCORING = ("max_length", "depth", "rerank_depth", "hybrid_weights", "heads", "table_method", "seed", "bm25")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "model"


def relative(path, out: Path) -> str | None:
    """`path` relative to the evaluation folder `out` (e.g. ../../train/run/final); None stays None."""
    if path is None:
        return None
    return os.path.relpath(Path(path).expanduser().resolve(), Path(out).resolve())


def scoring(cfg: dict) -> dict:
    """The settings a row's scores depend on (beyond the benchmarks and the model itself)."""
    return {k: cfg.get(k) for k in SCORING}


def _comparable(summary: dict, out: Path) -> dict:
    """summary.json's benchmarks, columns and scoring, with task paths resolved against `out` (older summaries
    stored them absolute)."""
    benches = json.loads(json.dumps(summary.get("benchmarks") or []))
    for b in benches:
        for task in (b.get("tasks") or {}).values():
            if task.get("path"):
                task["path"] = os.path.normpath(Path(out).resolve() / task["path"])
    return {"benchmarks": benches, "columns": summary.get("columns"), "scoring": summary.get("scoring")}


def earlier_rows(out: Path, key: dict, overwrite: bool = False) -> tuple[list[dict], list[str], str]:
    """(rows kept from out/summary.json, the names of rows dropped, a line to print or '').  `key`: the new
    run's {"benchmarks", "columns", "scoring"} as summary.json will store them.  With overwrite the earlier
    rows are dropped (their per-task folders are removed by `drop_folders` once the new run has scored)."""
    path = Path(out) / "summary.json"
    if not path.is_file():
        return [], [], ""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        rows = list(summary["models"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an evaluate.py summary ({type(e).__name__}: {e}); pass another run_name= "
                         "(or out_dir=), or overwrite=true to replace it") from None
    if overwrite:
        return [], [r["name"] for r in rows], (f"overwrite=true: {path} replaced; the {len(rows)} row(s) of the earlier run "
                    f"({', '.join(r['name'] for r in rows)}) dropped")
    old, new = _comparable(summary, out), _comparable(key, out)
    differ = [part for part in ("benchmarks", "columns", "scoring")
              if old[part] is not None and old[part] != new[part]]
    if differ:
        raise ValueError(f"{out} holds an evaluation scored with other {' and '.join(differ)} (its summary.json "
                         f"rows would not compare with this run's): pass another run_name= (or out_dir=), or "
                         f"overwrite=true to replace its rows")
    return rows, [], ""


def merge(earlier: list[dict], rows: list[dict]) -> tuple[list[dict], str]:
    """The merged rows and a line saying what happened to the earlier ones ('' when there were none)."""
    if not earlier:
        return list(rows), ""
    new = {r["name"]: r for r in rows}
    merged = [new.get(r["name"], r) for r in earlier]
    merged += [r for r in rows if r["name"] not in {e["name"] for e in earlier}]
    kept = [r["name"] for r in earlier if r["name"] not in new]
    replaced = [r["name"] for r in earlier if r["name"] in new]
    added = [r["name"] for r in rows if r["name"] not in {e["name"] for e in earlier}]
    parts = [f"{len(kept)} kept ({', '.join(kept)})" if kept else "", f"{len(replaced)} replaced "
             f"({', '.join(replaced)})" if replaced else "", f"{len(added)} added ({', '.join(added)})" if added else ""]
    return merged, f"summary.json: rows of the earlier run in this folder: {'; '.join(p for p in parts if p)}"


def with_items(out: Path, row: dict, columns: list[dict]) -> dict:
    """A kept row with its `items` (per table cell) read back from its per-task JSON files."""
    items = {}
    for col in columns:
        bench, task, *metric = col["key"].split("/")
        path = Path(out) / slug(row["name"]) / bench / f"{task}.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        items[col["key"]] = cell_items(record.get("items"), metric[0] if metric else record.get("primary"))
    return {**row, "items": items}


def drop_folders(out: Path, names: list[str], keep: list[str]) -> None:
    """overwrite=true: the per-task folders of earlier rows the new run did not score again."""
    for name in set(names) - set(keep):
        folder = Path(out) / slug(name)
        if folder.is_dir() and folder.parent == Path(out):
            shutil.rmtree(folder)
