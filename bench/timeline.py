"""`python -m bench.timeline [OUT_ROOT]`: where the time of a `make run` went, read back from the files its steps
wrote (nothing is run or timed here): each pipeline stage's stats.json `seconds`, each training run's
metrics.jsonl (its steps' and validations' seconds), each evaluation's timing.json (evaluate.py: benchmarks
read, per row the encoder built, each side encoded, scoring, the efficiency columns; gain intervals; reports),
and for each row's document encoding its documents/s over the encode benchmark's limit at the same batch and
threads (bench/results/encode.json `limit`, torch's fastest batch size measured on the day's machine).
Set-up and the model build write no file: time them around `make setup` / `make model`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from care.paths import PROJECT_ROOT, outputs_dir


def total(seconds) -> float:
    """A stage's `seconds`: a number, or a dict of parts (its `total` when it has one)."""
    if isinstance(seconds, dict):
        return float(seconds.get("total", sum(v for v in seconds.values() if isinstance(v, (int, float)))))
    return float(seconds or 0.0)


def pipeline(root: Path) -> list[tuple[str, float]]:
    out = []
    for stats in sorted((root / "data").glob("**/stats.json"), key=lambda p: p.stat().st_mtime):
        seconds = json.loads(stats.read_text(encoding="utf-8")).get("seconds")
        if seconds is not None:
            out.append((f"pipeline {stats.parent.name}", total(seconds)))
    return out


def training(root: Path) -> list[tuple[str, float]]:
    out = []
    for metrics in sorted((root / "train").glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
        steps = sum(r.get("step_seconds", 0.0) for r in rows)
        validation = sum(r.get("val/seconds", 0.0) for r in rows)
        out.append((f"training {metrics.parent.name} (steps {steps:.0f} s, validation {validation:.0f} s)",
                    steps + validation))
    return out


def limit_docs_per_s(batch_size: int) -> tuple[float | None, str]:
    """The encode benchmark's torch limit (documents/s) at this batch size and thread count, and its model."""
    bench = PROJECT_ROOT / "bench" / "results" / "encode.json"
    if not bench.is_file():
        return None, ""
    result = json.loads(bench.read_text(encoding="utf-8"))
    sweep = result.get("limit", {}).get("sweep_docs_per_s", {})
    return sweep.get(f"{torch.get_num_threads()}t_b{batch_size}"), result.get("model", "")


def evaluation(root: Path) -> list[tuple[str, float]]:
    out = []
    for timing in sorted((root / "eval").glob("*/timing.json"), key=lambda p: p.stat().st_mtime):
        t = json.loads(timing.read_text(encoding="utf-8"))
        summary = json.loads((timing.parent / "summary.json").read_text(encoding="utf-8"))
        limit, model = limit_docs_per_s(summary["settings"]["batch_size"])
        run = t["run"]
        out.append((f"evaluate {run}: benchmarks read", t["benchmarks_s"]))
        for name, r in t["rows"].items():
            n = r.get("encoded") or {}
            for side in ("query", "document"):
                if n.get(side):
                    rate = n[side] / max(r[f"encode_{side}_s"], 1e-9)
                    ratio = f", {rate / limit:.2f}x {model}'s encode limit" if limit and side == "document" else ""
                    out.append((f"evaluate {run}: {name} encode {n[side]} {side} texts ({rate:.0f}/s{ratio})",
                                r[f"encode_{side}_s"]))
            out += [(f"evaluate {run}: {name} {step}", r[f"{step}_s"]) for step in ("build", "score", "efficiency")]
        out += [(f"evaluate {run}: gain intervals", t["gain_intervals_s"]), (f"evaluate {run}: reports", t["report_s"])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_root", nargs="?", default=str(outputs_dir()), help="the OUT_ROOT make run wrote into")
    root = Path(ap.parse_args().out_root)
    steps = pipeline(root) + training(root) + evaluation(root)
    for what, seconds in steps:
        print(f"{seconds / 60:7.2f} min  {what}")
    print(f"{sum(s for _, s in steps) / 60:7.2f} min  in all (set-up and the model build not included)")


if __name__ == "__main__":
    main()
