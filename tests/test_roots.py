"""One output root and one cache root (conf/roots.yaml): every app composed with out_root=DIR and
cache_root=DIR2 names no path under the default outputs or cache folder, Hydra's own run and sweep folders
included, so an app cannot read stale data from the default place while the user set another."""
from __future__ import annotations

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
