"""The online path of a CARE query tower in ONNX Runtime (`model.query.backend: onnx`, care/encoders/care.py).

The rule for offering it: the same evaluation numbers to 4 decimals as the torch path, on real tasks (the
`samples` fixture of conftest.py: KUAKE-QTR retrieval, cMedIR reranking, KUAKE-QQR STS), and the same
vectors to fp32 tolerance, with the ONNX session (not the torch model) doing the query side's work.  Speed is
measured in bench/latency_bench.py, never here.
"""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import numpy as np
import pytest
from _care_helpers import model_config, root, texts, towers  # noqa: F401  (root, texts, towers: fixtures)

from care.data.tasks import load_task
from care.encoders import build_encoder
from care.evaluation.tasks import run_reranking, run_retrieval, run_sts
from care.retrieval.scorer import EncoderScorer

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_thread")

RETRIEVAL = ["ndcg_cut_10", "map_cut_10", "recall_100", "mrr_1000", "acc_5"]
RERANKING = ["map_cut_10", "ndcg_cut_10", "mrr_1000"]


@pytest.fixture(scope="module")
def spread(towers):
    """Query towers (the tiny BERT of care_tiny, 32-d, its tokenizer) initialised wide (std 0.5), seeds 0 and
    1: on the STS texts their CLS cosines spread over ~0 to 1 (std ~0.2).  care_tiny's own query tower puts
    every instruction-prefixed query at cosine 1 +- 3e-7, so its STS correlation ranks fp32 rounding and no
    backend comparison could mean anything there."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    source = towers / "seed0" / "query"
    for seed in (0, 1):
        config = BertConfig.from_pretrained(source)
        config.initializer_range = 0.5
        torch.manual_seed(seed)
        BertModel(config, add_pooling_layer=False).save_pretrained(towers / f"spread{seed}")
        AutoTokenizer.from_pretrained(source).save_pretrained(towers / f"spread{seed}")
    return towers


def care(towers, backend: str = "torch", query: str = "spread0", **options):
    c = model_config(towers / query, towers / "seed0" / "document")
    c["query"] = {**c["query"], **options, **({"backend": backend} if backend else {})}
    return build_encoder(c, device="cpu")


@pytest.fixture(scope="module")
def torch_enc(spread):
    return care(spread)


@pytest.fixture(scope="module")
def onnx_enc(spread):
    return care(spread, "onnx")


def evaluation(enc, samples) -> dict:
    """Every metric of the three task types on the real samples, flattened to {task/method/metric: value}."""
    scorer = EncoderScorer(enc, heads=["dense"], show_progress=False)
    runs = {"retrieval": run_retrieval(load_task("retrieval", samples["retrieval"]), scorer, RETRIEVAL),
            "reranking": run_reranking(load_task("reranking", samples["reranking"]), scorer, RERANKING),
            "sts": run_sts(load_task("sts", samples["sts"]), scorer)}
    return {f"{task}/{method}/{m}": v for task, got in runs.items() for method, ms in got.items() for m, v in ms.items()}


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_onnx_query_vectors_equal_torch_and_the_session_does_the_work(spread, texts, pooling):
    torch_enc, onnx_enc = care(spread, pooling=pooling), care(spread, "onnx", pooling=pooling)
    calls = []
    onnx_enc.towers["query"].model.register_forward_hook(lambda *a: calls.append(1))
    session_runs, run = [], onnx_enc._onnx.session.run
    onnx_enc._onnx.session.run = lambda *a, **k: session_runs.append(1) or run(*a, **k)
    for batch_size in (4, 1):  # padded batches (sorted by length) and one text at a time, the online case
        ref = torch_enc.encode_queries(texts, batch_size=batch_size, task="retrieval").dense
        got = onnx_enc.encode_queries(texts, batch_size=batch_size, task="retrieval").dense
        assert got.shape == ref.shape == (len(texts), torch_enc.towers["query"].dim)
        np.testing.assert_allclose(got, ref, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalised after the session
        # every two texts differ by far more than the tolerance allows
        assert min(np.abs(got[i] - got[j]).max() for i in range(len(got)) for j in range(i)) > 1e-2
    assert calls == [] and len(session_runs) == 3 + len(texts)  # the torch backbone never ran; ONNX did
    # the document side runs torch in both: the very same vectors
    assert np.array_equal(onnx_enc.encode_documents(texts, batch_size=4).dense,
                          torch_enc.encode_documents(texts, batch_size=4).dense)
    assert onnx_enc.online_parameters == torch_enc.online_parameters


def test_evaluation_scores_equal_to_4_decimals(spread, samples, torch_enc, onnx_enc):
    ref, got = evaluation(torch_enc, samples), evaluation(onnx_enc, samples)
    assert set(got) == set(ref) and len(ref) == len(RETRIEVAL) + len(RERANKING) + 2 * 2  # STS: both layouts
    assert {k: round(v, 4) for k, v in got.items()} == {k: round(v, 4) for k, v in ref.items()}
    assert all(0 < v <= 1 for k, v in ref.items() if not k.startswith("sts/"))  # not a table of zeros
    # the vectors behind them: close, and spread (STS ranks query-query cosines: they must not all be ~1)
    sts = load_task("sts", samples["sts"])
    sentences = list(dict.fromkeys(t for pair in sts.pairs for t in pair))
    q = torch_enc.encode_queries(sentences, task="sts").dense
    np.testing.assert_allclose(onnx_enc.encode_queries(sentences, task="sts").dense, q, atol=1e-5)
    assert (q @ q.T)[np.triu_indices(len(q), 1)].std() > 0.05
    # the control: another query tower moves the scores at 4 decimals, so the comparison above can fail
    other = evaluation(care(spread, query="spread1"), samples)
    assert sum(round(other[k], 4) != round(ref[k], 4) for k in ref) >= len(ref) // 2


def test_the_backend_keys_the_query_side_only(torch_enc, onnx_enc, spread):
    assert onnx_enc.side_fingerprint("query") != torch_enc.side_fingerprint("query")
    assert onnx_enc.side_fingerprint("document") == torch_enc.side_fingerprint("document")  # its cache stays
    assert "backend" not in torch_enc.identity("query") and "backend" not in onnx_enc.identity("document")
    # torch, said or not, is the same key: query vectors cached before backends existed stay valid
    assert care(spread, "torch").side_fingerprint("query") == torch_enc.side_fingerprint("query")
    assert (onnx_enc.backend, torch_enc.backend) == ("onnx", "torch")  # what the mteb adapter reads


@pytest.mark.parametrize(("side", "backend", "message"), [
    ("query", "onnx_int8", r"^unknown CARE query backend model\.query\.backend='onnx_int8' \(choose torch or onnx"),
    ("query", "tensorrt", r"^unknown CARE query backend model\.query\.backend='tensorrt'"),
    ("document", "onnx", r"^model\.document\.backend='onnx': the document tower runs offline in torch"),
])
def test_a_backend_not_offered_is_one_line_before_any_tower_is_built(tmp_path, side, backend, message):
    c = model_config(tmp_path / "no-query", tmp_path / "no-document")
    c[side] = {**c[side], "backend": backend, "build": {"tool": "tiny", "out": str(tmp_path / "built")}}
    with pytest.raises(ValueError, match=message) as e:
        build_encoder(c, device="cpu")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "built").exists()  # refused before the towers were built (or sought)


def test_training_and_live_towers_refuse_onnx(torch_enc, towers, root, tmp_path):
    from care.config import load_config
    from care.encoders.care import CAREEncoder
    from care.models.towers import TowerSpec
    from care.training.care_recipe import stage_config
    from care.training.model import build_family

    seed0 = towers / "seed0"
    for stage in ("stage1", "stage2"):
        # its own training files (root): never the default data folder, which a clean clone does not have
        cfg = load_config("train", ["model=care_tiny", "++model.query.backend=onnx", f"output_dir={tmp_path / 'run'}",
                                    f"data.texts={root / 'texts.jsonl'}", f"data.examples={root / 'train.jsonl'}",
                                    f"model.query.path={seed0 / 'query'}", f"model.document.path={seed0 / 'document'}",
                                    f"model.stages.stage2.query_from={seed0 / 'query'}", "validation.task=null"])
        with pytest.raises(ValueError, match=r"model\.query\.backend='onnx' only encodes; train with model\.query\.backend=torch"):
            build_family(stage_config(cfg, stage, tmp_path / "run"))
    assert TowerSpec.from_config({"path": "x", "backend": "torch"}, "model.query").path == "x"
    live = (torch_enc.towers["query"], torch_enc.towers["document"])
    with pytest.raises(ValueError, match="live .training. towers run torch"):
        CAREEncoder({"backend": "onnx"}, {}, towers=live)


def test_the_hydra_override_reaches_the_encoder(towers):
    """`++model.query.backend=onnx` on an app's command line (care_*.yaml name no backend) is what evaluation
    builds: the evaluation model config (token limits capped) keeps the key and the registry honours it."""
    from omegaconf import OmegaConf

    from care.config import load_config
    from care.evaluation.corpora import evaluation_model

    seed0 = towers / "seed0"
    cfg = load_config("evaluate", ["model=care_tiny", "++model.query.backend=onnx",
                                   f"model.query.path={seed0 / 'query'}", f"model.document.path={seed0 / 'document'}"])
    model = evaluation_model(OmegaConf.to_container(cfg.model, resolve=True), cfg.max_length)
    enc = build_encoder(model, device="cpu")
    assert enc.backend == "onnx" and enc._onnx is not None
