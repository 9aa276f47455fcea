"""Each app either serves a model family or refuses it in one line, before any work, naming the model, its family
and what to use instead (care.families.require; issue #42): a reranker folder (pair scores, no vectors), a CARE
model where one network is needed (a stage keyed by one weights folder) and the test-only sparse family
(tests/_sparse_family.py: no dense vector) given to encode.py, the mteb adapter's command line, the dedup /
mine / nano stages of `python -m data_pipeline` and calibration; validation scores a reranker by its family (no
class probe), and train.py's family refuses the untrainable sparse one.  What each family gives is served:
evaluate.py and encode.py take the sparse family (tests/test_sparse_family.py), calibration takes CARE."""
from __future__ import annotations

import json
import runpy
import sys

import pytest
from _sparse_family import registered

from care.config import load_config
from care.data.io import write_json, write_jsonl
from care.encoders import build_encoder, build_pair_scorer
from care.encoders.registry import TRAINING_RECORD
from care.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_full_error(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


@pytest.fixture(scope="module")
def sparse_family():
    with registered() as family:
        yield family


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """A tiny reranker folder as the trainer leaves it (its training record names the family)."""
    from care.models.tiny import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("reranker") / "final", "reranker")
    write_json(folder / TRAINING_RECORD, {"model": {"kind": "reranker", "name": "tiny_reranker", "path": "."}})
    return folder


@pytest.fixture
def models(reranker_dir, tiny_bert_dir, sparse_family):
    """{family: the `model=` overrides of an app config}."""
    return {"reranker": ["model=me5_reranker", f"model.path={reranker_dir}", "model.name=tiny_reranker"],
            "care": ["model=care_tiny"],
            "sparse_test": ["model=tiny_bert", "model.kind=sparse_test", f"model.path={tiny_bert_dir}",
                            "model.name=sparse_tiny", "+model.seed=0"]}


def one_line(err: str, *parts: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # not a progress bar
    assert len(lines) == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def exit_status(call) -> int:
    with pytest.raises(SystemExit) as stopped:
        call()
    return stopped.value.code


#: what each family gives, as the refusal says it (care.families OUTPUT_WORDS)
GIVES = {"reranker": "gives pair scores", "care": "has 2 towers", "sparse_test": "gives sparse lexical weights"}
NAMES = {"reranker": "tiny_reranker", "care": "care_tiny", "sparse_test": "sparse_tiny"}


@pytest.mark.parametrize("stage", ["mine", "dedup", "nano"])
@pytest.mark.parametrize("family", ["reranker", "care", "sparse_test"])
def test_the_stages_that_embed_refuse_what_gives_no_one_dense_network(stage, family, models, tmp_path, capsys):
    import data_pipeline.__main__ as pipeline

    cfg = load_config("data_pipeline", [f"stage={stage}", *models[family], f"data_dir={tmp_path / 'data'}"])
    assert exit_status(lambda: pipeline.main(cfg)) == 1
    line = one_line(capsys.readouterr().err, f"python -m data_pipeline: error in stage {stage}: model "
                    f"'{NAMES[family]}' cannot serve the {stage}", f"it is a {family} model", GIVES[family],
                    "use a model of kind dense or m3")
    assert line.endswith("use a model of kind dense or m3")
    assert not (tmp_path / "data").exists()  # refused before any work


@pytest.mark.parametrize("family", ["reranker", "sparse_test"])
def test_calibration_refuses_what_gives_no_dense_vector(family, models, tmp_path, capsys):
    from data_pipeline.dedup import calibrate

    cfg = load_config("data_pipeline", [*models[family], "dedup.calibrate.mode=export", f"data_dir={tmp_path}"])
    assert exit_status(lambda: calibrate.main(cfg)) == 1
    one_line(capsys.readouterr().err, "python -m data_pipeline.dedup.calibrate: error: model "
             f"'{NAMES[family]}' cannot serve calibration", GIVES[family], "use a model of kind dense, m3 or care")


def test_calibration_takes_care(tmp_path, shared):
    """CARE gives dense vectors: calibration encodes the texts with its document tower (export mode)."""
    from care.encoders.builders.towers import build_tiny
    from data_pipeline.dedup import calibrate
    from data_pipeline.planted import shared_texts

    folder = tmp_path / "care"
    build_tiny(folder)
    texts = [t for t in shared_texts() if len(t) < 60][:40]
    store = tmp_path / "store.jsonl"
    write_jsonl(store, ({"id": f"s{i}", "text": t} for i, t in enumerate(texts)))
    cfg = load_config("data_pipeline", ["model=care_tiny", f"model.query.path={folder / 'query'}",
                                        f"model.document.path={folder / 'document'}", f"++input={store}",
                                        "dedup.calibrate.mode=export", "dedup.calibrate.neighbours=2",
                                        "dedup.calibrate.edges=[-1.0,0.5,1.0]", f"data_dir={tmp_path}",
                                        "dedup.semantic.cache=null"])
    result = calibrate.run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "calibrate" / "care_tiny" / "to_label.jsonl").read_text().splitlines()]
    assert result["encoder"]["name"] == "care_tiny" and rows and all(-1 <= r["cosine"] <= 1 for r in rows)


@pytest.mark.parametrize("family", ["reranker", "sparse_test"])
def test_encode_and_mteb_refuse_what_they_cannot_embed(family, models, reranker_dir, tmp_path, capsys, monkeypatch):
    """encode.py takes any family that gives vectors (the sparse one: tests/test_sparse_family.py), so only the
    reranker is refused there; mteb scores dense vectors.  A reranker is given as its folder (ckpt=)."""
    import encode

    model = [f"ckpt={reranker_dir}"] if family == "reranker" else models[family]
    if family == "reranker":
        cfg = load_config("encode", [*model, f"corpus={tmp_path / 'none.jsonl'}", f"cache.dir={tmp_path / 'cache'}"])
        assert exit_status(lambda: encode.main(cfg)) == 1
        one_line(capsys.readouterr().err, "encode.py: error: model 'tiny_reranker' cannot serve encode.py",
                 "gives pair scores", "not dense vectors, sparse lexical weights or ColBERT token vectors",
                 "use a model of kind dense, m3, care or sparse_test")
    monkeypatch.setattr(sys, "argv", ["care.evaluation.mteb_adapter", "benchmark=cmedteb_open", *model,
                                      f"results={tmp_path / 'mteb'}"])
    assert exit_status(lambda: runpy.run_module("care.evaluation.mteb_adapter", run_name="__main__")) == 1
    one_line(capsys.readouterr().err, "python -m care.evaluation.mteb_adapter: error: model "
             f"'{NAMES[family]}' cannot serve python -m care.evaluation.mteb_adapter", GIVES[family],
             "use a model of kind dense, m3 or care")
    assert not (tmp_path / "mteb").exists() and not (tmp_path / "cache").exists()


def test_build_encoder_and_build_pair_scorer_each_take_their_own(reranker_dir, tiny_bert_dir):
    """One contract each: an Encoder for a family that gives vectors, a pair scorer for one that scores pairs."""
    reranker = {"kind": "reranker", "name": "tiny_reranker", "path": str(reranker_dir)}
    with pytest.raises(ValueError, match="cannot serve as an Encoder .build_encoder.: it is a reranker model.*"
                                         "it is built by build_pair_scorer"):
        build_encoder(reranker)
    with pytest.raises(ValueError, match="cannot serve as a pair scorer .build_pair_scorer.: it is a dense model.*"
                                         "build_encoder builds it"):
        build_pair_scorer({"kind": "dense", "name": "tiny", "path": str(tiny_bert_dir)})
    assert build_pair_scorer(reranker).score_pairs(["头痛"], ["多喝水"]).shape == (1,)
    assert build_encoder({"kind": "dense", "name": "tiny", "path": str(tiny_bert_dir)}).heads == ("dense",)


def test_validation_scores_a_reranker_by_its_family(reranker_dir, tmp_path):
    """The trainer hands validation its model's family: a reranker's candidates ranked by its pair scores
    (MAP@10 equal to trec_eval on logits computed by transformers alone), with no class probe."""
    from _evaluation_helpers import pair_logits, trec
    from omegaconf import OmegaConf

    from care.data.tasks import load_task
    from care.encoders.cross_encoder import CrossEncoder
    from care.training.validation import Validator

    dev = tmp_path / "dev.jsonl"
    write_jsonl(dev, [{"query": "头痛发烧怎么办", "positive": ["发烧头痛可以先物理降温"], "negative": ["胃疼吃什么药", "失眠怎么调理"]},
                      {"query": "孩子咳嗽有痰", "positive": ["小儿咳嗽有痰可以拍背"], "negative": ["高血压常用药", "腰疼怎么办"]}])
    v = OmegaConf.create({"task": str(dev), "metric": "map_cut_10", "heads": ["dense"], "batch_size": 4,
                          "max_queries": None})
    got = Validator(v, family=FAMILIES["reranker"])(CrossEncoder(str(reranker_dir), max_length=64))
    data = load_task("reranking", dev)
    run = {}
    for qid, judged in data.qrels.items():
        docs = list(judged)
        logits = pair_logits(reranker_dir, [(data.queries[qid], data.docs[d]) for d in docs], 64)
        run[qid] = dict(zip(docs, logits))
    assert got == pytest.approx(trec(run, data.qrels, ["map_cut_10"])["map_cut_10"], abs=1e-6)


def test_training_refuses_a_family_without_a_trainer(sparse_family, tiny_bert_dir):
    from care.errors import describe
    from care.training.model import build_family

    cfg = load_config("train", ["model=tiny_bert", "model.kind=sparse_test", f"model.path={tiny_bert_dir}"])
    with pytest.raises(ValueError) as refused:
        build_family(cfg)
    assert describe(refused.value) == ("model kind 'sparse_test' cannot be trained (trainable kinds: dense, m3, care, "
                                       "reranker)")
