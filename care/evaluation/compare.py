"""Compare evaluation runs across seeds: `python -m care.evaluation.compare RUN [RUN ...] [--a A --b B ...]`.

Each RUN is an evaluate.py output folder (summary.json and the per-task JSON).  Every model row is put in
a group: a trained model by its recipe, the training config its folder records (care_training.json)
without the seed and the run settings (care.config.recipe; wandb groups training runs by the same key), so
the seeds of one recipe form one group; a model with no training record (a baseline) is its own group,
unless its row name ends in `-s<seed>` (SEED_NAME: how `make care-claim` names the links of a tower folder that
carries no record, `care_claim/h-stage1tower-s42`, `-s1`, ...): such rows of one stem are one group, its seeds.
The table shows, per group and table cell, the mean and standard deviation over its runs (seeds).  Each
pair of groups (`--a`, `--b`: a group's number in the table, a word of its label or one of its models' names;
repeat both for more rows, paired in order, so one table holds an ablation's every gain; default the first two
trained groups)
gets a gain row with a paired-bootstrap 95% interval per cell (care/evaluation/significance.py) over
the pooled per-query values: each query's value averaged over the group's seeds, so the interval is the
evaluation set's noise left after averaging the seeds; the spread between seeds is the sd column.
Writes compare.md, compare.json and compare.png to --out (default <--out-root>/compare/<time>, the outputs
root the apps take as out_root=).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from care.config import SEED_NAME, recipe, recipe_group
from care.data.io import DataError, atomic_open, read_json, save_figure, write_json
from care.data.numbers import fmt_gain, fmt_interval
from care.encoders.registry import TRAINING_RECORD
from care.errors import app_errors
from care.evaluation.run_folder import folder_of
from care.evaluation.significance import cell_items, gain_interval
from care.paths import outputs_dir, relative_name

NAMED_BY_MODEL_NAME = ("model.path", "model.label", "model.build_hint")


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, default=str)
    return out


def _training_config(row: dict, run: str | Path = ".") -> tuple[dict | None, str | None]:
    """The training config a model row's folder records (None for a row without a record), with
    `training_data`: the training file it read (its path as the record names it), since where the data lives
    is a run setting that recipe() leaves out while which data it is changes the weights (an ablation over
    mined files differs only there); and that file's digest, which groups runs by the data's content."""
    path = row.get("model_path")  # relative to the run's folder (summary.json written before: absolute)
    record = Path(run) / path / TRAINING_RECORD if path else None
    if record is None or not record.is_file():
        return None, None
    saved = read_json(record)
    config = saved.get("config")
    files = (saved.get("lineage") or {}).get("training_files") or {}
    if isinstance(config, dict) and files.get("examples"):
        config = {**config, "training_data": files["examples"]}
    if config is not None and row.get("truncate_dim"):  # scored on a prefix: not the same cell values
        config = {**config, "scored_at_dim": row["truncate_dim"]}
    return config, files.get("examples_digest")


def load_rows(runs: Sequence[str | Path]) -> list[dict]:
    """Every model row of every run: {run, name, label, scores, config (or None), seed, group, columns}."""
    rows = []
    for run in runs:
        summary = Path(run) / "summary.json"
        if not summary.is_file():
            raise FileNotFoundError(f"{run} is not an evaluation run folder (no summary.json)")
        s = read_json(summary)
        try:
            for m in s["models"]:
                config, digest = _training_config(m, run)
                seed, label = (config or {}).get("seed"), m["label"]
                if config:  # its recipe, and the training data by content when the record names its digest
                    group = recipe_group({**config, "training_data": digest} if digest else config)
                elif named := SEED_NAME.match(m["name"]):  # record-less seeds of one row: one group by the stem
                    group, seed, label = f"model:{named['stem']}", int(named["seed"]), named["stem"]
                else:
                    group = f"model:{m['name']}"
                rows.append({"run": str(run), "name": m["name"], "folder": folder_of(m), "label": label,
                             "scores": m["scores"], "config": config, "seed": seed, "group": group,
                             "columns": s["columns"]})
        except (KeyError, TypeError, AttributeError) as e:
            raise DataError(summary, None, str(e).strip("'") if isinstance(e, KeyError) else None,
                            f"not an evaluate.py summary ({type(e).__name__}: {e})") from None
    if not rows:
        raise ValueError("no model rows in the given runs")
    return rows


def groups(rows: list[dict]) -> list[dict]:
    """Rows grouped by recipe, labelled by what tells the recipes apart (the config keys whose values
    differ between the groups) or, for a baseline, by its name."""
    by_key: dict[str, list[dict]] = {}
    for r in rows:
        by_key.setdefault(r["group"], []).append(r)
    trained = {k: _flat(recipe(v[0]["config"])) for k, v in by_key.items() if v[0]["config"] is not None}
    keys = sorted({k for f in trained.values() for k in f})
    differing = [k for k in keys if len({f.get(k) for f in trained.values()}) > 1]
    if "model.name" in differing:  # the model's name says which model: its folder, label and build hint follow
        differing = [k for k in differing if k not in NAMED_BY_MODEL_NAME]
    out = []
    for key, members in by_key.items():
        if key in trained:
            label = ", ".join(f"{k}={json.loads(trained[key][k]) if k in trained[key] else '-'}"
                              for k in differing) or members[0]["config"].get("run_name", key)
        else:
            label = members[0]["label"]
        out.append({"key": key, "label": label, "trained": key in trained, "rows": members,
                    "seeds": sorted({str(r["seed"]) for r in members if r["seed"] is not None})})
    return out


def _cell_values(group: dict, column: str) -> list[float]:
    return [r["scores"][column] for r in group["rows"] if column in r["scores"]]


def pooled_items(group: dict, column: str) -> dict | None:
    """The group's per-item record of one cell, each item averaged over its runs (seeds)."""
    bench, task, *metric = column.split("/")
    records = []
    for r in group["rows"]:
        path = Path(r["run"]) / r["folder"] / bench / f"{task}.json"
        if task == "avg" or not path.is_file():
            return None
        record = read_json(path)
        records.append(cell_items(record.get("items"), metric[0] if metric else record["primary"]))
    if not records or any(x is None for x in records):
        return None
    if "predicted" in records[0]:
        return {"predicted": np.mean([x["predicted"] for x in records], axis=0).tolist(), "gold": records[0]["gold"]}
    queries = set.intersection(*(set(x["per_query"]) for x in records))
    return {"per_query": {q: float(np.mean([x["per_query"][q] for x in records])) for q in sorted(queries)}}


def _pick(found: list[dict], which: str) -> dict:
    """A group by its row number in the table, a unique word of its label, or the name of one of its models
    (evaluate.py's row name: a checkpoint's folder name, which a recipe label does not show)."""
    if which.isdigit():
        return found[int(which) - 1]
    # a model's exact name first: a baseline's name (me5_small) is also a word of the labels of recipes that
    # differ in model.name, and would otherwise match them too
    named = [g for g in found if any(r["name"] == which for r in g["rows"])]
    if len(named) == 1:
        return named[0]
    match = [g for g in found if which in g["label"] or any(r["name"] == which for r in g["rows"])]
    if len(match) != 1:
        raise ValueError(f"--a/--b {which!r} matches {len(match)} groups: {[g['label'] for g in found]}")
    return match[0]


def compare(runs: Sequence[str | Path], gains: Sequence[tuple[str, str]] | None = None, seed: int = 0) -> dict:
    """The table of `runs` grouped by recipe, and one gain row per (a, b) pair of `gains` (by default the
    second trained group over the first, when there are two)."""
    rows = load_rows(runs)
    found = groups(rows)
    columns = list(dict.fromkeys(c["key"] for r in rows for c in r["columns"]))
    titles = {c["key"]: c["title"] for r in rows for c in r["columns"]}
    table = []
    for g in found:
        cells = {}
        for c in columns:
            v = _cell_values(g, c)
            if v:
                cells[c] = {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)) if len(v) > 1 else None,
                            "n": len(v)}
        table.append({"label": g["label"], "key": g["key"], "seeds": g["seeds"], "runs": len(g["rows"]),
                      "cells": cells})
    # run folders as the project names paths in a written file (outputs/eval/<run>): the JSON is committed
    result = {"runs": [relative_name(r) for r in runs], "columns": columns, "titles": titles, "groups": table, "gains": []}
    trained = [g for g in found if g["trained"]]
    # Chosen among all the table's groups (a baseline too); by default the first two trained ones.
    pairs = [(_pick(found, a), _pick(found, b)) for a, b in gains] if gains else \
        [(trained[1], trained[0])] if len(trained) >= 2 else []
    for ga, gb in pairs:
        result["gains"].append({"of": ga["label"], "over": gb["label"], "intervals": {
            c: gain_interval(pooled_items(ga, c), pooled_items(gb, c), seed=seed) for c in columns}})
    return result


def markdown(result: dict) -> str:
    cols = result["columns"]
    head = ["Group", "runs (seeds)"] + [result["titles"].get(c, c) for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * len(cols)) + "|"]
    for g in result["groups"]:
        cells = []
        for c in cols:
            x = g["cells"].get(c)
            cells.append("" if x is None else f"{x['mean']:.2f}" + (f" ± {x['sd']:.2f}" if x["sd"] is not None else ""))
        seeds = f"{g['runs']} ({', '.join(g['seeds'])})" if g["seeds"] else str(g["runs"])
        lines.append("| " + " | ".join([g["label"], seeds, *cells]) + " |")
    for gain in result["gains"]:
        cells = []
        for c in cols:
            i = gain["intervals"].get(c)
            cells.append("" if not i else f"{fmt_gain(i['difference'])} {fmt_interval(i)}")
        lines.append("| " + " | ".join([f"gain of {gain['of']} over {gain['over']}", "pooled", *cells]) + " |")
    if result["gains"]:
        lines += ["", ("Mean ± sd over each group's runs (seeds). Gain: paired bootstrap over the queries (STS: "
                       "pairs) of each query's value averaged over the group's seeds, 95%; * = excludes 0.")]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = result["columns"]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cols)), 4.5))
    width = 0.8 / max(1, len(result["groups"]))
    x = np.arange(len(cols))
    for i, g in enumerate(result["groups"]):
        means = [g["cells"].get(c, {}).get("mean", 0.0) for c in cols]
        sds = [g["cells"].get(c, {}).get("sd") or 0.0 for c in cols]
        ax.bar(x + (i - (len(result["groups"]) - 1) / 2) * width, means, width, yerr=sds, capsize=2, label=g["label"])
    ax.set_xticks(x, [result["titles"].get(c, c) for c in cols], rotation=20, ha="right")
    ax.set_ylabel("score (0-100), mean ± sd over seeds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="evaluate.py output folders")
    ap.add_argument("--a", action="append", default=[],
                    help="a group whose gain is shown (number in the table, a word of its label or a model's "
                         "name); repeatable")
    ap.add_argument("--b", action="append", default=[], help="its reference group, one per --a, paired in order")
    ap.add_argument("--out", help="where compare.md / .json / .png go (default <out root>/compare/<time>)")
    ap.add_argument("--out-root", default=str(outputs_dir()),
                    help="the outputs root, as the apps' out_root= (default CARE_OUTPUTS, else <project>/outputs)")
    args = ap.parse_args(argv)
    if len(args.a) != len(args.b):
        ap.error(f"--a given {len(args.a)} times and --b {len(args.b)}: each gain row needs both")
    out = Path(args.out) if args.out else Path(args.out_root) / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    with app_errors("python -m care.evaluation.compare", writes_to=out, resumes=False):
        result = compare(args.runs, list(zip(args.a, args.b)))
        text = markdown(result)
        write_json(out / "compare.json", result)
        with atomic_open(out / "compare.md") as fh:
            fh.write(text)
        plot(result, out / "compare.png")
        print(text + f"\nwritten to {out}")


if __name__ == "__main__":
    main()
