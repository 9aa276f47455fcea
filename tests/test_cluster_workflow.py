"""The cluster workflow of docs/cluster.md, with no cluster and no wandb server.

- conf/hydra/launcher/slurm.yaml: hydra-submitit-launcher's own SlurmLauncher turns it into the sbatch
  script submitit would submit (partition, nodes, GPUs and tasks per node, time, setup lines), one job per
  combination; only `sbatch` itself is not called.
- A real multirun, `python train.py -m hydra/launcher=submitit_local ... seed=0,1`: two jobs that submitit
  runs as subprocesses, each training the tiny model into its own Hydra job folder; and one job of two
  tasks, which must be one run of two processes (skipped until train.py exports submitit's
  TorchDistributedEnvironment, docs/cluster.md).
- sweeps/*.yaml: wandb's own sweep-config validation (the `sweeps` engine behind `wandb sweep
  --controller`), and every run the engine proposes, turned into its command line by wandb's own agent code
  and composed with the Hydra compose API.
"""
from __future__ import annotations

import json
import os
import pickle
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from _training_helpers import make_training_files
from omegaconf import OmegaConf

from care.config import CONF_DIR, ROOT_KEYS, load_config
from care.data.io import read_jsonl
from care.paths import PROJECT_ROOT

SWEEPS = sorted((PROJECT_ROOT / "sweeps").glob("*.yaml"))
TRAIN = PROJECT_ROOT / "train.py"
# Whether train.py gives each task of a submitit job its RANK / WORLD_SIZE / MASTER_ADDR (docs/cluster.md,
# "One job on several GPUs or nodes"): submitit's own helper for it.
DOCS = PROJECT_ROOT / "docs" / "cluster.md"


def docs_command(prefix: str) -> list[str]:
    """The one command of docs/cluster.md that starts with `prefix` (a line, or a line continued with \\)."""
    text = DOCS.read_text(encoding="utf-8").replace("\\\n", " ")
    found = [line.strip() for line in text.splitlines() if line.strip().startswith(prefix)]
    assert len(found) == 1, f"docs/cluster.md: {len(found)} commands start with {prefix!r}"
    return shlex.split(found[0])


def jobs_of(overrides: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of a multirun's overrides (its own expansion)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


# ---- Slurm -----------------------------------------------------------------------------------------------

def test_the_slurm_launcher_writes_one_sbatch_job_per_combination(tmp_path, monkeypatch):
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from submitit.slurm.slurm import SlurmExecutor

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}", "trainer=multi_gpu",
                                "hydra.launcher.partition=a100", "hydra.launcher.nodes=2",
                                "hydra.launcher.gpus_per_node=8", "hydra.launcher.tasks_per_node=8"],
                      return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__module__ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher"
    launcher.setup(hydra_context=None, task_function=None, config=cfg)  # launch() reads only the config

    class Submitted(Exception):
        pass

    submitted = {}

    def map_array(executor, fn, *args):  # where submitit would call sbatch
        submitted.update(executor=executor, jobs=list(zip(*args)))
        raise Submitted

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # "srun is on PATH"
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    jobs = jobs_of(["trainer.lr=1e-5,2e-5", "seed=0,1"])
    with pytest.raises(Submitted):
        launcher.launch(jobs, initial_job_idx=0)
    assert [job[0] for job in submitted["jobs"]] == jobs and len(jobs) == 4
    slurm = submitted["executor"]._executor
    script = slurm._make_submission_file_text("python -u -m submitit.core._submit X", "u")
    for line in ("#SBATCH --partition=a100", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64GB",
                 "#SBATCH --time=1440", "#SBATCH --job-name=",
                 "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
                 "export TOKENIZERS_PARALLELISM=false"):
        assert line in script, line
    assert script.index("export HF_HUB_OFFLINE") < script.index("srun")  # setup runs before the tasks
    assert f"{tmp_path}/.submitit/" in script  # logs and pickles beside the sweep's job folders


def test_the_documented_slurm_multirun_composes():
    """docs/cluster.md's `python train.py -m hydra/launcher=slurm ...`: four jobs, each a valid config."""
    argv = docs_command("python train.py -m hydra/launcher=slurm")
    jobs = jobs_of([a for a in argv[2:] if a != "-m"])
    assert len(jobs) == 4
    for job in jobs:
        cfg = load_config("train", job)
        assert cfg.seed in (0, 1) and cfg.trainer.lr in (1e-5, 2e-5)
        assert OmegaConf.to_container(cfg)["output_dir"] == "${hydra:runtime.output_dir}"  # its own folder


# ---- a real multirun with the local submitit launcher ----------------------------------------------------

def local_multirun(tmp_path: Path, sweep: Path, model: Path, texts: Path, train: Path, *overrides: str,
                   job_folders: bool = True):
    """`python train.py -m hydra/launcher=submitit_local ...` on the tiny model, 2 steps, each job training in
    its Hydra job folder (<sweep>/<job number>), or (job_folders=False) where train.py puts it by itself."""
    cmd = [sys.executable, str(TRAIN), "-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}",
           *(["output_dir=${hydra:runtime.output_dir}"] if job_folders else []), "model=tiny_bert", f"model.path={model}",
           f"data.texts={texts}", f"data.examples={train}", "trainer.max_steps=2", "trainer.group_size=2",
           "trainer.chunk_size=null", "trainer.query_max_length=32", "trainer.passage_max_length=48",
           "trainer.lr=5e-4", *overrides]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CARE_OUTPUTS": str(tmp_path / "outputs")}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.slow
def test_a_local_submitit_multirun_trains_one_run_per_seed(tmp_path, shared, tiny_bert_dir):
    """Two jobs (seed=0,1) that submitit starts as subprocesses, like Slurm jobs; each trains the tiny model
    in its own Hydra job folder and returns val/best, the number a sweep optimises."""
    import torch

    from care.training.validation import ensure_dev_task

    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    dev = ensure_dev_task(load_config("train", [f"validation.task={tmp_path / 'dev.jsonl'}"]).validation)
    sweep = tmp_path / "multirun"
    local_multirun(tmp_path, sweep, tiny_bert_dir, texts, train, f"validation.task={dev}",
                   "validation.max_queries=3", "validation.every_steps=2", "trainer.batch_size=8", "seed=0,1")

    results = {}
    for path in sorted(sweep.glob(".submitit/*/*_0_result.pkl")):  # submitit's own record of each job
        status, job = pickle.loads(path.read_bytes())
        assert status == "success", job
        results[job.hydra_cfg.hydra.job.num] = job
    assert sorted(results) == [0, 1]  # two jobs, two submitit job folders
    rows, weights = {}, {}
    for num, job in results.items():
        folder = sweep / str(num)
        assert f"seed={num}" in job.overrides
        assert (folder / ".hydra" / "overrides.yaml").exists()
        assert {"model.safetensors", "care_training.json"} <= {p.name for p in (folder / "final").iterdir()}
        rows[num] = list(read_jsonl(folder / "metrics.jsonl"))
        assert [r["step"] for r in rows[num] if "val/best" in r] == [0, 2]
        # wandb's summary of a run is its last logged value: the last val/best is what the job returned
        assert job.return_value == [r["val/best"] for r in rows[num] if "val/best" in r][-1]
        (state,) = (folder / "checkpoints").glob("step-0000002/state.pt")  # the trained weights
        weights[num] = list(tensors(torch.load(state, weights_only=True)["model"]))
    losses = {num: [r["loss/loss"] for r in rows[num] if "loss/loss" in r] for num in rows}
    assert len(losses[0]) == len(losses[1]) == 2 and losses[0] != losses[1]  # another seed, another run
    assert len(weights[0]) == len(weights[1]) > 0
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))


@pytest.mark.slow
def test_one_job_of_two_tasks_is_one_run_of_two_processes(tmp_path, shared, tiny_bert_dir):
    """tasks_per_node=2: submitit starts two processes (as srun does two tasks), and they are the two ranks
    of one DDP run (gloo on CPU), as under torchrun: one checkpoint written by 2 processes."""
    import torch

    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    sweep = tmp_path / "multirun"
    local_multirun(tmp_path, sweep, tiny_bert_dir, texts, train, "hydra.launcher.tasks_per_node=2",
                   "validation.task=null", "trainer.batch_size=4", "seed=0")
    assert len(list(sweep.glob(".submitit/*/*_result.pkl"))) == 2  # two tasks ran
    step = sweep / "0" / "checkpoints" / "step-0000002"
    assert torch.load(step / "state.pt", weights_only=True)["num_processes"] == 2
    assert sorted(p.name for p in step.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
    assert [r["step"] for r in read_jsonl(sweep / "0" / "metrics.jsonl") if "loss/loss" in r] == [1, 2]


def tensors(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors(value)
    elif hasattr(state, "shape"):
        yield state


# ---- wandb sweeps ----------------------------------------------------------------------------------------

def spec_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))  # as `wandb sweep` reads it


def violations(spec: dict) -> list[str]:
    """wandb's own sweep-config validation (what `wandb sweep --controller` runs before creating a sweep)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sweeps 0.2 configures pydantic with v1 names
        import sweeps

        return sweeps.schema_violations_from_proposed_config(spec)


def test_there_are_the_two_sweeps():
    methods = {spec_of(p)["method"]: spec_of(p) for p in SWEEPS}
    assert set(methods) == {"grid", "bayes"}
    assert set(methods["grid"]["parameters"]) == {"trainer.group_size", "seed"}
    assert methods["grid"]["parameters"]["trainer.group_size"]["values"] == [1, 2, 4, 8]  # in-batch, 1, 3, 7
    assert set(methods["bayes"]["parameters"]) == {"trainer.lr", "loss.temperature.dense", "data.dir"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_each_sweep_spec_validates(path):
    spec = spec_of(path)
    assert violations(spec) == []
    assert violations({**spec, "method": "grod"}) != []  # the validator does look
    assert spec["program"] == "train.py" and (PROJECT_ROOT / spec["program"]).exists()
    assert "${args_no_hyphens}" in spec["command"]  # parameters reach train.py as Hydra overrides
    # the number train.py logs to wandb and returns (the last val/best is the best validation so far)
    assert spec["metric"] == {"name": "val/best", "goal": "maximize"}


def plain(value):
    return value.item() if hasattr(value, "item") else value  # numpy scalars from the engine


def proposed_runs(spec: dict) -> list[dict]:
    """Grid: every combination, in the order wandb's engine schedules them.  Bayes: each categorical value
    with the ranges' ends, then proposals of the engine (its Gaussian process, fed made-up results)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sweeps

        config, runs = sweeps.SweepConfig(spec), []
        while len(runs) < 40 and (run := sweeps.next_run(config, runs)) is not None:
            run.state, run.name = sweeps.RunState.finished, f"r{len(runs)}"
            run.summary_metrics = {spec["metric"]["name"]: (len(runs) * 0.37) % 1}
            runs.append(run)
            if spec["method"] != "grid" and len(runs) == 6:
                break
    proposals = [{k: plain(v["value"]) for k, v in run.config.items()} for run in runs]
    if spec["method"] == "grid":
        return proposals
    ranges = {k: p for k, p in spec["parameters"].items() if "min" in p}
    choices = {k: p["values"] for k, p in spec["parameters"].items() if "values" in p}
    (key, values), = choices.items()  # the bayes sweep has one categorical parameter: the window
    ends = [{key: value, **{k: r[end] for k, r in ranges.items()}}
            for value in values for end in ("min", "max")]
    return ends + proposals


def agent_command(spec: dict, values: dict, run_id: str, tmp_path: Path, monkeypatch) -> list[str]:
    """The command line `wandb agent` starts for one run: wandb's own Agent._command_run, with the process
    start replaced by a recorder."""
    from wandb import wandb_agent

    started = []

    def record(command=None, env=None, **kw):
        started.append(command)
        return SimpleNamespace()

    monkeypatch.setattr(wandb_agent, "AgentProcess", record)
    for name, value in (("WANDB_DIR", str(tmp_path)), ("WANDB_SWEEP_ID", "sweep0"), ("WANDB_RUN_ID", ""),
                        ("WANDB_SWEEP_PARAM_PATH", "")):
        monkeypatch.setenv(name, value)  # the agent sets the last two itself: restored after the test
    agent = wandb_agent.Agent(api=None, queue=None, sweep_id="sweep0")
    agent._sweep_command = list(spec["command"])
    agent._command_run({"run_id": run_id, "program": spec["program"],
                        "args": {k: {"value": v} for k, v in values.items()}})
    return started[-1]


def resolved_in_roots(value, app_config: dict):
    """A sweep value as the app resolves it: ${data_dir} etc. against the app's roots (conf/roots.yaml)."""
    return OmegaConf.to_container(OmegaConf.create({"v": value, **{k: app_config[k] for k in ROOT_KEYS}}),
                                  resolve=True)["v"]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_sweep_run_composes(path, tmp_path, monkeypatch):
    spec = spec_of(path)
    runs = proposed_runs(spec)
    if spec["method"] == "grid":
        sizes = [len(p["values"]) for p in spec["parameters"].values()]
        assert len(runs) == sizes[0] * sizes[1] and len({tuple(sorted(r.items())) for r in runs}) == len(runs)
    folders = set()
    for i, values in enumerate(runs):
        run_id = f"run{i}"
        command = agent_command(spec, values, run_id, tmp_path, monkeypatch)
        assert command[:3] == ["/usr/bin/env", "python", "train.py"]
        cfg = load_config("train", command[3:])  # with WANDB_RUN_ID / WANDB_SWEEP_ID as the agent sets them
        resolved = OmegaConf.to_container(cfg, resolve=True)
        for key, value in values.items():
            want = resolved_in_roots(value, resolved)
            assert OmegaConf.select(OmegaConf.create(resolved), key) == want, (key, command)
        if "loss.temperature.dense" in values:  # one temperature for the three heads
            assert len(set(resolved["loss"]["temperature"].values())) == 1
        assert resolved["wandb"]["mode"] == "online" and run_id in resolved["run_name"]
        folders.add(resolved["output_dir"])
    assert len(folders) == len(runs)  # every run trains in a folder of its own


def test_the_sweep_windows_are_the_documented_mining_runs():
    """The bayes sweep's data.dir values are the folders docs/cluster.md's mining multirun writes, one per
    window, in the same order (composed with the pipeline's own config)."""
    argv = docs_command("python -m data_pipeline -m stage=mine")
    out_dirs = [load_config("data_pipeline", job).mine.out_dir for job in jobs_of(argv[4:])]
    assert len(out_dirs) == 4
    bayes = next(spec_of(p) for p in SWEEPS if spec_of(p)["method"] == "bayes")
    values = bayes["parameters"]["data.dir"]["values"]
    roots = OmegaConf.to_container(load_config("train"), resolve=True)
    assert [resolved_in_roots(v, roots) for v in values] == out_dirs
    for job in jobs_of(argv[4:]):
        window = load_config("data_pipeline", job).mine.window
        assert list(window) in ([0.4, 0.7], [0.5, 0.8], [0.6, 0.85], [0.7, 0.9])


@pytest.mark.slow
def test_the_bare_multirun_gives_each_job_its_own_run_folder(tmp_path, shared, tiny_bert_dir):
    """The issue's command shape, `train.py -m ... trainer.lr=a,b` with no output_dir or run_name: two jobs,
    two run folders under outputs/train/<run_name>/<sweep time>/<job number> (train.py per_job_output_dir)."""
    texts, train = make_training_files(tmp_path, shared, n_questions=12)
    local_multirun(tmp_path, tmp_path / "multirun", tiny_bert_dir, texts, train, "validation.task=null",
                   "trainer.max_steps=1", "trainer.batch_size=4", "trainer.lr=1e-5,2e-5", job_folders=False)
    finals = sorted((tmp_path / "outputs" / "train").glob("*/*/*/final"))
    assert [p.parent.name for p in finals] == ["0", "1"] and finals[0].parent.parent == finals[1].parent.parent
    lrs = [json.loads((p / "care_training.json").read_text())["config"]["trainer"]["lr"] for p in finals]
    assert sorted(lrs) == [1e-5, 2e-5]


@pytest.mark.slow
def test_an_experiment_that_names_its_runs_keeps_its_folders_and_a_rerun_skips_them(tmp_path, shared,
                                                                                       tiny_bert_dir):
    """An experiment whose run_name tells its jobs apart (`named-s${seed}`, as the ablations' experiments
    do) trains each job into outputs/train/<run_name>/, so the same sweep run again finds each run finished
    and skips it, where a folder per sweep time would train everything again."""
    texts, train = make_training_files(tmp_path, shared, n_questions=12)
    experiments = tmp_path / "conf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "named.yaml").write_text("# @package _global_\nrun_name: named-s${seed}\n")
    sweep = ["experiment=named", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "validation.task=null",
             "trainer.max_steps=1", "trainer.batch_size=4", "seed=0,1"]
    local_multirun(tmp_path, tmp_path / "multirun", tiny_bert_dir, texts, train, *sweep, job_folders=False)
    weights = sorted((tmp_path / "outputs" / "train").glob("*/final/model.safetensors"))
    assert [p.parent.parent.name for p in weights] == ["named-s0", "named-s1"]
    written = [p.stat().st_mtime_ns for p in weights]
    local_multirun(tmp_path, tmp_path / "multirun2", tiny_bert_dir, texts, train, *sweep, job_folders=False)
    assert [p.stat().st_mtime_ns for p in weights] == written  # both skipped, nothing trained again
    assert sorted((tmp_path / "outputs" / "train").glob("*/*/*/final")) == []  # no folder per sweep time
