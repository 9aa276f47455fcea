"""A recipe study's table, read from its training runs' own validation logs, so that arms are chosen on a
selection set (validation.task, the held-out alignment slice) and never on the benchmark:

    python -m care.training.study <outputs>/train/care_study-* [--stage stage1] [--out DIR | --out-root ROOT]

Each argument is a run folder (`<run>/metrics.jsonl`), or a CARE run whose `<stage>/` holds one.  A run's arm is
its folder name without the `-s<seed>` suffix, so the seeds of an arm are averaged (mean, sd, n).  Per arm: the
validation metric at the run's last validation and at step 0 (the same model before training), the held-out
alignment (val/align_cos, val/align_acc) when logged, steps, and training seconds (the sum of logged step
times; validation excluded).  Arms are sorted by the validation metric, best first.  Writes study.md and
study.json under --out (default <--out-root>/compare/study-<time>, the outputs root the apps take as out_root=,
as care.evaluation.compare's) and prints the table.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from care.config import SEED_NAME
from care.data.io import atomic_open, read_jsonl, validation_metric, write_json
from care.errors import app_errors
from care.paths import outputs_dir

ALIGNMENT = ("val/align_cos", "val/align_acc")


def run_row(folder: Path, stage: str) -> dict:
    """One run's numbers from its metrics.jsonl (`stage`/metrics.jsonl inside a CARE run)."""
    log = folder / stage / "metrics.jsonl" if (folder / stage / "metrics.jsonl").is_file() else folder / "metrics.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{folder}: no metrics.jsonl (nor {stage}/metrics.jsonl): not a training run folder")
    rows = list(read_jsonl(log))
    validations = [r for r in rows if validation_metric(r)]
    if not validations:
        raise ValueError(f"{log}: no validation row; a study needs validation (validation.task)")
    last = validations[-1]
    metric = validation_metric(last)
    aligned = [r for r in rows if ALIGNMENT[0] in r]
    named = SEED_NAME.match(folder.name)
    return {"run": folder.name, "arm": named["stem"] if named else folder.name, "seed": int(named["seed"]) if named else None,
            "metric": metric, "value": last[metric], "step": last["step"],
            "start": validations[0][metric] if validations[0]["step"] == 0 else None,
            **{k: aligned[-1][k] for k in ALIGNMENT if aligned},
            "steps": max((r["step"] for r in rows if "step_seconds" in r), default=0),
            "train_seconds": round(sum(r.get("step_seconds", 0.0) for r in rows), 1)}


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def arms(rows: list[dict]) -> list[dict]:
    """Rows grouped by arm: mean and sd over seeds of each number, best validation metric first."""
    by_arm: dict[str, list[dict]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append(row)
    out = []
    for arm, runs in by_arm.items():
        entry = {"arm": arm, "n": len(runs), "seeds": sorted(r["seed"] for r in runs if r["seed"] is not None),
                 "metric": runs[0]["metric"], "steps": max(r["steps"] for r in runs)}
        for key in ("value", "start", *ALIGNMENT, "train_seconds"):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                entry[key], entry[f"{key}_sd"] = _mean_sd(values)
        out.append(entry)
    return sorted(out, key=lambda e: -e["value"])


def _cell(entry: dict, key: str, scale: float = 100.0) -> str:
    if key not in entry:
        return "-"
    sd = entry.get(f"{key}_sd")
    return f"{entry[key] * scale:.2f}" + (f" ± {sd * scale:.2f}" if sd is not None else "")


def table(entries: list[dict]) -> str:
    metric = entries[0]["metric"] if entries else "val"
    lines = [f"| arm | seeds | steps | {metric} (x100) | at step 0 | align_cos (x100) | align_acc (%) | train min |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        lines.append(f"| {e['arm']} | {','.join(map(str, e['seeds'])) or '-'} | {e['steps']} | {_cell(e, 'value')} | "
                     f"{_cell(e, 'start')} | {_cell(e, 'val/align_cos')} | {_cell(e, 'val/align_acc')} | "
                     f"{e.get('train_seconds', 0) / 60:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--stage", default="stage1", help="the CARE stage whose log is read (default stage1)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--out-root", type=Path, default=outputs_dir(),
                    help="the outputs root, as the apps' out_root= (default CARE_OUTPUTS, else <project>/outputs)")
    a = ap.parse_args(argv)
    out = a.out or a.out_root / "compare" / f"study-{time.strftime('%Y%m%d-%H%M%S')}"
    with app_errors("python -m care.training.study", writes_to=out):
        rows = [run_row(folder, a.stage) for folder in a.runs if folder.is_dir()]
        entries = arms(rows)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "study.json", {"runs": rows, "arms": entries})
        with atomic_open(out / "study.md") as fh:
            fh.write(table(entries) + "\n")
        print(table(entries))
        print(f"study: {len(rows)} runs, {len(entries)} arms -> {out}")


if __name__ == "__main__":
    main()
