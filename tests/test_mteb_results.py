"""The mteb adapter's results in mteb's own result-cache layout (care/evaluation/mteb_adapter/results.py), read
back by mteb's own loader (mteb.ResultCache.load_results, load_task_result, ModelMeta from model_meta.json), for
a dense model (spread_bert, conftest) and a two-tower CARE model (tiny towers, care.encoders.builders.towers), on two
small project tasks (conftest's `samples`: cMedIR reranking lists and KUAKE-QQR STS pairs).  Offline, no hub.

mteb writes its scores rounded to 6 decimals (TaskResult.to_disk), hence the comparisons with 1e-6.
"""
from __future__ import annotations

import json
import os

import pytest
from test_nano_mteb import mteb_cache  # noqa: F401  (mteb's import-time result folder in a temporary place)

pytestmark = pytest.mark.usefixtures("one_thread", "mteb_cache")

ROUND = 1e-6  # mteb's on-disk rounding (6 decimals)


@pytest.fixture(scope="module")
def tasks(samples):
    """A reranking task (map_at_10) and an STS task (cosine_pearson), both project tasks filled in memory."""
    from care.data.tasks import load_task
    from care.evaluation.mteb_adapter import mteb_task

    return [mteb_task(load_task("reranking", samples["reranking"]), "care.rerank"),
            mteb_task(load_task("sts", samples["sts"]), "care.sts")]


@pytest.fixture(scope="module")
def dense(spread_bert):
    from care.encoders import build_encoder

    return build_encoder({"kind": "dense", "name": "tiny_bert", "path": str(spread_bert), "max_length": 128},
                         device="cpu")


@pytest.fixture(scope="module")
def care_encoder(tmp_path_factory):
    """A CARE model: a 32-d tiny BERT query tower, a 64-d tiny Qwen3 document tower (cut to 32)."""
    from care.config import model_config
    from care.encoders import build_encoder
    from care.encoders.builders.towers import build_tiny

    root = tmp_path_factory.mktemp("care-towers") / "tiny"
    build_tiny(root, seed=0)
    cfg = model_config("care_tiny")
    for side in ("query", "document"):
        cfg[side].pop("build")
        cfg[side]["path"] = str(root / side)
    return build_encoder(cfg, device="cpu")


def _rows(task_result, split: str = "test") -> dict[str, float]:
    row = next(r for r in task_result.scores[split] if r["hf_subset"] == "default")
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _same_scores(stored, computed) -> None:
    """Every numeric score of the stored TaskResult equals mteb.evaluate's, to mteb's 6-decimal rounding."""
    got, want = _rows(stored), _rows(computed)
    assert set(got) == set(want) and len(want) > 5, (sorted(got), sorted(want))
    diffs = {k: abs(got[k] - want[k]) for k in want if k != "evaluation_time"}
    assert max(diffs.values()) <= ROUND, diffs


# ---- a dense model -------------------------------------------------------------------------------------------

def test_dense_results_are_in_mtebs_layout_and_read_back_by_its_loader(dense, tasks, tmp_path):
    import mteb
    from mteb.models.model_meta import ModelMeta

    from care.evaluation.mteb_adapter import MtebEncoder, load_results, model_folder, mteb_evaluate

    folder = tmp_path / "mteb"
    model = MtebEncoder(dense)
    computed = mteb_evaluate(model, tasks, results=folder)
    fingerprint = dense.fingerprint
    where = folder / "results" / "care__tiny_bert" / fingerprint
    assert model_folder(folder, model.mteb_model_meta) == where
    assert sorted(p.name for p in where.iterdir()) == ["care.rerank.json", "care.sts.json", "model_meta.json",
                                                       "run_settings.jsonl"]

    # mteb's own loader, as its tools and leaderboard call it
    cache = mteb.ResultCache(folder)
    assert cache.get_models(include_remote=False) == [("care__tiny_bert", fingerprint)]
    loaded = cache.load_results(include_remote=False)
    assert [(m.model_name, m.model_revision) for m in loaded.model_results] == [("care/tiny_bert", fingerprint)]
    by_name = {r.task_name: r for r in loaded.model_results[0].task_results}
    assert set(by_name) == {"care.rerank", "care.sts"}
    for task_result in computed.task_results:
        _same_scores(by_name[task_result.task_name], task_result)
        _same_scores(cache.load_task_result(task_result.task_name, "care/tiny_bert", fingerprint), task_result)
    assert by_name["care.rerank"].get_score() == pytest.approx(_rows(computed.task_results[0])["map_at_10"],
                                                               abs=ROUND)
    assert load_results(folder, model.mteb_model_meta).model_names == ["care/tiny_bert"]  # the wrapper, by meta

    # model_meta.json: what the model is, as mteb validates it
    meta = ModelMeta.model_validate_json_resolved((where / "model_meta.json").read_text(encoding="utf-8"))
    weights = sum(p.numel() for p in dense.model.parameters())
    embedding = dense.model.get_input_embeddings().weight.numel()
    assert (meta.name, meta.revision, meta.model_type) == ("care/tiny_bert", fingerprint, ["dense"])
    assert (meta.n_parameters, meta.n_embedding_parameters, meta.n_active_parameters) == (
        weights, embedding, weights - embedding)
    assert meta.n_parameters == dense.online_parameters
    assert meta.embed_dim == 64 == dense.encode_queries(["头痛"]).dense.shape[1]
    assert (meta.similarity_fn_name.value, meta.max_tokens, meta.languages) == ("cosine", 128, ["cmn-Hans"])
    assert (meta.license, meta.training_datasets, meta.loader) == (None, None, None)  # not stated


def test_a_rerun_scores_afresh_instead_of_reading_a_stored_result(dense, tasks, tmp_path):
    """mteb's default overwrite strategy would hand back a stored file of the same task name; the adapter's
    ("always") scores again and replaces it: a tampered file is corrected."""
    import mteb

    from care.evaluation.mteb_adapter import evaluate_tasks

    folder, sts = tmp_path / "mteb", [t for t in tasks if t.metadata.name == "care.sts"]
    first = evaluate_tasks(dense, sts, results=folder)["care.sts"]["main_score"]
    path = folder / "results" / "care__tiny_bert" / dense.fingerprint / "care.sts.json"
    stored = json.loads(path.read_text(encoding="utf-8"))
    stored["scores"]["test"][0]["main_score"] = 0.123
    path.write_text(json.dumps(stored), encoding="utf-8")
    assert mteb.ResultCache(folder).load_task_result("care.sts", "care/tiny_bert", dense.fingerprint).get_score() \
        == 0.123
    again = evaluate_tasks(dense, sts, results=folder)["care.sts"]["main_score"]
    assert again == pytest.approx(first, abs=ROUND) and abs(first - 0.123) > 0.01
    reread = mteb.ResultCache(folder).load_task_result("care.sts", "care/tiny_bert", dense.fingerprint)
    assert reread.get_score() == pytest.approx(first, abs=ROUND)


# ---- a CARE model --------------------------------------------------------------------------------------------

def test_care_results_say_two_towers_online_and_total_parameters(care_encoder, tasks, tmp_path):
    import mteb

    from care.evaluation.mteb_adapter import MtebEncoder, evaluate_tasks, model_folder

    folder = tmp_path / "mteb"
    model = MtebEncoder(care_encoder, meta={"license": "apache-2.0", "training_datasets": ["CMedQAv2-reranking"]})
    scores = evaluate_tasks(model, tasks, results=folder)
    where = model_folder(folder, model.mteb_model_meta)
    assert where == folder / "results" / "care__care_tiny" / care_encoder.fingerprint
    assert (where / "care.rerank.json").is_file() and (where / "care.sts.json").is_file()

    loaded = mteb.ResultCache(folder).load_results(models=["care/care_tiny"], include_remote=False)
    (result,) = loaded.model_results
    assert (result.model_name, result.model_revision) == ("care/care_tiny", care_encoder.fingerprint)
    for task_result in result.task_results:
        assert task_result.get_score() == pytest.approx(scores[task_result.task_name]["main_score"], abs=ROUND)

    meta = mteb.ResultCache(folder)._load_model_meta_from_cache("care/care_tiny", care_encoder.fingerprint)
    assert meta is not None  # mteb validated model_meta.json into a ModelMeta
    query, document = care_encoder.towers["query"], care_encoder.towers["document"]
    q_weights, d_weights = (sum(p.numel() for p in t.parameters()) for t in (query, document))
    q_embedding, d_embedding = (t.model.get_input_embeddings().weight.numel() for t in (query, document))
    assert meta.model_type == ["router", "dense"] and meta.model_type[0] == "router"
    assert meta.n_parameters == q_weights + d_weights > care_encoder.online_parameters == q_weights
    assert meta.n_embedding_parameters == q_embedding + d_embedding
    assert meta.n_active_parameters == q_weights - q_embedding  # what runs per query, embeddings aside
    assert meta.n_active_parameters + q_embedding == care_encoder.online_parameters
    width = care_encoder.encode_documents(["头痛"]).dense.shape[1]
    assert meta.embed_dim == width == care_encoder.encode_queries(["头痛"]).dense.shape[1] == query.dim == 32
    assert document.width == 64  # the document tower is wider: its vectors are cut to the query width
    assert (meta.similarity_fn_name.value, meta.license, meta.training_datasets) == (
        "dot", "apache-2.0", {"CMedQAv2-reranking"})
    assert meta.max_tokens == 128 and meta.use_instructions is True
    assert meta.is_zero_shot_on(["CMedQAv2-reranking"]) is False and meta.is_zero_shot_on(["ATEC"]) is True


# ---- the command line's options ------------------------------------------------------------------------------

def test_cli_results_options(monkeypatch, tmp_path):
    from care.evaluation.mteb_adapter import model_meta
    from care.evaluation.mteb_adapter.cli import _dashed, results_options
    from care.evaluation.mteb_adapter.results import results_dir

    monkeypatch.setenv("CARE_OUTPUTS", str(tmp_path / "out"))
    assert results_dir() == tmp_path / "out" / "mteb" and results_dir(tmp_path / "r") == tmp_path / "r"
    assert _dashed(["a=1", "--results", "/x", "b=2"]) == ["a=1", "results=/x", "b=2"]
    assert _dashed(["--results=/y"]) == ["results=/y"]
    with pytest.raises(ValueError, match="--results"):
        _dashed(["--results"])
    app = {"out_root": str(tmp_path / "moved"), "cache_root": str(tmp_path / "cache")}
    monkeypatch.delenv("MTEB_CACHE", raising=False)
    assert results_options({}, {}, app) == (tmp_path / "moved" / "mteb", {})  # the app's out_root, not CARE_OUTPUTS
    assert os.environ["MTEB_CACHE"] == str(tmp_path / "cache" / "mteb")
    assert results_options({"results": "none"}, {}, app)[0] is None
    own = {"results": str(tmp_path / "r"), "license": "mit", "training_datasets": "ATEC, CmedqaRetrieval"}
    assert results_options(own, {"license": "apache-2.0", "training_datasets": ["X"]}, app) == (
        tmp_path / "r", {"license": "mit", "training_datasets": {"ATEC", "CmedqaRetrieval"}})
    assert results_options({"training_datasets": ""}, {"license": "apache-2.0"}, app)[1] == {
        "license": "apache-2.0", "training_datasets": set()}  # empty: trained on none of mteb's tasks

    class Stub:  # an encoder that states nothing about its network
        name, fingerprint, online_parameters, online_embedding_parameters = "my model", "ab" * 8, 10, 0
        prompts = __import__("care.encoders.prompts", fromlist=["Prompts"]).Prompts()
        networks, dense_width, max_tokens, backend = {}, None, None, "torch"  # the Encoder interface's defaults

    meta = model_meta(Stub(), "cosine")
    assert (meta.name, meta.revision, meta.n_parameters, meta.n_embedding_parameters, meta.embed_dim) == (
        "care/my_model", "ab" * 8, 10, None, None)
    assert model_meta(Stub(), "dot", name="lab/x y").name == "lab/x_y"
    with pytest.raises(TypeError, match="unknown fields"):
        model_meta(Stub(), "dot", licence="mit")
    with pytest.raises(ValueError):  # not an mteb license id
        model_meta(Stub(), "dot", license="no such licence")
