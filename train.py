"""Train an embedding model: `python train.py [experiment=...] [model=...] [loss=...] [trainer=...] [key=value]`.

    python train.py                                  CPU-sized fine-tune of multilingual-e5-small (~10 min, 2 cores)
    python train.py experiment=bge_m3_medical_cn     the BGE-M3 recipe of bge-m3-medical-cn, one GPU
    accelerate launch --multi_gpu train.py experiment=bge_m3_medical_cn trainer=multi_gpu
    python train.py model=tiny_m3 trainer.max_steps=3 validation.task=null   a smoke run

Reads the training files of `python -m data_pipeline`; writes outputs/train/<run_name>/ (README, "Training").
Run it again with the same config to resume from the last checkpoint.  The Hydra main returns the best
validation metric (NaN without validation), the number a Hydra sweeper or a wandb sweep optimises.
"""
from __future__ import annotations

import json
import math
import os
import sys

import hydra
from omegaconf import DictConfig

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.config import CONF_DIR


def validation_metric(summary: dict) -> float:
    value = summary.get("best_metric")
    return float(value) if value is not None and math.isfinite(value) else math.nan


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    # after Hydra parsed the command line: `--help` stays fast
    from care.training.trainer import AlreadyFinished, ResumeError, Trainer

    if cfg.model.get("kind") == "care":  # two towers, two stages (care.training.care_recipe)
        from care.training.care_recipe import run_care

        try:
            summary = run_care(cfg)
        except (ResumeError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per process
            print(json.dumps(summary, indent=2, ensure_ascii=False, default=str))
        return validation_metric(summary)
    try:
        trainer = Trainer(cfg)
    except AlreadyFinished as done:  # the same config, trained before: a re-run (make run) skips it
        print(done)
        return validation_metric(done.summary)
    except (ResumeError, ValueError, FileNotFoundError) as e:  # bad input (DataError is a ValueError): named
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    summary = trainer.fit()
    if trainer.accelerator.is_main_process:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    return validation_metric(summary)


if __name__ == "__main__":
    main()
