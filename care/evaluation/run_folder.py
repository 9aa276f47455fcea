"""An evaluation's out_dir across runs: a second evaluate.py into a folder that already holds a summary.json
adds its rows to that summary instead of replacing it, so no row is dropped without a word.

    slug(name) -> str                        a row name as a folder name (letters, digits, _ . -)
    folder_of(row) -> str                    the folder of a row's per-task JSON (<out>/<folder>/<bench>/<task>.json):
                                             the row's `folder`, or slug(name) for a row written before rows
                                             named it
    relative(path, out) -> str | None        a path as summary.json and the per-task JSON store it: relative to
                                             the evaluation folder, so the folder names no machine
    earlier_rows(out, key, overwrite)        the rows of the summary.json already in `out` that the new run keeps;
                                             refused in one line when that summary was scored on other
                                             benchmarks or settings (its rows and the new ones would not compare)
    claim(out, entries, earlier)             before any scoring: each new row's per-task folder, unique in `out`;
                                             refused in one line when a new row would take the name of an
                                             earlier row of another model folder, or two new rows share a name
    merge(earlier, rows) -> (rows, line)     the new rows over the earlier ones: a row of the same name is
                                             replaced in place, the others are added after them
    with_items(out, rows, columns)           the kept rows with their per-item records read back from their
                                             per-task JSON, so the merged table's gain intervals cover every
                                             row; a line for each row whose files are gone or another model's

Rows of one summary must be comparable: the same benchmarks (tasks, files, primary metrics), the same
columns and the same scoring settings (`scoring` in summary.json: token limit, depth, heads, the table's
method, the Acc@N seed, BM25's settings).  overwrite=true starts the summary afresh: the earlier rows are
dropped, and their per-task folders removed, with a line saying so.

A row is one model: a new row replaces the earlier row of its name only when it scores the same model
folder(s) (`model_folders`, relative to out_dir), or a folder of the same weights -- the same model
re-evaluated.  Two row names that make one
folder name ("run/final" and "run_final") get two folders (the second one's name ends in a digest of its
row name), so no row reads another's per-task files.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from care.evaluation.significance import cell_items

SCORING = ("max_length", "depth", "rerank_depth", "hybrid_weights", "heads", "table_method", "seed", "bm25")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "model"


def folder_of(row: dict) -> str:
    """The folder (under out_dir) of a row's per-task JSON; a row written before rows named it: slug(name)."""
    return row.get("folder") or slug(row["name"])


def task_file(out: Path, row: dict, bench: str, task: str) -> Path:
    return Path(out) / folder_of(row) / bench / f"{task}.json"


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


def earlier_rows(out: Path, key: dict, overwrite: bool = False) -> tuple[list[dict], list[dict], str]:
    """(rows kept from out/summary.json, the rows dropped, a line to print or '').  `key`: the new
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
        return [], rows, (f"overwrite=true: {path} replaced; the {len(rows)} row(s) of the earlier run "
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


def row_folders(row: dict) -> list[str] | None:
    """The model folder(s) an earlier row scored, relative to out_dir (a row written before rows named them:
    its model_path); None when unknown (BM25, or a two-tower row written before)."""
    if row.get("model_folders") is not None:
        return list(row["model_folders"])
    return [row["model_path"]] if row.get("model_path") else None


def _absolute(paths: list[str], out: Path) -> list[str]:
    """A row's model folders, stored relative to `out` (or absolute, as older summaries stored them)."""
    return [os.path.normpath(Path(out).resolve() / p) for p in paths]


def _same_model(before: list[str], now: list[str]) -> bool:
    """The same folders, or folders holding the same weights (a model copied, or a cache root moved: the
    weights digest, memoised, is read only for a row name that two folders share)."""
    if before == now:
        return True
    if not all(Path(p).is_dir() for p in before + now):
        return False
    from care.encoders import weights_digest

    try:
        return [weights_digest(p) for p in before] == [weights_digest(p) for p in now]
    except (OSError, ValueError):  # a folder that cannot be read: not known to be the same model
        return False


def claim(out: Path, entries: list[dict], earlier: list[dict]) -> None:
    """Before any scoring: each new row's per-task folder (entry["folder"]), and the refusals.

    A new row named as an earlier one replaces it only when both score the same model folder(s)
    (entry["model_folders"], relative to `out`), or folders of the same weights: the same model re-evaluated.  Another model under that name
    is refused in one line (it would replace the other's scores), as are two new rows of one name.  A row
    that replaces one keeps its folder; a new row's folder is slug(name), or, when another row holds that
    folder ("run/final" and "run_final"), slug(name) and a digest of the name."""
    summary = Path(out) / "summary.json"
    by_name = {r["name"]: r for r in earlier}
    seen: dict[str, dict] = {}
    for e in entries:
        if e["name"] in seen:
            raise ValueError(f"two rows named {e['name']!r} ({', '.join(seen[e['name']].get('model_folders') or ['-'])} "
                             f"and {', '.join(e.get('model_folders') or ['-'])}): name the model under test another way "
                             f"(model.name=NAME), or leave {e['name']} out of baselines=")
        seen[e["name"]] = e
        old = by_name.get(e["name"])
        if old is None:
            continue
        before, now = row_folders(old), e.get("model_folders")
        if before is not None and now is not None and not _same_model(_absolute(before, out), _absolute(now, out)):
            raise ValueError(
                f"{summary} has a row {e['name']!r} of another model ({', '.join(_absolute(before, out))}); this one "
                f"({', '.join(_absolute(now, out))}) would replace it: evaluate it into another run_name= (or "
                "out_dir=), name it otherwise (model.name=NAME for a model= row), or pass overwrite=true to replace "
                "the folder's rows")
    taken = {folder_of(r) for r in earlier if r["name"] not in seen}
    for e in entries:
        folder = folder_of(by_name[e["name"]]) if e["name"] in by_name else slug(e["name"])
        n = 0
        while folder in taken:  # another row's folder: this row's name, made unique by a digest of it
            n += 1
            digest = hashlib.sha256(f"{e['name']}#{n}".encode()).hexdigest()[:8]
            folder = f"{slug(e['name'])}-{digest}"
        taken.add(folder)
        e["folder"] = folder


def with_items(out: Path, rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The kept rows, each with its `items` (per table cell) read back from its per-task JSON files, and a
    line for each row that loses some: its files gone (a folder deleted by hand), or a file holding another
    model's scores (a fingerprint that is not the row's: two rows that shared a folder before rows named
    their folders).  Such a cell gets no gain interval."""
    kept, lines = [], []
    for row in rows:
        items, gone, foreign = {}, [], []
        for task in row.get("methods") or {}:  # the tasks the row scored: one file each
            bench, name = task.split("/", 1)
            path = task_file(out, row, bench, name)
            if not path.is_file():
                gone.append(path)
                continue
            record = json.loads(path.read_text(encoding="utf-8"))
            if record.get("fingerprint") not in (None, row.get("fingerprint")):
                foreign.append((path, record.get("fingerprint")))
                continue
            for key in row["scores"]:
                b, t, *metric = key.split("/")
                if (b, t) == (bench, name):
                    items[key] = cell_items(record.get("items"), metric[0] if metric else record.get("primary"))
        if gone:
            lines.append(f"row {row['name']}: {len(gone)} of its per-task files are gone (e.g. {gone[0]}): "
                         "no gain interval for those cells (evaluate the model again into this folder to restore them)")
        for path, fp in foreign[:1]:
            lines.append(f"row {row['name']}: {path} holds another model's scores (fingerprint {fp}, the row's "
                         f"{row.get('fingerprint')}): no gain interval for {len(foreign)} task(s) of it")
        kept.append({**row, "items": items})
    return kept, lines


def drop_folders(out: Path, dropped: list[dict], rows: list[dict]) -> None:
    """overwrite=true: the per-task folders of earlier rows that no new row writes to."""
    for name in {folder_of(r) for r in dropped} - {folder_of(r) for r in rows}:
        folder = Path(out) / name
        if folder.is_dir() and folder.parent == Path(out):
            shutil.rmtree(folder)
