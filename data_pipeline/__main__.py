"""`python -m data_pipeline` runs every stage in order on the configured data; `stage=NAME` runs one.

Each stage is a module with `run(cfg) -> dict` (its stats); stages read and write documented files
under `cfg.out_root`, so any one can be re-run, inspected or replaced.
"""
from __future__ import annotations

import importlib

import hydra
from omegaconf import DictConfig

import care  # noqa: F401  (registers the ${paths:...} resolver)

STAGES = {
    "import": "data_pipeline.import_stage",      # raw sources -> texts / pairs / candidates
    "dedup": "data_pipeline.dedup.stage",         # exact -> MinHash -> semantic, clusters
    "build": "data_pipeline.build",               # training examples, leakage rule against eval sets
    "mine": "data_pipeline.mining",               # FAISS hard negatives in the encoder's window
    "benchmarks": "data_pipeline.benchmarks",     # open stand-in evaluation task files
}
ORDER = list(STAGES)


@hydra.main(config_path="../conf", config_name="data_pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    names = ORDER if cfg.stage == "all" else [cfg.stage]
    for name in names:
        if name not in STAGES:
            raise SystemExit(f"unknown stage '{name}' (choose one of {', '.join(ORDER)} or all)")
        importlib.import_module(STAGES[name]).run(cfg)


if __name__ == "__main__":
    main()
