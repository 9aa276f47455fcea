#!/usr/bin/env python3
"""A stand-in for Slurm's sbatch, srun, scontrol, squeue and scancel (tests/test_dedup_datatrove_executors.py):
enough of each for datatrove's SlurmPipelineExecutor, run on this machine.

sbatch runs a job script at once, every index of its `#SBATCH --array=0-N` in turn (SLURM_ARRAY_TASK_ID,
SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_NODELIST set; output to its --output file, %A and %a filled), and
records the job's state: COMPLETED when every index exited 0, else FAILED.  A job whose --dependency names
an afterok job that did not complete never runs: it stays PENDING with reason DependencyNeverSatisfied, as
a real cluster leaves it (until scancel).  State lives in $FAKE_SLURM_DIR: jobs.jsonl has one line per
submission (id, name, array size, state, dependency, whether it is datatrove's stats-merging job).  srun runs its command; $FAKE_SLURM_FAIL lists "jobname:index"
tasks whose srun exits 1 instead, a task lost on a node.  Linked as sbatch, srun, scontrol, squeue, scancel.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

STATE = Path(os.environ.get("FAKE_SLURM_DIR", "/tmp/fake_slurm"))


def jobs() -> list[dict]:
    path = STATE / "jobs.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def save(all_jobs: list[dict]) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in all_jobs))


def sbatch(args: list[str]) -> int:
    script_path = args[-1]
    script = Path(script_path).read_text()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", script, flags=re.MULTILINE))
    export = next((a.split("=", 1)[1] for a in args if a.startswith("--export=")), "ALL")
    dependency = next((a.split("=", 1)[1] for a in args if a.startswith("--dependency=")),
                      options.get("dependency", ""))   # on the command line, or in the script
    all_jobs = jobs()
    job_id = str(1000 + len(all_jobs))
    first, last = map(int, re.match(r"(\d+)-(\d+)", options.get("array", "0-0")).groups())
    job = {"id": job_id, "name": options.get("job-name", ""), "array": last - first + 1, "state": "RUNNING",
           "dependency": dependency, "merge_stats": "merge_stats " in script}
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / f"{job_id}.sh").write_text(script)   # datatrove deletes its file when sbatch returns
    state = {j["id"]: j["state"] for j in all_jobs}
    needs = [d.split(":", 1) for d in dependency.split(",") if d]
    if any(kind == "afterok" and state.get(dep) != "COMPLETED" for kind, dep in needs):
        job.update(state="PENDING", reason="DependencyNeverSatisfied")
        save([*all_jobs, job])
        print(f"Submitted batch job {job_id}")
        return 0
    save([*all_jobs, job])
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_ARRAY_JOB_ID": job_id, "SLURM_NODELIST": "localhost",
           "SLURM_JOB_NAME": job["name"]}
    for pair in export.split(",")[1:]:
        key, _, value = pair.partition("=")
        env[key] = value
    ok = True
    for index in range(first, last + 1):
        log = options.get("output", str(STATE / "%A_%a.out")).replace("%A", job_id).replace("%a", str(index))
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            code = subprocess.run(["bash", str(STATE / f"{job_id}.sh")], env={**env, "SLURM_ARRAY_TASK_ID": str(index)},
                                  stdout=fh, stderr=subprocess.STDOUT, check=False).returncode
        ok = ok and code == 0
    all_jobs = jobs()
    next(j for j in all_jobs if j["id"] == job_id)["state"] = "COMPLETED" if ok else "FAILED"
    save(all_jobs)
    print(f"Submitted batch job {job_id}")
    return 0


def srun(args: list[str]) -> int:
    rest = list(args)
    while rest and rest[0].startswith("-"):   # srun's own options: -l, -n N, --opt=value
        flag = rest.pop(0)
        if flag in ("-n", "-N") and rest:
            rest.pop(0)
    lost = os.environ.get("FAKE_SLURM_FAIL", "").split(",")
    if f"{os.environ.get('SLURM_JOB_NAME')}:{os.environ.get('SLURM_ARRAY_TASK_ID')}" in lost:
        print("fake srun: this task's node was lost", file=sys.stderr)
        return 1
    return subprocess.run(rest, check=False).returncode


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2:]) or "localhost")
    return 0


def squeue(args: list[str]) -> int:
    wanted = set(args[args.index("-j") + 1].split(",")) if "-j" in args else None
    for j in jobs():
        if j["state"] == "PENDING" and (wanted is None or j["id"] in wanted):
            print(f"{j['id']} {j.get('reason', 'None')}")
    return 0


def scancel(args: list[str]) -> int:
    all_jobs = jobs()
    for j in all_jobs:
        if j["id"] in args and j["state"] == "PENDING":
            j["state"] = "CANCELLED"
    save(all_jobs)
    return 0


if __name__ == "__main__":
    command = Path(sys.argv[0]).name
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "squeue": squeue,
              "scancel": scancel}[command](sys.argv[1:]))
