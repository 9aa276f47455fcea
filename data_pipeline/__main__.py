"""`python -m data_pipeline` runs every stage in order on the configured data; `stage=NAME` runs one.

Each stage is a module with `run(cfg) -> dict` (its stats); stages read and write documented files
under `cfg.out_root`, so any one can be re-run, inspected or replaced.
"""
from __future__ import annotations

import importlib
import sys
import time

import hydra
from omegaconf import DictConfig

import care  # noqa: F401  (registers the ${paths:...} resolver)
from data_pipeline.io import DataError

STAGES = {
    "import": "data_pipeline.import_stage",      # raw sources -> texts / pairs / candidates
    "dedup": "data_pipeline.dedup.stage",         # exact -> MinHash -> semantic, clusters
    "build": "data_pipeline.build",               # training examples, leakage rule against eval sets
    "mine": "data_pipeline.mining",               # FAISS hard negatives in the encoder's window
    "benchmarks": "data_pipeline.benchmarks",     # open stand-in evaluation task files
}
ORDER = list(STAGES)


def outcome(name: str, stats: dict) -> str:
    """One line of what a stage produced, from its stats (a skipped stage returns its stored stats)."""
    if name == "import":
        o = stats.get("outputs", {})
        return f"{o.get('texts', 0):,} texts, {o.get('pairs', 0):,} pairs, {o.get('candidate_lists', 0):,} candidate lists"
    if name == "dedup":
        per = " -> ".join(f"{s}: {v.get('out', '?'):,}" for s, v in stats.get("stages", {}).items()
                          if isinstance(v, dict) and isinstance(v.get("out"), int))
        return f"{stats.get('texts_in', 0):,} -> {stats.get('texts_out', 0):,} texts ({per})"
    if name == "build":
        removed = stats.get("leakage_removed", {}).get("training_pairs", 0)
        return f"{stats.get('examples', 0):,} examples, {stats.get('texts', 0):,} texts; leakage rule removed {removed:,} pairs"
    if name == "mine":
        n, w = stats.get("negatives", {}), stats.get("window", {})
        return (f"{stats.get('examples', 0):,} examples, {n.get('per_example_mean', 0)} negatives each in "
                f"[{w.get('lo')}, {w.get('hi')}), {stats.get('examples_with_fallback', 0):,} with fallback")
    if name == "benchmarks":
        return ", ".join(f"{b}: {len(s.get('slots', {}))} tasks" for b, s in stats.items())
    return ""


@hydra.main(config_path="../conf", config_name="data_pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    names = ORDER if cfg.stage == "all" else [cfg.stage]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise SystemExit(f"unknown stage '{unknown[0]}' (choose one of {', '.join(ORDER)} or all)")
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            stats = importlib.import_module(STAGES[name]).run(cfg)
        except (DataError, FileNotFoundError, ValueError) as e:  # bad input: the message names file and item
            print(f"error in stage {name}: {e}", file=sys.stderr)
            sys.exit(1)
        rows.append((name, time.perf_counter() - start, outcome(name, stats or {})))
    if len(rows) > 1:  # the whole pipeline: one table of what each stage gave (a skipped stage takes ~0 s)
        print(f"\n{'stage':<11} {'seconds':>8}  result")
        for name, seconds, line in rows:
            print(f"{name:<11} {seconds:>8.1f}  {line}")


if __name__ == "__main__":
    main()
