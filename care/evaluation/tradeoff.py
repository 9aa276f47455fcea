"""Quality against query cost, each model as a share of a reference measured in the same evaluation run:
`python -m care.evaluation.tradeoff RUN [RUN ...] --out bench/results/care_me5.json`.

CARE's claim is a ratio: the small query tower's Avg as a % of the symmetric model's, at its query latency as
a % of that model's.  Latency on a shared CPU moves between runs, so each model's latency is divided by the
reference's latency *of its own run* (evaluate.py scores the `me5_small` baseline in every run, with the same
efficiency settings); quality is divided the same way (a benchmark's Avg does not move between runs, but a
run with another benchmark build would).  Each RUN is an evaluate.py output folder (summary.json).

Per model row (every model of every run but the reference and BM25; `--keep-reference` keeps each run's
reference row, at 100%): the run, the model, the benchmark's slots and Avg, `avg_pct` (Avg / reference Avg x
100), query latency p50 / p95 and `latency_pct` (p50 / reference p50 x 100), online parameters.  Training
seeds: rows of one run whose names differ only in a last `-s<seed>` (`care_claim/g-cut4-ft-s1`, `-s2`, ...;
how `make care-claim` names its links) form a seed group, with the mean and sample sd over its seeds of every
slot, Avg, and both shares (`seed_groups` in the JSON, a second table).  Each run's date (its summary.json's
time), load average and CPU count, with --note, go under `measured`.  Writes the JSON (--out), a scatter plot
beside it (`<stem>_tradeoff.png`: latency % against Avg %, a seed group at its mean with its sd as error bars,
with the target box of --target-avg / --target-latency) and prints the Markdown tables.
"""
from __future__ import annotations

import argparse
import statistics
from datetime import datetime, timezone
from pathlib import Path

from care.config import SEED_NAME
from care.data.io import atomic_open, read_json, save_figure, write_json
from care.data.numbers import fmt_number
from care.errors import app_errors

P50, P95 = "query_latency_ms_p50", "query_latency_ms_p95"
LABEL_GAP = 2.2  # y-axis points (% of the reference's Avg) between two seed groups' labels: 7-pt text


def _pct(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else round(100 * value / reference, 1)


def run_rows(folder: Path, reference: str, benchmark: str | None, keep_reference: bool) -> list[dict]:
    """The rows of one evaluation run, each against the run's own reference row."""
    path = folder / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no summary.json (not an evaluate.py output folder)")
    summary = read_json(path)
    benchmarks = [b["name"] for b in summary["benchmarks"]]
    bench = benchmark or benchmarks[0]
    if bench not in benchmarks:
        raise ValueError(f"{path}: no benchmark {bench!r} (it has {', '.join(benchmarks)})")
    by_name = {m["name"]: m for m in summary["models"]}
    if reference not in by_name:
        raise ValueError(f"{path}: no reference model {reference!r} among {', '.join(by_name)} "
                        f"(evaluate.py baselines=[..., {reference}])")
    slots = [c for c in summary["columns"] if c["benchmark"] == bench and c["slot"]]
    avg_key = f"{bench}/avg"
    ref = by_name[reference]
    ref_avg, ref_p50 = ref["scores"].get(avg_key), (ref.get("efficiency") or {}).get(P50)
    rows = []
    for model in summary["models"]:
        if model["name"] == "bm25" or (model["name"] == reference and not keep_reference):
            continue
        eff = model.get("efficiency") or {}
        avg = model["scores"].get(avg_key)
        rows.append({
            "run": summary["run"], "model": model["name"], "label": model["label"],
            "slots": {c["title"]: model["scores"].get(c["key"]) for c in slots if c["key"] != avg_key},
            "avg": avg, "avg_pct": _pct(avg, ref_avg),
            "query_ms_p50": eff.get(P50), "query_ms_p95": eff.get(P95), "latency_pct": _pct(eff.get(P50), ref_p50),
            "reference": {"model": reference, "avg": ref_avg, "query_ms_p50": ref_p50},
            "online_parameters_M": _millions(eff.get("online_parameters")),
            "online_parameters_without_embeddings_M": _millions(eff.get("online_parameters_without_embeddings")),
        })
    return rows


def measured(folder: Path) -> dict:
    """When and how busy: the run's summary.json time (UTC), and the load and CPUs evaluate.py recorded."""
    path = folder / "summary.json"
    settings = read_json(path).get("settings") or {}
    when = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"run": folder.name, "summary_written": when, "load_average_1m": settings.get("load_average_1m"),
            "cpus": settings.get("cpus"), "seconds": settings.get("seconds")}


def _mean_sd(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None}


def seed_groups(rows: list[dict]) -> list[dict]:
    """Rows of one run named `<stem>-s<seed>` grouped by stem: mean and sd over the seeds, per cell."""
    found: dict[tuple, list[dict]] = {}
    for r in rows:
        if m := SEED_NAME.match(r["model"]):
            found.setdefault((r["run"], m["stem"]), []).append({**r, "seed": int(m["seed"])})
    groups = []
    for (run, stem), members in found.items():
        slots = list(dict.fromkeys(s for r in members for s in r["slots"]))
        groups.append({
            "run": run, "model": stem, "seeds": sorted(r["seed"] for r in members), "n": len(members),
            "slots": {s: _mean_sd([r["slots"].get(s) for r in members]) for s in slots},
            **{k: _mean_sd([r[k] for r in members]) for k in ("avg", "avg_pct", "query_ms_p50", "latency_pct")},
        })
    return groups


def _cell(x: dict | None, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    return fmt_number(x["mean"], digits) + ("" if x["sd"] is None else f" ± {fmt_number(x['sd'], digits)}")


def groups_markdown(groups: list[dict]) -> str:
    slots = list(dict.fromkeys(s for g in groups for s in g["slots"]))
    head = ["run", "rows (mean ± sd over seeds)", "seeds", *slots, "Avg", "% of ref. Avg", "% of ref. latency"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    for g in groups:
        cells = [g["run"], g["model"], ", ".join(map(str, g["seeds"])), *(_cell(g["slots"].get(s)) for s in slots),
                 _cell(g["avg"]), _cell(g["avg_pct"], 1), _cell(g["latency_pct"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _millions(n: int | None) -> float | None:
    return None if n is None else round(n / 1e6, 1)


def markdown(rows: list[dict]) -> str:
    slots = list(dict.fromkeys(s for r in rows for s in r["slots"]))
    head = ["run", "model", *slots, "Avg", "% of ref. Avg", "query ms p50", "ref. ms p50 (same run)",
            "% of ref. latency", "online params w/o token emb. (M)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [r["run"], r["label"], *(fmt_number(r["slots"].get(s)) for s in slots), fmt_number(r["avg"]),
                 fmt_number(r["avg_pct"], 1), fmt_number(r["query_ms_p50"], 1), fmt_number(r["reference"]["query_ms_p50"], 1),
                 fmt_number(r["latency_pct"], 1), fmt_number(r["online_parameters_without_embeddings_M"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def label_heights(ys: list[float], gap: float) -> list[float]:
    """A label height for each point, in the points' order: from the top down, each label at its point's height
    or `gap` below the label above it, whichever is lower."""
    heights, above = [0.0] * len(ys), float("inf")
    for i in sorted(range(len(ys)), key=lambda i: -ys[i]):
        heights[i] = above = min(ys[i], above - gap)
    return heights


def plot(path: Path, rows: list[dict], target_avg: float, target_latency: float,
         groups: list[dict] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    points = [r for r in rows if r["avg_pct"] is not None and r["latency_pct"] is not None]
    seeded = {(g["run"], g["model"]) for g in groups}
    alone = [r for r in points if not ((m := SEED_NAME.match(r["model"])) and (r["run"], m["stem"]) in seeded)]
    ax.scatter([r["latency_pct"] for r in points if r not in alone], [r["avg_pct"] for r in points if r not in alone],
               s=8, color="grey", alpha=0.5, label="one seed of a seed group")
    ax.scatter([r["latency_pct"] for r in alone], [r["avg_pct"] for r in alone], color="C0")
    for r in alone:  # the row name without its run folder (d-stage2, me5_small): full labels run off the axes
        ax.annotate(r["model"].rsplit("/", 1)[-1], (r["latency_pct"], r["avg_pct"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    drawn = [g for g in groups if g["avg_pct"] is not None and g["latency_pct"] is not None]
    # Seed groups of one network sit within the latency noise of each other, so labels beside the points
    # overlap: they go in a column to the right of the groups, at least LABEL_GAP apart, each with a line to its point.
    label_x = max((g["latency_pct"]["mean"] + (g["latency_pct"]["sd"] or 0) for g in drawn), default=0) + 6
    heights = label_heights([g["avg_pct"]["mean"] for g in drawn], LABEL_GAP)
    for g, label_y in zip(drawn, heights):
        x, y = g["latency_pct"], g["avg_pct"]
        ax.errorbar(x["mean"], y["mean"], xerr=x["sd"] or 0, yerr=y["sd"] or 0, fmt="s", color="C1", capsize=2, ms=4)
        ax.annotate(f"{g['model'].rsplit('/', 1)[-1]} ({g['n']} seed{'s' if g['n'] > 1 else ''})", (x["mean"], y["mean"]),
                    xytext=(label_x, label_y), fontsize=7, color="C1", va="center",
                    arrowprops={"arrowstyle": "-", "color": "C1", "lw": 0.5, "alpha": 0.6})
    ax.axhline(target_avg, ls="--", lw=0.8, color="grey")
    ax.axvline(target_latency, ls="--", lw=0.8, color="grey")
    ax.fill_between([0, target_latency], target_avg, 105, color="green", alpha=0.08,
                    label=f"target: >= {target_avg:g}% of Avg at <= {target_latency:g}% of latency")
    ax.set_xlim(0, max([105.0] + [r["latency_pct"] + 15 for r in points]))
    ax.set_ylim(min([50.0] + [r["avg_pct"] - 5 for r in points]), 105)
    ax.set_xlabel("query latency p50, % of the reference's in the same run")
    ax.set_ylabel("Avg, % of the reference's")
    ax.set_title("Quality against query cost")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="evaluate.py output folders")
    ap.add_argument("--reference", default="me5_small", help="the model every row is a share of (default me5_small)")
    ap.add_argument("--benchmark", default=None, help="whose Avg (default: each run's main benchmark)")
    ap.add_argument("--keep-reference", action="store_true", help="keep each run's reference row (100%%)")
    ap.add_argument("--target-avg", type=float, default=90.0)
    ap.add_argument("--target-latency", type=float, default=40.0)
    ap.add_argument("--note", default=None, help="what the numbers need said (the machine, what else ran)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON; the plot goes beside it")
    args = ap.parse_args(argv)
    with app_errors("tradeoff", resumes=False):
        rows = [r for run in args.runs for r in run_rows(run, args.reference, args.benchmark, args.keep_reference)]
        groups = seed_groups(rows)
        table = markdown(rows) + (f"\n{groups_markdown(groups)}" if groups else "")
        write_json(args.out, {"what": "each model as a % of the reference measured in the same evaluation run "
                                      "(python -m care.evaluation.tradeoff)",
                              "runs": [r.name for r in args.runs], "reference": args.reference,
                              "measured": {"runs": [measured(r) for r in args.runs], "note": args.note},
                              "target": {"avg_pct_at_least": args.target_avg,
                                         "latency_pct_at_most": args.target_latency},
                              "rows": rows, "seed_groups": groups})
        with atomic_open(args.out.with_suffix(".md")) as fh:
            fh.write(table)
        plot(args.out.with_name(f"{args.out.stem}_tradeoff.png"), rows, args.target_avg, args.target_latency, groups)
        print(table)


if __name__ == "__main__":
    main()
