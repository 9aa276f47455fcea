"""Train an embedding model: `python train.py [experiment=...] [model=...] [loss=...] [trainer=...] [key=value]`.

    python train.py                                  CPU-sized fine-tune of multilingual-e5-small (~10 min, 2 cores)
    python train.py experiment=bge_m3_medical_cn     the BGE-M3 recipe of bge-m3-medical-cn, one GPU
    accelerate launch --multi_gpu train.py experiment=bge_m3_medical_cn trainer=multi_gpu
    python train.py model=tiny_m3 trainer.max_steps=3 validation.task=null   a smoke run

Reads the training files of `python -m data_pipeline`; writes outputs/train/<run_name>/ (docs/training.md, "The run folder").
Run it again with the same config to resume from the last checkpoint.  The Hydra main returns the best
validation metric (NaN without validation), the number a Hydra sweeper or a wandb sweep optimises.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.allocator import keep_freed_memory
from care.config import CONF_DIR
from care.errors import app_errors


def validation_metric(summary: dict) -> float:
    value = summary.get("best_metric")
    return float(value) if value is not None and math.isfinite(value) else math.nan


def distributed_env_from_submitit() -> None:
    """hydra/launcher=slurm (or submitit_local) with several tasks per job starts one process per task, each
    running this main: give each the RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT torchrun would
    (submitit's TorchDistributedEnvironment, from SLURM_PROCID, SLURM_LOCALID, the node list and the job id),
    so accelerate starts DDP over the job's tasks (docs/cluster.md).  A launcher that set them (torchrun) wins."""
    if os.environ.get("SUBMITIT_EXECUTOR") and "RANK" not in os.environ:
        import submitit

        if submitit.JobEnvironment().num_tasks > 1:
            # every GPU of the node stays visible (accelerate takes cuda:LOCAL_RANK); a MASTER_PORT set is kept
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def per_job_output_dir(cfg: DictConfig) -> None:
    """In a multirun (`-m`), jobs that all compose conf/train.yaml's default run_name would train into the
    same folder (the second refused as another run's, or both writing checkpoints at once): give each its
    own, <output_dir>/<the sweep's folder name (its start time)>/<job number>; the job's overrides are in its
    care_training.json and Hydra's job folder.  A job keeps the folder its config names (and a finished run
    is skipped when the sweep runs again) when its command line sets output_dir or run_name, or when its
    experiment names its runs (e.g. `run_name: signals-inbatch-s${seed}`): such an experiment answers for
    one folder per job, and a run that lands in another's folder is refused, never mixed (checkpoint.py)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    if not HydraConfig.initialized():  # main() called as a function (tests): no command line to read
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:  # a single run: nothing to tell apart, nothing to read
        return
    if any(o.split("=", 1)[0].lstrip("+~") in ("output_dir", "run_name") for o in hc.overrides.task):
        return
    unresolved = [OmegaConf.to_container(c, resolve=False).get("run_name")  # as written: ${...} kept
                  for c in (OmegaConf.load(CONF_DIR / "train.yaml"), cfg)]
    if unresolved[0] == unresolved[1]:
        with open_dict(cfg):
            cfg.output_dir = f"{cfg.output_dir}/{Path(hc.sweep.dir).name}/{hc.job.num}"


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    keep_freed_memory()
    distributed_env_from_submitit()
    per_job_output_dir(cfg)
    # after Hydra parsed the command line: `--help` stays fast
    from care.training.trainer import ResumeError, train

    # bad input (DataError is a ValueError), a full disk, a corrupt file, another run's folder: one line
    with app_errors("train.py", cfg, writes_to=cfg.get("output_dir"), extra=(ResumeError,)):
        summary = train(cfg)
        if os.environ.get("RANK", "0") == "0":  # under torchrun / accelerate launch: once, not once per process
            print(json.dumps(summary, indent=2, ensure_ascii=False, default=str))
        return validation_metric(summary)


if __name__ == "__main__":
    main()
