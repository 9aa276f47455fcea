"""The inference backend default (care/encoders/onnx_backend.py resolve_backend, care/encoders/registry.py
build_encoder): on the CPU with onnxruntime installed, an app builds every model ONNX Runtime fp32 (a dense
model, an M3 checkpoint's backbone, a CARE query tower), exported once per model folder and cached; every
evaluation number equals the torch path's to the printed digit; torch and ONNX vectors never share a cache
key; `backend=torch` (the app's setting) or a model config's own `backend:` overrides; training builds torch.
The reference is the same evaluation run with backend=torch (the path every score was made with before),
read back from its summary.json and printed table, and the count of exports the backend module made."""
from __future__ import annotations

import json
import re

import pytest
from _care_helpers import model_config, towers  # noqa: F401  (towers: a fixture)
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: a fixture)

from care.config import load_config
from care.encoders import build_encoder, onnx_backend

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    from care.models.m3 import tiny_m3

    return tiny_m3().save(tmp_path_factory.mktemp("m3") / "tiny_m3")


@pytest.fixture(autouse=True)
def own_cache_root(tmp_path, monkeypatch):
    """Exports go under the cache root (care.paths.cache_dir): each test its own, so counts start at none."""
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache_root"))


def run(paths, tmp_path, capsys, name: str, *extra: str) -> tuple[dict, str]:
    from evaluate import evaluate

    out = tmp_path / name
    evaluate(load_config("evaluate", overrides(paths, tmp_path, "efficiency.enabled=false", f"out_dir={out}",
                                               f"cache.dir={tmp_path / 'embeddings'}", *extra)))
    printed = capsys.readouterr().out
    return json.loads((out / "summary.json").read_text(encoding="utf-8")), printed


def numbers(summary: dict) -> list:
    """Every score of every row (all metrics of all methods) and every gain interval, rounded to 2 decimals as
    the table prints them (scores are percentages there; the per-method metrics fractions, to 4)."""
    rows = []
    for r in summary["models"]:
        scores = {k: round(v, 2) for k, v in r["scores"].items()}
        methods = {t: {m: {k: round(v, 4) for k, v in ms.items()} for m, ms in per.items()}
                   for t, per in r["methods"].items()}
        gain = json.dumps(r.get("gain"), sort_keys=True)
        rows.append((r["name"], scores, methods, re.sub(r"(\d+\.\d{2})\d+", r"\1", gain)))
    return rows


def differences(a: dict, b: dict) -> list:
    return [(x[0], k, x[i][k], y[i][k]) for x, y in zip(numbers(a), numbers(b)) for i in (1, 2)
            for k in x[i] if x[i][k] != y[i][k]] + [(x[3], y[3]) for x, y in zip(numbers(a), numbers(b)) if x[3] != y[3]]


def table(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("model", ["tiny_bert", "m3"])
def test_auto_is_onnx_on_the_cpu_and_every_number_equals_torch(task_paths, tiny_bert_dir, m3_dir, tmp_path,  # noqa: F811
                                                               capsys, model):
    # tiny_bert mean-pooled: its CLS vectors (random weights) are all alike, every STS cosine within 3e-5 of 1, so
    # float32 noise moves that cell in torch alone (batch 1 against 32: 49.02 / 49.04); mean pooling spreads them
    pick = [f"ckpt={m3_dir}"] if model == "m3" else ["model=tiny_bert", f"model.path={tiny_bert_dir}",
                                                     "model.pooling=mean"]
    torch_summary, torch_printed = run(task_paths, tmp_path, capsys, "torch", *pick, "baselines=[bm25]",
                                       "device=cpu", "backend=torch")
    auto_summary, auto_printed = run(task_paths, tmp_path, capsys, "auto", *pick, "baselines=[bm25]", "device=cpu")
    assert onnx_backend.EXPORTS >= 1
    assert numbers(auto_summary) == numbers(torch_summary), differences(auto_summary, torch_summary)
    assert table(auto_printed) == table(torch_printed)
    # the two backends' vectors are keyed apart: the auto run found none of torch's in the shared cache
    row = {r["name"]: r for r in auto_summary["models"]}
    encoded = row[auto_summary["models"][0]["name"]]["encoded"]
    assert encoded["query"] > 0 and encoded["document"] > 0
    assert auto_summary["models"][0]["fingerprint"] != torch_summary["models"][0]["fingerprint"]
    assert re.search(r"encoded \d+ query and \d+ document texts", auto_printed)


def test_the_export_is_made_once_per_model_folder(tiny_bert_dir, m3_dir, tmp_path):
    first = onnx_backend.EXPORTS
    for _ in range(2):
        dense = build_encoder({"kind": "dense", "path": str(tiny_bert_dir)}, device="cpu")
        m3 = build_encoder({"kind": "m3", "path": str(m3_dir)}, device="cpu")
    assert (dense.backend, m3.backend) == ("onnx", "onnx")
    assert onnx_backend.EXPORTS - first == 2  # one per folder, the second load of each read the cached file
    exports = sorted((tmp_path / "cache_root" / "onnx").glob("*/model.onnx"))
    assert len(exports) == 2


def test_torch_and_onnx_vectors_have_different_keys(tiny_bert_dir, m3_dir):
    for model in ({"kind": "dense", "path": str(tiny_bert_dir)}, {"kind": "m3", "path": str(m3_dir)}):
        onnx, torch_ = (build_encoder(model, device="cpu", backend=b) for b in ("auto", "torch"))
        assert (onnx.backend, torch_.backend) == ("onnx", "torch")
        for side in ("query", "document"):
            assert onnx.side_fingerprint(side) != torch_.side_fingerprint(side)
            assert "backend" not in torch_.identity(side)  # torch keys: the ones cached before backends existed


def test_a_care_query_tower_is_onnx_its_document_tower_torch(towers):  # noqa: F811
    c = model_config(towers / "seed0" / "query", towers / "seed0" / "document")
    onnx, torch_ = (build_encoder(c, device="cpu", backend=b) for b in ("auto", "torch"))
    assert (onnx.backend, torch_.backend) == ("onnx", "torch")
    assert onnx.side_fingerprint("query") != torch_.side_fingerprint("query")
    assert onnx.side_fingerprint("document") == torch_.side_fingerprint("document")  # torch both ways


def test_one_session_runs_every_batch_as_one_thread_slices_with_the_same_vectors(tiny_bert_dir, monkeypatch):
    """With 2 torch threads an fp32 model has ONE ONNX Runtime session, of one intra-op thread (a second,
    many-thread session held a second copy of the weights: docs/models.md "Memory"); a batch of 2 rows or more
    runs as 2 slices at once in it, one row alone.  Every vector equals, bit for bit, the whole batch run in
    one piece by the same session (the reference), and torch's to 1e-5; texts of different lengths, so the
    slices carry padding."""
    import numpy as np
    import onnxruntime as ort
    import torch

    made, real = [], ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: made.append(a[1].intra_op_num_threads) or real(*a, **k))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        enc = build_encoder({"kind": "dense", "path": str(tiny_bert_dir)}, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert made == [1]  # one session, one thread
    forward = enc._onnx
    assert forward.workers == 2
    runs, run = [], forward.session.run
    forward.session.run = lambda *a, **k: runs.append(len(a[1]["input_ids"])) or run(*a, **k)
    texts = [("word " * (1 + i % 7)).strip() + f" {i}" for i in range(11)]
    sliced = enc.encode_documents(texts, batch_size=8).dense
    assert sorted(runs) == [1, 2, 4, 4]  # the batch of 8 as 4 + 4, the last 3 texts as 1 + 2
    runs.clear()
    enc.encode_documents(texts[:1])
    assert runs == [1]
    forward.workers = 1  # the reference: each batch whole, in the same session
    whole = enc.encode_documents(texts, batch_size=8).dense
    np.testing.assert_array_equal(sliced, whole)
    torch_ = build_encoder({"kind": "dense", "path": str(tiny_bert_dir)}, device="cpu", backend="torch")
    np.testing.assert_allclose(sliced, torch_.encode_documents(texts, batch_size=8).dense, rtol=0, atol=1e-5)


def test_torch_overrides_and_the_rule(tiny_bert_dir, monkeypatch):
    model = {"kind": "dense", "path": str(tiny_bert_dir)}
    assert build_encoder(model, device="cpu", backend="torch").backend == "torch"  # the app's backend=torch
    assert build_encoder({**model, "backend": "torch"}, device="cpu").backend == "torch"  # the model's own
    assert onnx_backend.resolve_backend("auto", "cuda") == "torch"  # a GPU runs torch
    assert onnx_backend.resolve_backend("auto", "cpu") == "onnx"
    monkeypatch.setattr(onnx_backend, "missing_packages", lambda: ["onnxruntime"])
    assert onnx_backend.resolve_backend("auto", "cpu") == "torch"  # no onnxruntime: torch


def test_training_builds_torch(m3_dir):
    """Training's validation wraps the live model (care/training/model.py M3Family.encoder): torch, and an
    ONNX backend on a live model is refused (its export would hold weights that training then changes)."""
    from care.encoders.m3 import M3Encoder
    from care.models.m3 import M3Model

    live = M3Model.load(m3_dir)
    assert M3Encoder(str(m3_dir), model=live, device="cpu").backend == "torch"
    with pytest.raises(ValueError, match="a live training model runs torch"):
        M3Encoder(str(m3_dir), model=live, device="cpu", backend="onnx")
