# ruff: noqa: F811  (fixtures imported from other test modules are named as test parameters)
"""No folder the project writes names the machine it was written on: every JSON, JSON Lines, YAML and
README.md of every folder kind (training runs of each family, their final/, tuned/ and checkpoint model
folders, CARE's towers; an evaluation out_dir; the pipeline's stage folders; a Nano folder; mteb results),
each built here from the tiny fixtures with the output and cache roots in a temporary folder, holds no
string (key or value) containing the checkout root, the temporary roots, the cache or output root, the
shared data root or the home folder, and none that is an absolute path.  The reference is those roots
themselves and a plain pattern for an absolute path, not the project's own path helpers."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml
from _care_helpers import train_overrides
from _training_helpers import make_training_files, train_config
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: a fixture)
from test_mteb_adapter import mteb_cache  # noqa: F401  (a fixture: mteb's result folder in tmp)
from test_mteb_results import tasks  # noqa: F401  (a fixture: two small project tasks)
from test_nano_stage import _cfg as nano_config
from test_nano_stage import beir  # noqa: F401  (beir: a fixture)

from care.config import load_config
from care.paths import PROJECT_ROOT, shared_data

pytestmark = pytest.mark.usefixtures("one_thread")

# an absolute path: a slash that starts a token, then two or more path parts (/tmp/x, /work/main/outputs)
ABSOLUTE = re.compile(r"(?<![\w.:/~-])/[\w.@+-]+/[\w.@+-]+")
SUFFIXES = (".json", ".jsonl", ".yaml", ".yml")
SKIP = {".run.lock.json"}  # the lock's holder record (its command line) lives only while the run holds the lock


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _values(path: Path):
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        return _strings(json.loads(text))
    if path.suffix == ".jsonl":
        return (s for line in text.splitlines() if line.strip() for s in _strings(json.loads(line)))
    if path.suffix in (".yaml", ".yml"):
        return _strings(yaml.safe_load(text))
    return text.splitlines()


def machine_paths(folder: Path, roots: list[str]) -> list[str]:
    hits = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name not in SKIP and (path.suffix in SUFFIXES or path.name == "README.md"):
            for s in _values(path):
                if any(r in s for r in roots) or ABSOLUTE.search(s):
                    hits.append(f"{path.relative_to(folder)}: {s[:160]}")
    return hits


@pytest.fixture(scope="module")
def folders(tmp_path_factory, shared, tiny_bert_dir, task_paths, beir):
    """Every folder kind, under one temporary root that is also CARE_OUTPUTS and CARE_CACHE's parent."""
    from omegaconf import OmegaConf, open_dict

    from care.training.care_recipe import run_care
    from care.training.trainer import Trainer
    from data_pipeline import build, import_stage, mining
    from data_pipeline.dedup import stage as dedup_stage
    from data_pipeline.nano import stage as nano_stage
    from evaluate import evaluate

    root = tmp_path_factory.mktemp("machine")
    out, cache = root / "outputs", root / "cache"
    took = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CARE_OUTPUTS", str(out))
        mp.setenv("CARE_CACHE", str(cache))
        texts, train = make_training_files(root, shared, n_questions=16, n_negs=3)
        t = time.perf_counter()
        steps = ["trainer.max_steps=2", "trainer.epochs=1", "trainer.checkpoint_every=1", "trainer.query_side_pools=[]"]
        Trainer(train_config(root, texts, train, "outputs/train/m3", *steps)).fit()
        Trainer(train_config(root, texts, train, "outputs/train/dense", "model=tiny_bert", f"model.path={tiny_bert_dir}",
                             "model.pooling=mean", "trainer.merge_with_start=0.5", *steps)).fit()
        took["m3 + dense runs"] = time.perf_counter() - t
        t = time.perf_counter()
        run_care(load_config("train", train_overrides(root, out / "train" / "care", "model.stages.stage1.trainer.max_steps=2",
                                                      "model.stages.stage2.trainer.max_steps=2")))
        took["care run"] = time.perf_counter() - t
        t = time.perf_counter()
        evaluate(load_config("evaluate", overrides(task_paths, root, f"ckpt={out / 'train' / 'm3' / 'final'}",
                                                   "baselines=[bm25]", f"out_dir={out / 'eval' / 'm3'}",
                                                   f"cache.dir={cache / 'embeddings'}", cmedqa2=False)))
        took["evaluation"] = time.perf_counter() - t
        t = time.perf_counter()
        cfg = load_config("data_pipeline", [
            f"out_root={out}", f"cache_root={cache}", "dedup.stages=[exact,minhash]", "model=tiny_bert",
            f"model.path={tiny_bert_dir}", "mine.top_k=20", "mine.min_negatives=2", "mine.max_negatives=3", "mine.window=[0.3,0.99]"])
        with open_dict(cfg):  # cEpilepsyQA alone: its rule and its two evaluation sets
            cfg.data.sources = OmegaConf.create({"cepilepsyqa": cfg.data.sources.cepilepsyqa})
            cfg.build.rules = [r for r in cfg.build.rules if r.source == "cepilepsyqa"]
            cfg.build.rules[0].max_examples = 60
            cfg.build.eval_sets = [e for e in cfg.build.eval_sets if e.source == "cepilepsyqa"]
        for stage in (import_stage, dedup_stage, build, mining):
            stage.run(cfg)
        took["import, dedup, build, mine"] = time.perf_counter() - t
        t = time.perf_counter()
        nano_stage.run(nano_config(beir, out / "data" / "nano" / "NanoSmall", tiny_bert_dir, cache / "nano"))
        took["nano"] = time.perf_counter() - t
    print(took)
    return {"root": root, "out": out, "cache": cache}


@pytest.fixture(scope="module")
def mteb_results(folders, tasks, tiny_bert_dir, mteb_cache):
    """mteb's result folder for a dense model on two small project tasks (test_mteb_results.py's `tasks`)."""
    from care.encoders import build_encoder
    from care.evaluation.mteb_adapter import MtebEncoder, mteb_evaluate

    t = time.perf_counter()
    dense = build_encoder({"kind": "dense", "name": "tiny_bert", "path": str(tiny_bert_dir), "max_length": 64},
                          device="cpu")
    mteb_evaluate(MtebEncoder(dense), tasks, results=folders["out"] / "mteb")
    print({"mteb": time.perf_counter() - t})
    return folders["out"] / "mteb"


def test_no_written_json_yaml_or_readme_names_the_machine(folders, mteb_results, tmp_path_factory):
    roots = sorted({str(PROJECT_ROOT), str(tmp_path_factory.getbasetemp()), str(folders["out"]), str(folders["cache"]),
                    str(shared_data()), str(Path.home()), os.path.realpath("/tmp")})
    kinds = {"m3 run": folders["out"] / "train" / "m3", "dense run": folders["out"] / "train" / "dense",
             "CARE run": folders["out"] / "train" / "care", "evaluation": folders["out"] / "eval" / "m3",
             "stage folders": folders["out"] / "data", "built towers": folders["cache"] / "models",
             "mteb results": mteb_results}
    for kind, folder in kinds.items():
        assert any(folder.rglob("*.json")), f"{kind}: nothing written at {folder}"
    hits = {kind: machine_paths(folder, roots) for kind, folder in kinds.items()}
    assert not any(hits.values()), json.dumps(hits, indent=1, ensure_ascii=False)


def test_no_committed_result_file_names_the_machine():
    """bench/results and docs/results are committed; a file there that records the folders it read (compare.json's
    runs) names them as the project does.  `}` before a slash is a Hydra interpolation (${data_dir}/mined), no path."""
    in_text = re.compile(r"(?<![\w.:/~}-])/[\w.@+-]+/[\w.@+-]+")
    files = [p for d in ("bench/results", "docs/results") for p in sorted((PROJECT_ROOT / d).iterdir())
             if p.suffix in (".json", ".jsonl", ".md")]
    hits = {p.name: found for p in files if (found := in_text.findall(p.read_text(encoding="utf-8")))}
    assert files and not hits, hits
