"""Training CARE's two towers (care.training.care_family, care_recipe, AsymmetricLoss, GradCache over two towers)
on tiny towers and real training texts: the loss against a plain formula, exact gradient caching, stage I's
frozen and cached document side, both stages through `python train.py model=care_tiny`, their folders in
evaluate.py, skipped re-runs, two processes against one, and the errors a user sees."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _training_helpers import make_training_files
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (the small CMedTEB-layout benchmark)
from transformers import AutoModel, AutoTokenizer

from care.config import load_config
from care.data.io import read_jsonl
from care.encoders import build_encoder, detect
from care.encoders.cache import EmbeddingCache, embed
from care.models.towers import Tower, TowerSpec
from care.paths import PROJECT_ROOT
from care.tools.build_towers import build_tiny
from care.training import gradcache
from care.training.care_family import CAREFamily
from care.training.care_recipe import run_care, stage_config
from care.training.gradcache import GradCache
from care.training.losses import AsymmetricLoss
from care.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

DOCUMENT = {"pooling": "last_token", "padding_side": "left", "append_eos": True, "max_length": 64}


@pytest.fixture(scope="module")
def root(tmp_path_factory, shared):
    """Training files (24 real cEpilepsyQA questions, their answers, 6 negatives each) and CARE_CACHE (built
    towers, embedding caches) in a temporary folder for the whole module, subprocesses included."""
    root = tmp_path_factory.mktemp("care-train")
    make_training_files(root, shared, n_questions=24)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CARE_CACHE", str(root / "cache"))
        yield root


@pytest.fixture(scope="module")
def tiny(root) -> Path:
    """The tiny towers where conf/model/care_tiny.yaml builds them on first use."""
    out = root / "cache" / "models" / "care-tiny"
    build_tiny(out)
    return out


def train_overrides(root: Path, run: Path | None, *extra: str) -> list[str]:
    return ["model=care_tiny", f"data.texts={root / 'texts.jsonl'}", f"data.examples={root / 'train.jsonl'}",
            *([f"output_dir={run}"] if run else []), "validation.task=null", *extra]


def env(root: Path, **extra) -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "CARE_CACHE": str(root / "cache"), **extra}


def tower_calls(monkeypatch) -> dict[str, int]:
    """Forwards of every Tower, by its folder's name (query / document), counted from now on."""
    calls = {"query": 0, "document": 0}
    forward = Tower.forward

    def counted(self, *args, **kwargs):
        calls[Path(self.spec.path).name] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Tower, "forward", counted)
    return calls


# ---- 6. the loss and GradCache ----------------------------------------------------------------------------

def reference_loss(q: np.ndarray, p: np.ndarray, group: int, temperature: float, mse_weight: float,
                   positive=lambda i, group: i * group) -> float:
    """CARE's loss written out with loops: InfoNCE over q.d / temperature, + mse_weight x the squared distance
    of each query to its positive, averaged over queries."""
    total = mse = 0.0
    for i in range(len(q)):
        scores = [float(q[i] @ p[j]) / temperature for j in range(len(p))]
        top = max(scores)
        log_sum = top + math.log(sum(math.exp(s - top) for s in scores))
        total += log_sum - scores[positive(i, group)]
        mse += sum((a - b) ** 2 for a, b in zip(q[i], p[positive(i, group)]))
    return total / len(q) + mse_weight * mse / len(q)


@pytest.mark.parametrize("group,mse_weight", [(1, 1.0), (3, 0.0), (3, 0.5)])
def test_asymmetric_loss_matches_the_formula(group, mse_weight):
    rng = np.random.default_rng(group)
    n = 5
    q = rng.normal(size=(n, 8))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    full = rng.normal(size=(n * group, 16))
    p = (full / np.linalg.norm(full, axis=1, keepdims=True))[:, :8]  # cut document vectors, norms below 1
    loss = AsymmetricLoss(temperature=0.05, mse_weight=mse_weight, group_size=group)
    out = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p)})
    expected = reference_loss(q, p, group, 0.05, mse_weight)
    assert float(out["loss"]) == pytest.approx(expected, rel=1e-12)
    assert ("mse" in out) == bool(mse_weight)
    if mse_weight:
        assert float(out["loss"]) == pytest.approx(float(out["infonce"]) + mse_weight * float(out["mse"]), rel=1e-12)
    # mixed precisions (stage I: float64 queries, float32 cached documents) give the same value
    mixed = loss({"dense": torch.from_numpy(q)}, {"dense": torch.from_numpy(p).float()})["loss"]
    assert mixed.dtype == torch.float64 and float(mixed) == pytest.approx(expected, rel=1e-6)
    if group > 1:  # the control: the formula tells the pool layout apart (positive i, not i x group)
        assert abs(reference_loss(q, p, group, 0.05, mse_weight, lambda i, g: i) - expected) > 1e-3


def test_asymmetric_loss_refuses_widths_and_pools_that_do_not_fit():
    loss = AsymmetricLoss(group_size=2)
    with pytest.raises(ValueError, match="query vectors are 8-d, document vectors 16-d"):
        loss({"dense": torch.zeros(2, 8)}, {"dense": torch.zeros(4, 16)})
    with pytest.raises(ValueError, match="pool of 3 passages does not fit 2 queries x group size 2"):
        loss({"dense": torch.zeros(2, 8)}, {"dense": torch.zeros(3, 8)})
    with pytest.raises(ValueError, match="temperature must be > 0"):
        AsymmetricLoss(temperature=0)


QUERIES = ["癫痫病人可以怀孕吗", "头痛发烧怎么办", "孩子咳嗽有痰吃什么药", "高血压能治愈吗"]
PASSAGES = ["癫痫患者在医生指导下可以怀孕", "胃疼吃什么药", "失眠怎么调理",
            "发烧头痛可以先物理降温，多喝水", "腰疼是肾的问题吗", "感冒流鼻涕怎么办",
            "小儿咳嗽有痰可以拍背，遵医嘱用药", "糖尿病人能吃西瓜吗", "肚子胀气怎么办",
            "高血压需要长期服药控制", "脚踝扭伤怎么处理", "眼睛干涩怎么办"]


def two_towers(tiny: Path, lora: bool):
    """A float64 query tower (dropout 0.1) and document tower, cut to 32-d: with a LoRA (dropout 0.1, non-zero
    B so every adapter weight gets a gradient) or fully trainable."""
    query = Tower.load(TowerSpec(path=str(tiny / "query")), "model.query", torch.float64).train()
    document = Tower.load(TowerSpec(path=str(tiny / "document"), **DOCUMENT), "model.document", torch.float64)
    document.truncate_dim = 32
    if lora:
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        document = CAREFamily._with_lora(document, {"r": 4, "alpha": 8, "dropout": 0.1},
                                         OmegaConf.create({"gradient_checkpointing": False}))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in document.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.1)
    return query, document.train()


def grads(*towers) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad.clone() for i, t in enumerate(towers) for n, p in t.named_parameters() if p.requires_grad}


def run_both(tiny: Path, lora: bool, chunk: int = 5):
    """(losses, grads) of plain autograd over the whole pool and of GradCache, from the same towers and RNG.
    The reference forwards the same chunks in the same order (query chunks, then passage chunks)."""
    loss_fn = AsymmetricLoss(temperature=0.05, mse_weight=0.5, group_size=3)
    results = []
    for cached in (False, True):
        query, document = two_towers(tiny, lora)
        qb, pb = query.tokenize(QUERIES), document.tokenize(PASSAGES)
        torch.manual_seed(7)
        if cached:
            losses = GradCache(loss_fn, chunk_size=chunk).step(query, qb, pb, passage_model=document)
        else:
            def forward(m, batch):
                outs = [m(**{k: v[s:s + chunk] for k, v in batch.items()})["dense"]
                        for s in range(0, len(batch["input_ids"]), chunk)]
                return {"dense": torch.cat(outs)}
            out = loss_fn(forward(query, qb), forward(document, pb))
            out["loss"].backward()
            losses = {k: float(v.detach()) for k, v in out.items()}
        results.append((losses, grads(query, document)))
    return results


@pytest.mark.parametrize("lora", [True, False], ids=["lora_document", "trainable_document"])
def test_gradcache_over_two_towers_equals_the_plain_step(tiny, lora):
    (ref_loss, ref), (gc_loss, got) = run_both(tiny, lora)
    for k in ("loss", "infonce", "mse"):
        assert gc_loss[k] == pytest.approx(ref_loss[k], rel=1e-12), k
    assert set(got) == set(ref)
    if lora:  # the document tower trains only its adapter, on every projection
        document = [n for n in ref if n.startswith("1.")]
        assert document and all("lora_" in n for n in document)
    assert any(n.startswith("0.") for n in ref)
    for name in ref:
        assert float(ref[name].abs().max()) > 0, name
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)


def test_gradcache_over_two_towers_needs_the_rng_restored(tiny, monkeypatch):
    """The control of the test above: both towers draw dropout masks, so without restoring the RNG state per
    chunk the re-forward draws other masks and the gradients of both towers are wrong."""
    monkeypatch.setattr(gradcache.RngState, "restore", lambda self: None)
    (_, ref), (_, got) = run_both(tiny, lora=True)
    for tower in ("0.", "1."):
        worst = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in ref if n.startswith(tower))
        assert worst > 1e-3, tower


# ---- 4. stage I ---------------------------------------------------------------------------------------

def stage1_trainer(root: Path, tiny: Path, run: Path) -> Trainer:
    cfg = load_config("train", train_overrides(root, None, f"model.query.path={tiny / 'query'}",
                                               f"model.document.path={tiny / 'document'}", "++trainer.dtype=float64"))
    return Trainer(stage_config(cfg, "stage1", run))


def test_stage1_freezes_the_document_tower_and_never_runs_it_in_the_loop(root, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache"))  # an empty embedding cache
    calls = tower_calls(monkeypatch)
    trainer = stage1_trainer(root, tiny, tmp_path / "run")
    family = trainer.family
    n_texts = len(family.row)
    # before step 1: every training text encoded once by the document tower, into the embedding cache
    assert calls["document"] == math.ceil(n_texts / 64) and (family.cache.misses, family.cache.hits) == (n_texts, 0)
    document, query = family.document_tower, family.query_module
    assert query.model.dtype == torch.float64 and family.document_module.table.dtype == torch.float32
    in_loop = []
    document.model.register_forward_hook(lambda *a: in_loop.append(1))
    start = {k: v.clone() for k, v in document.model.state_dict().items()}
    query_start = {k: v.clone() for k, v in query.state_dict().items()}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(p.requires_grad for p in document.parameters())
    assert not any(id(p) in optimized for p in document.parameters())
    assert {id(p) for p in query.parameters()} <= optimized
    calls.update(query=0, document=0)

    summary = trainer.fit()
    assert summary["step"] == 4 and in_loop == [] and calls["document"] == 0 and calls["query"] > 0
    assert all(torch.equal(v, start[k]) for k, v in document.model.state_dict().items())  # bit-identical
    assert any(not torch.equal(v, query_start[k]) for k, v in query.state_dict().items())  # the query tower learned
    losses = [r for r in read_jsonl(tmp_path / "run" / "stage1" / "metrics.jsonl") if "loss/loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4] and all(r["loss/mse"] > 0 for r in losses)
    # the control: the hook does see the document tower when it runs
    family.encoder(trainer.unwrapped(), None).encode_documents(["头痛"])
    assert in_loop == [1]

    # A second stage I over the same texts takes every document vector from the cache: no forward at all.
    calls.update(query=0, document=0)
    again = stage1_trainer(root, tiny, tmp_path / "again").family
    assert calls["document"] == 0 and (again.cache.misses, again.cache.hits) == (0, n_texts)
    assert torch.equal(again.document_module.table, family.document_module.table)


def test_stage1_validation_encodes_queries_afresh(root, tiny, tmp_path, monkeypatch):
    """The query tower trains under the fingerprint of its start folder: a cached query vector would be stale
    at the next validation.  Stage I's cache serves the frozen document side only."""
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache"))
    cfg = load_config("train", train_overrides(root, tmp_path / "run", f"model.query.path={tiny / 'query'}",
                                               f"model.document.path={tiny / 'document'}"))
    family = CAREFamily(stage_config(cfg, "stage1", tmp_path / "run"))
    encoder = family.encoder([family.query_module, family.document_module], None)
    texts = ["癫痫病人可以怀孕吗", "头痛发烧怎么办"]

    def both(cache):
        return (embed(encoder, texts, "query", cache, show_progress=False).dense,
                embed(encoder, texts, "document", cache, show_progress=False).dense)

    plain = EmbeddingCache(tmp_path / "plain")
    q0, d0 = both(family.cache)
    p0, _ = both(plain)
    with torch.no_grad():  # a training step's worth of change
        for p in family.query_module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hits = family.cache.hits
    q1, d1 = both(family.cache)
    assert np.abs(q1 - q0).max() > 1e-4 and np.array_equal(d1, d0) and family.cache.hits == hits + len(texts)
    p1, _ = both(plain)
    assert np.array_equal(p1, p0)  # the control: an ordinary cache serves the stale query vectors


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
    assert record["stages"] == {s: str(run / s / "final") for s in ("stage1", "stage2")}
    assert record["model"]["query"]["path"] == str(run / "stage2" / "final" / "query")
    assert record["model"]["document"]["path"] == str(run / "stage2" / "final" / "document")
    # stage II started from stage I's query tower, with its own recipe (hard negatives, LoRA)
    stage2 = record["config"]
    assert stage2["model"]["query"]["path"] == str(run / "stage1" / "final" / "query")
    assert (stage2["trainer"]["group_size"], stage2["loss"]["temperature"]) == (4, 0.02)


def test_every_saved_folder_reloads(trained, root):
    run, _ = trained
    tiny = root / "cli-cache" / "models" / "care-tiny"
    for folder in (run / "stage1/final/query", run / "stage2/final/query", run / "stage2/final/document"):
        tok = AutoTokenizer.from_pretrained(folder)  # each model folder carries its tokenizer
        assert tok("头痛")["input_ids"] and AutoModel.from_pretrained(folder) is not None
    assert not (run / "stage1/final/document").exists()  # stage I references the frozen start
    assert (run / "stage2/final/document_adapter/adapter_config.json").is_file()
    encoders = {}
    for name in ("stage1/final", "stage2/final", "final"):
        config = detect(run / name, {})
        assert config["kind"] == "care"
        encoders[name] = enc = build_encoder(config, device="cpu")
        assert enc.encode_queries(["头痛怎么办"]).dense.shape == enc.encode_documents(["头痛"]).dense.shape == (1, 32)
    assert detect(run / "stage1/final", {})["document"]["path"] == str(tiny / "document")
    assert encoders["final"].fingerprint == encoders["stage2/final"].fingerprint
    assert encoders["stage1/final"].side_fingerprint("document") != encoders["final"].side_fingerprint("document")
    # stage II's saved towers are what trained: both moved from where stage II started
    start_query = load_file(run / "stage1/final/query/model.safetensors")
    query = load_file(run / "stage2/final/query/model.safetensors")
    assert max(float((query[k] - start_query[k]).abs().max()) for k in query) > 0
    start_document = load_file(tiny / "document" / "model.safetensors")
    document = load_file(run / "stage2/final/document/model.safetensors")
    assert max(float((document[k] - start_document[k]).abs().max()) for k in document) > 0


def test_evaluate_cli_scores_the_final_model(trained, root, task_paths, tmp_path):  # noqa: F811
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
    assert json.loads((run / "final" / "care_training.json").read_text())["model"]["query"]["path"] == \
        str(run / "stage2" / "final" / "query")


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
    assert record["stages"] == {s: str(tmp_path / "two" / s / "final") for s in ("stage1", "stage2")}
    assert not list((tmp_path / "two").glob(".final.*"))  # written once, by the main process: no race left
