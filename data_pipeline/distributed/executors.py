"""Executors from config: a stage's datatrove steps run on this machine, on Slurm or on Ray.

A config section (conf/dedup/default.yaml's `dedup` is one) names the executor with these keys:
  executor   local | slurm | ray
  workers    tasks run at once (-1: local, one per CPU of this machine; Slurm and Ray, no limit)
  local      {start_method}: how datatrove's pool starts its workers: fork (the default here) or
             datatrove's forkserver, which re-imports __main__ in every pool (~5 s a step for the pipeline's
             app, measured; a script without a main guard hangs)
  slurm      the keys `hydra/launcher=slurm` uses for training (conf/hydra/launcher/slurm.yaml):
             partition, account, qos, cpus_per_task, mem_gb, timeout_min (Slurm's --time), setup (lines run
             before the task), additional_parameters (any other sbatch option), plus poll_s: how often the
             submitting process, which waits for the jobs as hydra-submitit does, checks on them
  ray        address (null: a local Ray started here), cpus_per_task, mem_gb

`make_executor` builds one datatrove executor for one step; `run_steps` runs a stage's steps in order and
checks that every task of each finished (`get_incomplete_ranks`) before the next starts.  datatrove's own
`depends=` is used only on Slurm, where the scheduler holds a dependant until its dependency succeeded
(`afterok`); on the local and Ray executors `depends=` polls every two minutes for a dependency that may
never complete, so `run_steps` chains those steps itself.  Resume is datatrove's: a task that finished
leaves `completions/<rank>` in its step's logging folder and is skipped when the same steps run again.
"""
from __future__ import annotations

import errno
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.executor.slurm import SlurmPipelineExecutor

EXECUTORS = ("local", "slurm", "ray")


class TasksFailed(OSError):
    """Some tasks of a step did not finish (a lost node, a time limit, an error in a task): an OSError naming
    their logs folder, so an app ends in one line that says where to look (care/errors.py)."""

    def __init__(self, message: str, logs: str):
        super().__init__(errno.EIO, message, logs)


def _section(cfg, key: str) -> Mapping:
    value = cfg.get(key) if cfg is not None else None
    return value if value is not None else {}


def executor_kind(executor_cfg) -> str:
    kind = str(executor_cfg.get("executor", "local") if executor_cfg is not None else "local")
    if kind not in EXECUTORS:
        raise ValueError(f"executor={kind!r}: choose from {list(EXECUTORS)}")
    return kind


def slurm_time(timeout_min: int) -> str:
    """hydra-submitit's timeout_min as Slurm's --time (hours:minutes:seconds; hours may pass 24)."""
    minutes = int(timeout_min)
    if minutes <= 0:
        raise ValueError(f"slurm.timeout_min={timeout_min}: must be a positive number of minutes")
    return f"{minutes // 60}:{minutes % 60:02d}:00"


class SlurmExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor without the sbatch lines of unset options: datatrove writes a None value
    as a bare `#SBATCH --partition`, where hydra-submitit's null means the cluster's default."""

    def get_sbatch_args(self, max_array: int = 1) -> dict:
        return {k: v for k, v in super().get_sbatch_args(max_array).items() if v is not None}


def _activate_line() -> str | None:
    """The line that puts this Python's environment (and datatrove's launch_pickled_pipeline) on a Slurm
    task's PATH: the virtualenv's activate script when this Python runs in one."""
    activate = Path(sys.prefix) / "bin" / "activate"
    return f"source {activate}" if sys.prefix != sys.base_prefix and activate.is_file() else None


def make_executor(executor_cfg, pipeline: Sequence, logging_dir: str | Path, tasks: int, job_name: str,
                  depends=None):
    """A datatrove executor running `pipeline` as `tasks` tasks, logging (completions, stats, per-task logs)
    under `logging_dir`.  `depends` (Slurm only) makes the scheduler start these tasks after every task of
    that executor succeeded; locally and on Ray use `run_steps`, which chains steps without waiting forever."""
    kind = executor_kind(executor_cfg)
    if int(tasks) < 1:
        raise ValueError(f"{job_name}: tasks={tasks}: at least one task")
    workers = int(executor_cfg.get("workers", -1) if executor_cfg is not None else -1)
    if workers < 1:   # unset: locally one task per CPU (not one process per task), elsewhere the scheduler's
        workers = min(tasks, os.cpu_count() or 1) if kind == "local" else tasks
    workers = min(workers, tasks)
    logging_dir = str(Path(logging_dir).resolve())
    if depends is not None and kind != "slurm":
        raise ValueError(f"{job_name}: depends= on the {kind} executor polls for ever on a dependency that "
                         "fails; run the steps in order with run_steps instead")
    if kind == "local":
        local = _section(executor_cfg, "local")
        return LocalPipelineExecutor(list(pipeline), tasks=tasks, workers=workers, logging_dir=logging_dir,
                                     start_method=str(local.get("start_method", "fork")))
    if kind == "ray":
        try:
            import ray  # noqa: F401
            from datatrove.executor.ray import RayPipelineExecutor
        except ImportError as e:
            raise ValueError("executor=ray needs ray: pip install -e '.[ray]' (docs/cluster.md)") from e
        ray_cfg = _section(executor_cfg, "ray")
        cpus = int(ray_cfg.get("cpus_per_task", 1))
        return RayPipelineExecutor(list(pipeline), tasks=tasks, workers=workers, logging_dir=logging_dir,
                                   cpus_per_task=cpus, mem_per_cpu_gb=float(ray_cfg.get("mem_gb", 2)) / cpus)
    s = _section(executor_cfg, "slurm")
    if shutil.which("sbatch") is None:
        raise ValueError("executor=slurm: no sbatch on PATH (run on a Slurm login node; docs/cluster.md)")
    cpus = int(s.get("cpus_per_task", 1))
    sbatch_args = {"account": s.get("account"), **dict(s.get("additional_parameters") or {})}
    setup = [str(line) for line in (s.get("setup") or [])]
    env_lines = [*setup, *filter(None, [_activate_line()])]
    return SlurmExecutor(
        list(pipeline), tasks=tasks, workers=workers if workers < tasks else -1,   # -1: no %N on the array
        logging_dir=logging_dir, job_name=job_name, time=slurm_time(s.get("timeout_min", 240)),
        partition=s.get("partition"), qos=s.get("qos"), cpus_per_task=cpus,
        mem_per_cpu_gb=max(1, math.ceil(float(s.get("mem_gb", 4)) / cpus)),
        sbatch_args={k: v for k, v in sbatch_args.items() if v is not None},
        env_command="\n        ".join(env_lines) or None, depends=depends)


def _check_done(executor, name: str) -> None:
    missing = executor.get_incomplete_ranks(skip_completed=True)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise TasksFailed(f"{name}: {len(missing)} of {executor.world_size} tasks did not finish (ranks {shown}; "
                          "their logs in this folder); the same command re-runs only them",
                          f"{executor.logging_dir.path}/logs")


def run_steps(executor_cfg, steps: Sequence[tuple[str, object]]) -> None:
    """Run (name, executor) steps in order, each after every task of the one before finished.  Raises
    TasksFailed naming the step and ranks that did not finish; finished tasks are never re-run."""
    kind = executor_kind(executor_cfg)
    if kind == "slurm":
        _run_slurm(_section(executor_cfg, "slurm"), steps)
        return
    if kind == "ray":
        import ray

        if not ray.is_initialized():
            address = _section(executor_cfg, "ray").get("address")
            ray.init(address=address, include_dashboard=False, log_to_driver=False) if address else \
                ray.init(include_dashboard=False, log_to_driver=False)
    for name, executor in steps:
        executor.run()
        _check_done(executor, name)


def _squeue(job_ids: list[str]) -> dict[str, str]:
    """Queued or running jobs among job_ids -> their reason (squeue's %r)."""
    proc = subprocess.run(["squeue", "-h", "-o", "%i %r", "-j", ",".join(job_ids)], check=False,
                          capture_output=True, text=True)
    if proc.returncode != 0:  # squeue refuses ids that have left the queue
        return {}
    queued = {}
    for line in proc.stdout.splitlines():
        job, _, reason = line.strip().partition(" ")
        if job:
            queued[job.split("_")[0]] = reason
    return queued


def _run_slurm(s: Mapping, steps: Sequence[tuple[str, object]]) -> None:
    """Submit every step at once, each held by Slurm until the one before succeeded (afterok: a failed task
    stops its dependants), then wait until all tasks finished or nothing is left to run.  Stopping this
    process does not stop the jobs: wait for them (squeue) before running the same command again."""
    previous = None
    for _, executor in steps:
        executor.depends = previous
        executor.run()   # sbatch; an executor whose tasks all finished earlier submits nothing (job_id -1)
        previous = executor
    poll = float(s.get("poll_s", 30))
    ids = [str(e.job_id) for _, e in steps if e.job_id not in (None, -1)]
    while True:
        if all(not e.get_incomplete_ranks(skip_completed=True) for _, e in steps):
            return
        queued = _squeue(ids) if ids else {}
        if queued and all(r == "DependencyNeverSatisfied" for r in queued.values()):
            subprocess.run(["scancel", *queued], check=False)   # held for ever behind a failed task
            queued = {}
        if not queued:
            for name, e in steps:
                _check_done(e, name)
            return
        time.sleep(poll)
