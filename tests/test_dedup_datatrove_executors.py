"""The executors of dedup.engine=datatrove (data_pipeline/distributed/executors.py): Slurm through a stand-in
sbatch/srun/scontrol/squeue/scancel (tests/fake_slurm/) that runs the job scripts datatrove writes, in
dependency order; Ray on a local ray.init when ray is installed (the optional extra `[ray]`).

On Slurm: the stage folder equals the native one; a task that fails stops the steps after it (Slurm holds
them, the stage cancels them and names the step and rank); the same command then submits only that task and
the steps after it, and the folder again equals the native one.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
from pathlib import Path

import pytest
from test_dedup_datatrove import assert_same_folder, cache_root, dedup, native, store  # noqa: F401 (fixtures)

from data_pipeline.distributed.executors import SlurmExecutor, TasksFailed, make_executor, slurm_time

FAKE = Path(__file__).parent / "fake_slurm"


def jobs(state: Path) -> list[dict]:
    return [json.loads(x) for x in (state / "jobs.jsonl").read_text().splitlines()]


def test_slurm_options_as_hydra_names_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    cfg = {"executor": "slurm", "workers": 3, "slurm": {"partition": None, "account": "med", "qos": None,
                                                         "cpus_per_task": 2, "mem_gb": 5, "timeout_min": 90,
                                                         "setup": ["export A=1"],
                                                         "additional_parameters": {"constraint": "cpu"}}}
    ex = make_executor(cfg, [], tmp_path / "logs", 8, "job")
    assert isinstance(ex, SlurmExecutor)
    args = ex.get_sbatch_args(8)
    assert "partition" not in args and "qos" not in args   # null: the cluster's default, no bare option
    assert args["account"] == "med" and args["constraint"] == "cpu" and args["time"] == "1:30:00"
    assert args["cpus-per-task"] == 2 and args["mem-per-cpu"] == "3G" and args["array"] == "0-7%3"
    script = ex.get_launch_file_contents(args, "true")
    assert "#SBATCH --partition\n" not in script and "export A=1" in script
    assert slurm_time(2000) == "33:20:00"
    with pytest.raises(ValueError, match="timeout_min"):
        slurm_time(0)


def test_depends_refused_where_it_would_wait_for_ever(tmp_path):
    first = make_executor({"executor": "local"}, [], tmp_path / "a", 1, "a")
    with pytest.raises(ValueError, match="polls for ever"):
        make_executor({"executor": "local"}, [], tmp_path / "b", 1, "b", depends=first)
    with pytest.raises(ValueError, match="executor='yarn'"):
        make_executor({"executor": "yarn"}, [], tmp_path / "c", 1, "c")


def test_local_task_failure_names_step_and_rank(tmp_path):
    from data_pipeline.distributed.executors import run_steps

    def fail_on_one(data, rank, world_size):
        if rank == 1:
            raise OSError("disk gone")
        return iter(())

    ex = make_executor({"executor": "local", "workers": 1}, [fail_on_one], tmp_path / "logs", 3, "x")
    with pytest.raises(OSError, match="disk gone"):
        run_steps({"executor": "local"}, [("x", ex)])
    assert sorted(p.name for p in (tmp_path / "logs" / "completions").iterdir()) == ["00000"]
    # the executor stops at the failed task; what did not finish is named by the check, in one line
    from care.errors import describe
    from data_pipeline.distributed.executors import _check_done

    with pytest.raises(TasksFailed, match=r"x: 2 of 3 tasks did not finish \(ranks 1, 2;") as failed:
        _check_done(ex, "x")
    line = describe(failed.value)
    assert line.startswith(f"{tmp_path / 'logs' / 'logs'}: x: 2 of 3") and "\n" not in line


@pytest.mark.slow
def test_slurm_stand_in_failure_then_relaunch(store, native, tmp_path, monkeypatch):  # noqa: F811
    ref, ref_stats = native
    state, work = tmp_path / "slurm", tmp_path / "work"
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(state))
    slurm = ["dedup.executor=slurm", "dedup.tasks=2", "dedup.slurm.poll_s=0.1", f"dedup.work_dir={work}",
             "dedup.slurm.partition=cpu", "dedup.slurm.account=med"]

    # one task of the exact-Jaccard step lost: the step after it never runs, the stage names the task
    monkeypatch.setenv("FAKE_SLURM_FAIL", "dedup_minhash_verify:1")
    with pytest.raises(TasksFailed, match=r"minhash: exact Jaccard: 1 of 2 tasks did not finish \(ranks 1;"):
        dedup(store, tmp_path / "out", "datatrove", *slurm)
    first = jobs(state)
    steps = [j for j in first if not j["merge_stats"]]   # datatrove adds a stats-merging job per step
    assert [(j["name"], j["array"]) for j in steps] == [
        ("dedup_exact_signature", 2), ("dedup_exact_find", 2), ("dedup_minhash_signature", 2),
        ("dedup_minhash_buckets", 2), ("dedup_minhash_verify", 2), ("dedup_minhash_cluster", 1)]
    # within a stage every step's array waits for the one before (datatrove's afterok on its job id); the
    # MinHash stage is submitted once the exact stage's removals are known
    for before, after in itertools.pairwise(steps):
        first_of_stage = after["name"] == "dedup_minhash_signature"
        assert (f"afterok:{before['id']}" in after["dependency"]) != first_of_stage
    assert [j["state"] for j in steps] == ["COMPLETED"] * 4 + ["FAILED", "CANCELLED"]   # held, then cancelled
    done = {p.parent.parent.name: sorted(x.name for x in p.parent.iterdir()) for p in work.glob("logs/*/completions/*")}
    assert done["minhash_verify"] == ["00000"] and "minhash_cluster" not in done
    assert done["minhash_buckets"] == ["00000", "00001"]
    assert not (tmp_path / "out" / "kept.jsonl").exists()

    # the same command again: only the lost task and the step after it are submitted; the folder is native's
    monkeypatch.delenv("FAKE_SLURM_FAIL")
    stats = dedup(store, tmp_path / "out", "datatrove", *slurm)
    relaunch = [j for j in jobs(state)[len(first):] if not j["merge_stats"]]
    assert [(j["name"], j["array"]) for j in relaunch] == [("dedup_minhash_verify", 1), ("dedup_minhash_cluster", 1)]
    assert all(j["state"] == "COMPLETED" for j in jobs(state)[len(first):])
    assert_same_folder(tmp_path / "out", ref, stats, ref_stats)
    assert stats["engine"]["executor"] == "slurm" and not work.exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="ray is the optional extra [ray] (pip install -e '.[ray]': a 79 MB wheel, 240 MB "
                           "installed; docs/cluster.md): this test runs where it is installed")
def test_ray_local_cluster(store, native, tmp_path):  # noqa: F811
    import ray

    ref, ref_stats = native
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        stats = dedup(store, tmp_path / "ray", "datatrove", "dedup.executor=ray", "dedup.tasks=2",
                      "dedup.ray.mem_gb=1")
    finally:
        ray.shutdown()
    assert stats["engine"]["executor"] == "ray"
    assert_same_folder(tmp_path / "ray", ref, stats, ref_stats)
