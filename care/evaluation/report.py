"""Reports of an evaluation run: one JSON per (model, task), summary.json, a Markdown table (rows = models,
columns = benchmark slots, Avg, the other tasks' metrics, efficiency) and a PNG comparing models per slot.
Every table of an open stand-in benchmark says so above it and names each slot's source below it."""
from __future__ import annotations

import re
from pathlib import Path

from care.data.io import atomic_open, read_jsonl, save_figure, validation_metric, write_json
from care.data.numbers import EFFICIENCY_TITLES, efficiency_cells, fmt_number, gain_rows
from care.evaluation.benchmarks import Benchmark, average_groups
from care.evaluation.run_folder import relative

METRIC_LABELS = {"ndcg_cut": "nDCG@{}", "map_cut": "MAP@{}", "map_min_r": "MAP(min R)@{}", "mrr": "MRR@{}",
                 "success": "Hit@{}", "recall": "Recall@{}", "acc": "Acc@{}"}


def metric_label(name: str) -> str:
    if name in ("pearson", "spearman"):
        return name.capitalize()
    match = re.match(r"^(.*)_(\d+)$", name)
    if match and match.group(1) in METRIC_LABELS:
        return METRIC_LABELS[match.group(1)].format(match.group(2))
    return name


def columns(benchmarks: list[Benchmark]) -> list[dict]:
    """Table columns in order: {"key" (the row field), "title", "benchmark"}."""
    cols = []
    for b in benchmarks:
        groups = average_groups(b)
        grouped = {k for _, keys in groups.values() for k in keys}
        slot = {t.key: t for t in b.tasks if t.slot}
        for key, (title, keys) in [*groups.items(), (None, (None, [k for k in slot if k not in grouped]))]:
            cols += [{"key": f"{b.name}/{k}", "title": f"{slot[k].slot} {metric_label(slot[k].primary)}",
                      "benchmark": b.name, "slot": True} for k in keys]
            if key is not None:  # each mean right after its slots
                cols.append({"key": f"{b.name}/{key}", "title": title, "benchmark": b.name, "slot": True})
        for t in b.tasks:
            if not t.slot:
                cols += [{"key": f"{b.name}/{t.key}/{m}", "title": f"{t.key} {metric_label(m)}", "benchmark": b.name,
                          "slot": False} for m in t.metrics]
    return cols


def gains(rows: list[dict], over: str | None = None) -> list[tuple[dict, dict]]:
    """(model, reference) pairs whose difference the table shows: every model under test against the first
    encoder baseline (e.g. fine-tuned vs the zero-shot model it started from), or against the row named
    `over` (evaluate.yaml `gain_over`, e.g. bm25), every other row then included."""
    if over is not None:
        reference = next((r for r in rows if r["name"] == over), None)
        if reference is None:
            raise ValueError(f"gain_over={over}: no row of that name (rows: {', '.join(r['name'] for r in rows)})")
        return [(r, reference) for r in rows if r is not reference]
    reference = next((r for r in rows if r.get("baseline") and r["name"] != "bm25"), None)
    return [(r, reference) for r in rows if reference is not None and not r.get("baseline")]


def markdown(run: str, benchmarks: list[Benchmark], rows: list[dict], settings: dict) -> str:
    cols = columns(benchmarks)
    lines = [f"# Evaluation `{run}`", ""]
    for b in benchmarks:
        tag = "**open stand-in**, built from public data: not the real sets, not comparable with published scores"
        lines.append(f"- `{b.name}`: {b.label}" + (f" ({tag})" if b.open_stand_in else ""))
    lines.append("")
    head = ["Model"] + [c["title"] + (" (stand-in)" if _stand_in(benchmarks, c) else "") for c in cols] \
        + EFFICIENCY_TITLES
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        cells = [r["label"]] + [fmt_number(r["scores"].get(c["key"])) for c in cols]
        cells += efficiency_cells(r["efficiency"])
        lines.append("| " + " | ".join(cells) + " |")
    for r, ref in gains(rows, settings.get("gain_over")):
        lines += gain_rows(f"gain of {r['label']} over {ref['label']}", r["scores"], ref["scores"],
                           r.get("gain", {}).get("intervals"), [c["key"] for c in cols])
    undefined = [f"{r['label']}, {c['title']}: {i['undefined']}" for r in rows for c in cols
                 if (i := (r.get("gain") or {}).get("intervals", {}).get(c["key"])) and i.get("undefined")]
    if undefined:  # the reason an interval reads n/a
        lines += ["", "Intervals that read n/a: " + "; ".join(undefined) + "."]
    if any(r.get("gain") for r in rows):
        lines += ["", ("Gain intervals: paired bootstrap over the task's queries (STS: its pairs), 2,000 resamples "
                       "(care/evaluation/significance.py); * = the interval excludes 0, a difference larger than "
                       "the evaluation set's sampling noise.  A training run's seed adds noise of its own.")]
    lines += ["", ("Scores on a 0-100 scale (Pearson x 100 for STS), trec_eval conventions (MAP@10 divides by all "
                   f"relevant documents); table method: {settings.get('table_method')} (other methods in the per-task "
                   "JSON)."), ""]
    for b in benchmarks:
        lines.append(f"Sources of `{b.name}`" + (" (open stand-in)" if b.open_stand_in else "") + ":")
        for t in b.tasks:
            lines.append(f"- {t.title}: {t.source or t.path}")
        if b.note:
            lines.append(f"- note: {b.note}")
        lines.append("")
    lines += ["Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items())]
    return "\n".join(lines) + "\n"


def _stand_in(benchmarks: list[Benchmark], col: dict) -> bool:
    return any(b.name == col["benchmark"] and b.open_stand_in for b in benchmarks)


def plot(path: Path, benchmarks: list[Benchmark], rows: list[dict]) -> Path:
    """Grouped bars: one group per slot (and Avg), one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cols = [c for c in columns(benchmarks) if c["slot"]] or columns(benchmarks)
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cols)), 4.5))
    x = np.arange(len(cols))
    for i, r in enumerate(rows):
        values = [r["scores"].get(c["key"]) for c in cols]
        bars = ax.bar(x + (i - (len(rows) - 1) / 2) * width, [v if v is not None else 0 for v in values],
                      width, label=r["label"])
        ax.bar_label(bars, labels=[fmt_number(v, 1) for v in values], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(x, [c["title"] for c in cols], rotation=20, ha="right")
    ax.set_ylabel("score (0-100)")
    stand_in = [b.name for b in benchmarks if b.open_stand_in]
    ax.set_title("Models per slot" + (f" ({', '.join(stand_in)}: open stand-in)" if stand_in else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return path


def benchmarks_json(benchmarks: list[Benchmark], out: Path) -> list[dict]:
    """summary.json's `benchmarks`: each task's file named relative to the evaluation folder `out`."""
    return [{"name": b.name, "label": b.label, "open_stand_in": b.open_stand_in, "avg": b.avg,
             "tasks": {t.key: {"slot": t.slot, "type": t.type, "primary": t.primary, "source": t.source,
                               "path": relative(t.path, out)} for t in b.tasks}} for b in benchmarks]


def write_summary(out: Path, run: str, benchmarks: list[Benchmark], rows: list[dict], settings: dict,
                  scoring: dict | None = None) -> str:
    """summary.json, summary.md and slots.png in `out`; returns the Markdown table.  `scoring`: the settings
    the rows' scores depend on (care.evaluation.run_folder: what a second run into `out` must share)."""
    text = markdown(run, benchmarks, rows, settings)
    write_json(out / "summary.json", {
        "run": run, "settings": settings, "scoring": scoring, "columns": columns(benchmarks), "models": rows,
        "benchmarks": benchmarks_json(benchmarks, out)})
    with atomic_open(out / "summary.md") as fh:
        fh.write(text)
    plot(out / "slots.png", benchmarks, rows)
    return text


STEP = re.compile(r"/step-(\d+)$")


def plot_steps(path: Path, benchmarks: list[Benchmark], rows: list[dict], metrics_file: Path) -> Path | None:
    """Each slot and mean column against the training step, for rows named "<run>/step-N" (evaluate.py
    ckpt=<run> checkpoints=all), with the run's validation curve (metrics.jsonl) on a second axis; None
    when fewer than two checkpoints were scored."""
    steps = sorted((int(m.group(1)), r) for r in rows if (m := STEP.search(r["name"])))
    if len(steps) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in columns(benchmarks) if c["slot"]] or columns(benchmarks)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s for s, _ in steps]
    for c in cols:
        ax.plot(x, [r["scores"].get(c["key"]) for _, r in steps], marker="o", label=c["title"],
                linewidth=2.5 if c["key"].endswith("/avg") else 1.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("score (0-100)")
    rows_logged = list(read_jsonl(metrics_file)) if metrics_file.is_file() else []
    val = [(r["step"], r[k]) for r in rows_logged if (k := validation_metric(r))]
    if val:
        twin = ax.twinx()
        twin.plot([s for s, _ in val], [100 * v for _, v in val], color="0.3", linestyle="--", label="validation")
        twin.set_ylabel("validation metric x 100 (dashed)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Every checkpoint of the run")
    fig.tight_layout()
    return save_figure(fig, path)
