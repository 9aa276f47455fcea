"""One output root and one cache root (conf/roots.yaml): every app composed with out_root=DIR and
cache_root=DIR2 names no path under the default outputs or cache folder, Hydra's own run and sweep folders
included, so an app cannot read stale data from the default place while the user set another.  The same for
the Makefile (`make -n <target>` for every target, the roots moved by CARE_OUTPUTS/CARE_CACHE or by
OUT_ROOT=/CACHE_ROOT=, names no `outputs/` or `.cache/` default path, and its recipes' environment hands the
moved roots to every app) and for the study CLI, whose default --out lies under the moved outputs root.  The
reference: the default folders as care/paths.py names them, and the moved folders the test chose."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from care.config import CONF_DIR, load_config
from care.evaluation import entries
from care.paths import PROJECT_ROOT, cache_dir, outputs_dir

MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
BENCHMARKS = sorted(p.stem for p in (CONF_DIR / "benchmark").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))

COMPOSITIONS = (
    [("train", [f"model={m}"]) for m in MODELS]
    + [("train", [f"experiment={e}"]) for e in EXPERIMENTS]
    + [("train", ["trainer=gpu"]), ("train", ["trainer=multi_gpu", "hydra/launcher=slurm"])]
    + [("evaluate", [f"benchmark={b}", f"model={m}"]) for b in BENCHMARKS for m in ("me5_small", "care_me5")]
    + [("encode", ["benchmark=cmedteb_open", "benchmark@extra_benchmark=cmedqa2_retrieval", f"model={m}"])
       for m in MODELS]
    + [("data_pipeline", [f"model={m}"]) for m in MODELS]
    + [("data_pipeline", ["stage=nano", "input=/elsewhere/task"])]
)


def _resolved(node):
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


@pytest.fixture
def default_roots(monkeypatch):
    """The default folders the apps must not touch (the environment variables unset: the project's own)."""
    monkeypatch.delenv("CARE_OUTPUTS", raising=False)
    monkeypatch.delenv("CARE_CACHE", raising=False)
    return str(outputs_dir()), str(cache_dir())


@pytest.mark.parametrize("app,overrides", COMPOSITIONS, ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_every_app_follows_the_roots(app, overrides, tmp_path, default_roots):
    out, cache = tmp_path / "out", tmp_path / "cache"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=app, overrides=[f"out_root={out}", f"cache_root={cache}", *overrides],
                      return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.job.num = 0  # what a running app has: ${hydra:job.name} and ${hydra:job.num} resolve
        HydraConfig.instance().set_config(cfg)
        resolved = {k: _resolved(cfg[k]) for k in cfg if k != "hydra"}
        # Hydra's own folders (its logging config needs a live run): the run and sweep folders and the launcher's
        resolved["hydra"] = {k: _resolved(cfg.hydra[k]) for k in ("run", "sweep", "launcher") if k in cfg.hydra}
    paths = [s for s in strings(resolved) if s.startswith("/")]
    stale = [s for s in paths if s.startswith(default_roots)]
    assert not stale, f"{app} {overrides} still names the default folders: {stale}"
    assert resolved["hydra"]["run"]["dir"].startswith(f"{out}/hydra/")
    assert resolved["hydra"]["sweep"]["dir"].startswith(f"{out}/multirun/")
    assert resolved["data_dir"] == f"{out}/data"
    if app != "data_pipeline":
        assert any(p.startswith(str(out)) for p in paths) and any(p.startswith(str(cache)) for p in paths)


def test_the_roots_are_named_in_one_place():
    """${paths:outputs} and ${paths:cache} (the environment's defaults) appear only in conf/roots.yaml."""
    offenders = [str(p.relative_to(PROJECT_ROOT)) for p in [*CONF_DIR.rglob("*.yaml"), *(PROJECT_ROOT / "sweeps").glob("*.yaml")]
                 if p.name != "roots.yaml" and ("${paths:outputs}" in p.read_text() or "${paths:cache}" in p.read_text())]
    assert offenders == []


def test_baselines_resolve_under_the_run_roots(tmp_path, default_roots):
    """evaluate.py's baseline rows compose conf/model/<name>.yaml under the run's roots (not the defaults)."""
    cfg = OmegaConf.to_container(load_config("evaluate", [f"cache_root={tmp_path}", "model=tiny_bert",
                                                          "baselines=[bm25,me5_small]"]), resolve=True)
    rows = {e["name"]: e for e in entries.model_entries(cfg)}
    assert Path(rows["me5_small"]["model"]["path"]) == tmp_path / "models" / "multilingual-e5-small-q4"
    assert Path(rows["tiny_bert"]["model"]["path"]) == tmp_path / "models" / "tiny-bert"


def test_train_reads_the_cache_the_user_moved(tmp_path, default_roots):
    """CARE's stage I takes its document vectors from cache.dir, under cache_root as encode.py writes them."""
    cfg = load_config("train", ["model=care_tiny", f"cache_root={tmp_path}"])
    assert cfg.cache.dir == encode_cache_dir(tmp_path) == str(tmp_path / "embeddings")


def encode_cache_dir(root: Path) -> str:
    return load_config("encode", [f"cache_root={root}"]).cache.dir


# ---- the Makefile and the CLIs that are not Hydra apps ---------------------------------------------------------

MAKEFILE = PROJECT_ROOT / "Makefile"
TARGETS = sorted({t for line in re.findall(r"^\.PHONY:((?:.*\\\n)*.*)$", MAKEFILE.read_text(), re.MULTILINE)
                  for t in line.replace("\\\n", " ").split()})
# A default folder named relatively (`outputs/train/...`, `rm -rf outputs`, `.cache/models`), not as part of
# a longer path (`/tmp/x/outputs` is a moved root, `docs/results` is not a root at all).
RELATIVE_DEFAULT = re.compile(r"(?<![\w./-])(outputs|\.cache)(?![\w.-])")


def make(*args: str, env: dict) -> str:
    """make's standard output; the test's own CARE_OUTPUTS / CARE_CACHE never decide."""
    base = {k: v for k, v in os.environ.items() if k not in ("CARE_OUTPUTS", "CARE_CACHE", "OUT_ROOT", "CACHE_ROOT")}
    proc = subprocess.run(["make", "--no-print-directory", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=60, check=False, env={**base, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def moved_roots(how: str, tmp_path: Path) -> tuple[list[str], dict, Path, Path]:
    """(make arguments, environment, outputs root, cache root): the roots moved by the environment variables
    every app reads, or by the Makefile's own OUT_ROOT= / CACHE_ROOT= on the command line; `spaces`: the
    latter, with roots whose names hold a space and Chinese characters."""
    out, cache = tmp_path / "moved-out", tmp_path / "moved-cache"
    if how == "env":
        return [], {"CARE_OUTPUTS": str(out), "CARE_CACHE": str(cache)}, out, cache
    if how == "spaces":
        out, cache = tmp_path / "数据 out", tmp_path / "模型 缓存"
    return [f"OUT_ROOT={out}", f"CACHE_ROOT={cache}"], {}, out, cache


def shell_words(commands: str) -> list[list[str]]:
    """`make -n`'s commands as the shell splits them (continued lines joined, comments dropped)."""
    return [shlex.split(line, comments=True) for line in commands.replace("\\\n", " ").splitlines()]


@pytest.mark.parametrize("how", ["env", "make", "spaces"])
@pytest.mark.parametrize("target", TARGETS)
def test_every_make_target_follows_the_roots(target, how, tmp_path):
    """`make -n <target>` with the roots moved names no default folder (`make run` trained into the moved
    root and then evaluated `outputs/train/...`: a failure, or an older run's score), and hands each path
    under a root to the shell as one word, to a Hydra app as a quoted override value (`"ckpt='/d/数据 out/...'"`:
    Hydra's grammar refuses an unquoted space or Chinese character)."""
    args, env, out, cache = moved_roots(how, tmp_path)
    commands = make("-n", "-B", target, *args, env=env)  # -B: every prerequisite's commands too, setup's included
    stale = [line.strip() for line in commands.splitlines()
             if RELATIVE_DEFAULT.search(line) or str(PROJECT_ROOT / "outputs") in line
             or str(PROJECT_ROOT / ".cache") in line]
    assert not stale, f"make {target} with the roots moved still names the default folders:\n" + "\n".join(stale)
    for words in shell_words(commands):
        for word in words:
            for root in (out, cache):
                if root.name.split()[0] in word:
                    assert str(root) in word, f"make {target} splits the root {root}: {words}"
                    key, _, value = word.partition("=")
                    if value and not key.startswith("-"):  # a Hydra override: key='value'
                        assert value.startswith("'") and value.endswith("'"), f"make {target}: {word} unquoted"
    if target == "run":
        assert f"\"ckpt='{out}/train/cpu_default-me5_small/final'\"" in commands


@pytest.mark.parametrize("how", ["env", "make"])
def test_make_hands_the_roots_to_every_app(how, tmp_path):
    """What the apps read (CARE_OUTPUTS, CARE_CACHE: care/paths.py) in a recipe's environment is the moved
    roots, so an app without out_root= on its command line (compare, study, tradeoff, build_me5, bench)
    follows them too."""
    args, env, out, cache = moved_roots(how, tmp_path)
    shown = make("-s", "--eval", "show-roots: ; @echo $$CARE_OUTPUTS $$CARE_CACHE", "show-roots", *args, env=env)
    assert shown.split() == [str(out), str(cache)]


def test_the_study_cli_writes_under_the_moved_root(tmp_path, monkeypatch):
    """`python -m care.training.study RUNS` without --out writes under CARE_OUTPUTS/compare, not ./outputs."""
    from care.training.study import main

    run = tmp_path / "runs" / "care_study-base-s0"
    run.mkdir(parents=True)
    rows = [{"step": 0, "val/map_cut_10": 0.1}, {"step": 1, "val/map_cut_10": 0.2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.setenv("CARE_OUTPUTS", str(tmp_path / "moved-out"))
    monkeypatch.chdir(tmp_path)  # a relative default would land here
    main([str(run)])
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("study.json"))
    assert len(written) == 1 and written[0].parts[:2] == ("moved-out", "compare"), written


# ---- nothing under the user's home ---------------------------------------------------------------------------

@pytest.mark.parametrize("user_value", [None, "0"])
def test_importing_the_project_keeps_onnxruntime_out_of_home(tmp_path, user_value):
    """A fresh interpreter in a user's environment (no CI variable, which onnxruntime's telemetry reads as 'off')
    imports the project, asks whether the ONNX backend can run (the import every app makes on the CPU) and
    imports onnxruntime: ORT_DISABLE_TELEMETRY=1 is set, and nothing appears under HOME (onnxruntime 1.32 writes
    ~/.cache/Microsoft/DeveloperTools/.onnxruntime/{deviceid,onnxruntime.db} without it).  A value the user set
    themselves is kept (then the user asked for telemetry, and its files are theirs)."""
    pytest.importorskip("onnxruntime")
    from _home_helpers import user_env

    home = tmp_path / "home"
    home.mkdir()
    env = user_env(home, **({} if user_value is None else {"ORT_DISABLE_TELEMETRY": user_value}))
    code = ("import os, care; from care.encoders.onnx_backend import onnx_available; import onnxruntime; "
            "assert onnx_available(); print(os.environ['ORT_DISABLE_TELEMETRY'])")
    run = subprocess.run([sys.executable, "-c", code], check=False, cwd=PROJECT_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == (user_value or "1")
    if user_value is None:
        assert sorted(home.rglob("*")) == []


# ---- an out_root that cannot be written ----------------------------------------------------------------------

@pytest.mark.parametrize(("app", "mode"), [("evaluate.py", "run"), ("train.py", "sweep"),
                                           ("-m data_pipeline", "run")])
def test_an_out_root_that_cannot_be_written_is_one_line(tmp_path, app, mode):
    """Hydra makes its run / sweep folder under out_root before the app's error edge: an out_root below a file
    (ENOTDIR; a read-only mount, EROFS, takes the same path: care.hydra_callbacks.RunFolderCheck) ends in one line
    naming the folder, exit status 1, no traceback, nothing written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("mine", encoding="utf-8")
    root = blocker / "out"
    command = [sys.executable, *app.split(), *(["-m", "seed=0,1"] if mode == "sweep" else []), f"out_root={root}"]
    run = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    shown = "python -m data_pipeline" if app.startswith("-m") else app
    assert run.returncode == 1, run.stderr[-2000:]
    folder = root / ("hydra" if mode == "run" else "multirun")
    assert re.fullmatch(re.escape(f"{shown}: error: cannot write Hydra's {mode} folder under out_root={root}: "
                                  f"{folder}") + r"(/[\w.]+)?" + re.escape(": Not a directory; choose a writable "
                                                                         "out_root= (or CARE_OUTPUTS)"),
                        run.stderr.strip()), run.stderr
    assert blocker.read_text(encoding="utf-8") == "mine"


def test_a_training_run_writes_nothing_under_home(tmp_path, shared):
    """train.py (2 steps of the tiny M3, wandb offline as by default, its curves plotted) in a user's
    environment with HOME a temporary folder: matplotlib's font cache and wandb's debug logs go under the
    cache root (MPLCONFIGDIR, WANDB_CACHE_DIR set on import), onnxruntime writes no device id: HOME stays
    empty (without the switches: ~/.cache/matplotlib/fontlist-*.json and ~/.cache/wandb/logs/*.log)."""
    from _home_helpers import user_env
    from _training_helpers import make_training_files

    from care.models.m3 import tiny_m3

    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    tiny_m3().save(tmp_path / "tiny-m3")
    env = user_env(home, CARE_CACHE=str(cache), WANDB_MODE="offline", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "train.py", "model=tiny_m3", f"model.path={tmp_path / 'tiny-m3'}", f"data.texts={texts}",
           f"data.examples={train}", f"out_root={tmp_path / 'out'}", "validation.task=null", "trainer.max_steps=2",
           "trainer.batch_size=8", "trainer.group_size=3"]
    run = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "out" / "train" / "cpu_default-tiny_m3" / "curves.png").is_file()
    assert sorted(home.rglob("*")) == []
    assert any((cache / "matplotlib").iterdir()) and (cache / "wandb").is_dir()
