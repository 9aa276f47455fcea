"""CARE end to end: both stages through train.py and evaluate.py, re-runs, two processes, a user's errors."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _care_helpers import root, tiny, tower_calls, train_overrides  # noqa: F401  (root, tiny: fixtures)
from _export_helpers import assert_same_vectors
from safetensors.torch import load_file
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (the small CMedTEB-layout benchmark)
from transformers import AutoModel, AutoTokenizer

from care.config import load_config
from care.data.io import read_jsonl
from care.encoders import build_encoder, detect
from care.paths import PROJECT_ROOT
from care.training.care_recipe import run_care, stage_config

pytestmark = pytest.mark.usefixtures("one_thread")


def env(root: Path, **extra) -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "CARE_CACHE": str(root / "cache"), **extra}


# ---- 8. the commands a user types ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(root):
    """`python train.py model=care_tiny ...` with an empty CARE_CACHE: the towers built on first use, stage I,
    then stage II."""
    run = root / "run"
    cmd = [sys.executable, str(PROJECT_ROOT / "train.py"), *train_overrides(root, run), f"hydra.run.dir={root / 'hydra'}"]
    proc = subprocess.run(cmd, cwd=root, env=env(root, CARE_CACHE=str(root / "cli-cache")), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run, proc


def test_train_cli_runs_stage1_then_stage2(trained, root):
    run, proc = trained
    assert "[build_towers] wrote" in proc.stdout  # built on first use
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["final"] == str(run / "final")
    assert {s: summary["stages"][s]["step"] for s in ("stage1", "stage2")} == {"stage1": 4, "stage2": 3}
    logs = {s: [r for r in read_jsonl(run / s / "metrics.jsonl") if "loss/loss" in r] for s in ("stage1", "stage2")}
    assert [r["step"] for r in logs["stage1"]] == [1, 2, 3, 4] and [r["step"] for r in logs["stage2"]] == [1, 2, 3]
    assert all("loss/mse" in r for r in logs["stage1"]) and not any("loss/mse" in r for r in logs["stage2"])
    record = json.loads((run / "final" / "care_training.json").read_text())
    # paths relative to the run (stages) and to the folder (towers): the folder holds both towers
    assert record["stages"] == {s: f"{s}/final" for s in ("stage1", "stage2")}
    assert (record["model"]["query"]["path"], record["model"]["document"]["path"]) == ("query", "document")
    for side in ("query", "document"):  # the same files as stage II's, linked, not copied
        assert os.path.samefile(run / "final" / side / "model.safetensors", run / "stage2/final" / side / "model.safetensors")
    # stage II started from stage I's query tower, with its own recipe (hard negatives, LoRA)
    stage2 = record["config"]
    assert stage2["model"]["query"]["path"] == "query"  # provenance only, named without its local path
    assert str(root) not in json.dumps(record)  # no local path in a record
    # the start towers, named when stage I trained from them (stage II's query tower starts from stage I's)
    assert record["base_models"] == ["care-tiny/query", "care-tiny/document"]
    assert (stage2["trainer"]["group_size"], stage2["loss"]["temperature"]) == (4, 0.02)


def test_every_saved_folder_reloads(trained, root):
    run, _ = trained
    tiny = root / "cli-cache" / "models" / "care-tiny"
    for folder in (run / "stage1/final/query", run / "stage2/final/query", run / "stage2/final/document"):
        tok = AutoTokenizer.from_pretrained(folder)  # each model folder carries its tokenizer
        assert tok("头痛")["input_ids"] and AutoModel.from_pretrained(folder) is not None
    # stage I's folder holds the frozen start document tower, hard-linked: it loads alone
    assert os.path.samefile(run / "stage1/final/document/model.safetensors", tiny / "document" / "model.safetensors")
    assert (run / "stage2/final/document_adapter/adapter_config.json").is_file()
    encoders = {}
    for name in ("stage1/final", "stage2/final", "final"):
        config = detect(run / name, {})
        assert config["kind"] == "care"
        encoders[name] = enc = build_encoder(config, device="cpu")
        assert enc.encode_queries(["头痛怎么办"]).dense.shape == enc.encode_documents(["头痛"]).dense.shape == (1, 32)
    assert detect(run / "stage1/final", {})["document"]["path"] == str(run / "stage1/final/document")
    # final/ holds stage II's files (hard links): the same weights, so the same identity (docs/export.md)
    assert encoders["final"].fingerprint == encoders["stage2/final"].fingerprint
    assert encoders["stage1/final"].side_fingerprint("document") != encoders["final"].side_fingerprint("document")
    # stage II's saved towers are what trained: both moved from where stage II started
    start_query = load_file(run / "stage1/final/query/model.safetensors")
    query = load_file(run / "stage2/final/query/model.safetensors")
    assert max(float((query[k] - start_query[k]).abs().max()) for k in query) > 0
    start_document = load_file(tiny / "document" / "model.safetensors")
    document = load_file(run / "stage2/final/document/model.safetensors")
    assert max(float((document[k] - start_document[k]).abs().max()) for k in document) > 0


def test_care_folders_load_with_sentence_transformers_as_a_router(trained, tmp_path):
    run, _ = trained
    for name in ("stage1/final", "stage2/final", "final"):
        folder = run / name
        st = assert_same_vectors(folder, build_encoder(detect(folder, {}), device="cpu"), tmp_path)
        assert st["modules"] == ["Router"], name
        routes = json.loads((folder / "router_config.json").read_text())["structure"]
        # each route starts from its own tower; the document route ends in the cut to the query width
        assert (routes["query"][0], routes["document"][0]) == ("query", "document")
        assert routes["document"][-1].endswith("_Dense") and not routes["query"][-1].endswith("_Dense")


def test_a_copied_care_folder_loads_alone(trained, tmp_path, monkeypatch):
    run, _ = trained
    copy = shutil.copytree(run, tmp_path / "run")
    moved = {name: shutil.copytree(copy / name, tmp_path / "elsewhere" / name) for name in ("stage1/final", "final")}
    copy.rename(tmp_path / "gone")
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "empty-cache"))  # not even the start towers are reachable
    for name, folder in moved.items():
        ours = build_encoder(detect(folder, {}), device="cpu")
        original = build_encoder(detect(run / name, {}), device="cpu")
        assert (ours.encode_documents(["头痛"]).dense == original.encode_documents(["头痛"]).dense).all(), name
        assert_same_vectors(folder, ours, tmp_path)


def test_evaluate_cli_scores_the_final_model(trained, root, task_paths, tmp_path):
    run, _ = trained
    cmd = [sys.executable, "evaluate.py", f"ckpt={run / 'final'}", "baselines=[]",
           *overrides(task_paths, tmp_path, cmedqa2=False)]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env(root, CARE_OUTPUTS=str(tmp_path / "outputs")),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "eval" / "run_final" / "cmedteb"
    assert {p.stem for p in out.glob("*.json")} == {"cmed_v1", "cmed_v2", "retrieval", "rerank", "sts"}
    sts = json.loads((out / "sts.json").read_text())
    assert set(sts["scores"]) == {"dense", "dense/query+document"} and sts["table_method"] == "dense"
    assert sts["scores"]["dense"] != sts["scores"]["dense/query+document"]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    (row,) = summary["models"]
    query = load_file(run / "stage2/final/query/model.safetensors")
    assert row["name"] == "run/final"
    assert row["efficiency"]["online_parameters"] == sum(v.numel() for v in query.values())  # the query tower only


def test_a_rerun_skips_finished_stages(trained, root, capsys, monkeypatch):
    run, _ = trained
    monkeypatch.setenv("CARE_CACHE", str(root / "cli-cache"))  # the run's config, resolved the same
    logs = {s: (run / s / "metrics.jsonl").read_bytes() for s in ("stage1", "stage2")}
    calls = tower_calls(monkeypatch)
    summary = run_care(load_config("train", train_overrides(root, run)))
    printed = capsys.readouterr().out
    for stage in ("stage1", "stage2"):
        assert f"{stage}: {run / stage / 'final'} already holds the final model of this run" in printed
        assert (run / stage / "metrics.jsonl").read_bytes() == logs[stage]
    assert calls == {"query": 0, "document": 0}  # nothing loaded, encoded or trained
    assert summary["final"] == str(run / "final")
    assert detect(run / "final", {})["query"]["path"] == str(run / "final" / "query")


def test_stage2_without_stage1_says_what_to_do(root, tiny, tmp_path):
    cfg = load_config("train", train_overrides(root, tmp_path / "fresh", "model.stage=stage2"))
    with pytest.raises(FileNotFoundError, match=r"stage II starts from stage I's query tower, and .*fresh/stage1/final/"
                       r"query holds none: run stage I first \(model.stage=stage1, or model.stage=all\) or name one "
                       r"with model.stages.stage2.query_from=PATH"):
        run_care(cfg)
    assert not (tmp_path / "fresh" / "stage2").exists()
    # the override it names is one a user can type
    named = load_config("train", train_overrides(root, tmp_path / "fresh", "model.stage=stage2",
                                                 f"model.stages.stage2.query_from={tiny / 'query'}"))
    assert stage_config(named, "stage2", tmp_path / "fresh").model.query.path == str(tiny / "query")


# ---- 9. towers on the hub with the hub offline ----------------------------------------------------------

def test_hub_towers_offline_fail_fast_naming_both_and_the_overrides(root, tmp_path):
    hf = tmp_path / "hf"  # an empty hub cache: neither tower is there
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(PROJECT_ROOT / "train.py"), "model=care_0.3b_4b",
                           f"output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path,
                          env=env(root, HF_HOME=str(hf), HF_HUB_CACHE=str(hf / "hub")), capture_output=True,
                          text=True, timeout=120, check=False)
    seconds = time.perf_counter() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    for needle in ("Alibaba-NLP/gte-multilingual-base", "Qwen/Qwen3-Embedding-4B", "model.query.path=",
                   "model.document.path=", "HF_HUB_OFFLINE=1"):
        assert needle in proc.stderr, needle
    assert "Traceback" not in proc.stderr and seconds < 60
    assert not (tmp_path / "run").exists()


# ---- 7. two processes equal one --------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_equal_one_process_in_both_stages(root, tiny, tmp_path):
    """`python train.py model=care_tiny` under torchrun with 2 CPU processes (gloo; half of every batch each,
    negatives gathered; stage I then stage II in one launch, so the process group must outlive stage I) ends
    with the towers of 1 process holding both halves, in each stage.  Dropout off in both towers (the two
    layouts draw other masks) and float64 (see tests/test_resume.py::test_two_processes_equal_one_process);
    the logged loss and pre-clipping gradient norm of every step are compared too (AdamW would hide a wrong
    gradient scale)."""
    query = tmp_path / "query"
    shutil.copytree(tiny / "query", query)
    config = json.loads((query / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (query / "config.json").write_text(json.dumps(config))
    common = [*train_overrides(root, None), f"model.query.path={query}", "model.stages.stage2.lora.dropout=0.0",
              "model.stages.stage1.trainer.lr=1e-3", "model.stages.stage2.trainer.lr=1e-3", "++trainer.dtype=float64",
              f"hydra.run.dir={tmp_path / 'hydra'}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for launcher, per_process, run in ((torchrun, 1, "two"), ([sys.executable], 2, "one")):
        proc = subprocess.run([*launcher, str(PROJECT_ROOT / "train.py"), *common, f"output_dir={tmp_path / run}",
                               f"model.stages.stage1.trainer.batch_size={4 * per_process}",
                               f"model.stages.stage2.trainer.batch_size={2 * per_process}"], cwd=tmp_path,
                              env=env(root, ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=600,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for stage, steps in (("stage1", 4), ("stage2", 3)):
        logs = {run: [r for r in read_jsonl(tmp_path / run / stage / "metrics.jsonl") if "loss/loss" in r]
                for run in ("two", "one")}
        assert [r["step"] for r in logs["two"]] == [r["step"] for r in logs["one"]] == list(range(1, steps + 1))
        for key in ("loss/loss", "grad_norm"):
            assert [r[key] for r in logs["two"]] == pytest.approx([r[key] for r in logs["one"]], rel=1e-9), (stage, key)
    for folder, start in (("stage1/final/query/model.safetensors", query / "model.safetensors"),
                          ("stage2/final/query/model.safetensors", None),
                          ("stage2/final/document/model.safetensors", tiny / "document" / "model.safetensors"),
                          ("stage2/final/document_adapter/adapter_model.safetensors", None)):
        two, one = (load_file(tmp_path / run / folder) for run in ("two", "one"))
        assert next(iter(one.values())).dtype == torch.float64, folder  # it did train in float64
        assert max(float((two[k] - one[k]).abs().max()) for k in one) < 1e-10, folder
        if start is not None:  # it did train
            begin = load_file(start)
            assert max(float((one[k] - begin[k].double()).abs().max()) for k in begin) > 1e-5, folder
    record = json.loads((tmp_path / "two" / "final" / "care_training.json").read_text())
    assert record["stages"] == {s: f"{s}/final" for s in ("stage1", "stage2")}
    assert not list((tmp_path / "two").glob(".final.*"))  # written once, by the main process: no race left
