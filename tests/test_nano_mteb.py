"""A Nano folder built by the `nano` stage, read and scored by the stock tools: mteb 2.x's own
RetrievalDatasetLoader reads the `mteb` subset views, mteb.evaluate (through care/evaluation/mteb_adapter/)
scores full-corpus retrieval and the reranking of `reranking_hybrid` exactly as `evaluate.py benchmark=nano`
does, and the pinned sentence-transformers' evaluators are checked against the same numbers.  No hub.

Scores are compared with `spread_bert` (conftest: tiny_bert's architecture and vocabulary, random weights with
init range 0.5), not tiny_bert itself: tiny_bert's CLS cosines on these texts all lie in [0.99995, 0.999997],
where float32 steps are 6e-8, so a split has thousands of exact ties and faiss (evaluate.py) and torch (mteb)
order them differently (measured: Recall@100 0.5111 vs 0.4944, one positive of 60 across the rank-100 line).
spread_bert's cosines spread over ~0.1-0.95 with no tie, and every metric then agrees.  mteb rounds nDCG,
Recall and MAP to 5 decimals (MRR is not rounded): hence the 1e-4 tolerance.
"""
from __future__ import annotations

import csv
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from _evaluation_helpers import Recorder

from care.config import load_config
from care.data.nano import HYBRID, load_split

pytestmark = pytest.mark.usefixtures("one_thread")

SPLIT = "cmedqa"
N_QUERIES, N_DOCS = 30, 300
TOL = 1e-4  # mteb's 5-decimal rounding is 5e-6; the measured differences are below 5e-6
VIEWS = {"retrieval": "nano/cmedqa", "hybrid": "nano/cmedqa_hybrid", "nosg": "nano/cmedqa_hybrid_nosg"}
PAIRS = (("ndcg_at_10", "ndcg_cut_10"), ("recall_at_100", "recall_100"), ("mrr_at_10", "mrr_10"))


@pytest.fixture(scope="module", autouse=True)
def mteb_cache(tmp_path_factory):
    """mteb's result folder, which `import mteb` creates: a temporary one (MTEB_CACHE, set before the first
    import, as care.evaluation.mteb_adapter.import_mteb does with the project cache).  None when another test
    module imported mteb first (the folder is then fixed for the session)."""
    from care.evaluation.mteb_adapter import import_mteb

    folder = tmp_path_factory.mktemp("mteb-cache")
    fresh, saved = "mteb" not in sys.modules, os.environ.get("MTEB_CACHE")
    os.environ["MTEB_CACHE"] = str(folder)
    import_mteb()
    yield folder if fresh else None
    if saved is None:
        os.environ.pop("MTEB_CACHE")
    else:
        os.environ["MTEB_CACHE"] = saved


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory):
    """`datasets.load_dataset` on a local folder (mteb's loader, sentence-transformers' NanoBEIREvaluator) writes
    arrow files into the datasets cache: a temporary one here, never the user's."""
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf-datasets")
    yield datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = saved


@pytest.fixture(scope="module")
def nano(shared, tiny_bert_dir, tmp_path_factory) -> Path:
    """A one-split Nano folder built by the stage from a BEIR folder of real cMedQA2 test pairs: 30 questions
    with their positive answers among 300 answers (a corpus over 100, so rows are 100 or 101 long)."""
    from _evaluation_helpers import write_beir

    from data_pipeline.nano import stage

    tmp = tmp_path_factory.mktemp("nano-mteb")
    with open(shared / "chineseblue_cmedqa2_pairs" / "test.txt", encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t"))
    corpus, doc_of, queries, qid_of, qrels = {}, {}, {}, {}, {}
    for label, question, answer in rows:
        question, answer = question.strip(), answer.strip()
        if answer not in doc_of:
            if len(doc_of) == N_DOCS:
                continue
            doc_of[answer] = f"d{len(doc_of)}"
            corpus[doc_of[answer]] = answer
        if label != "1":
            continue
        if question not in qid_of:
            if len(qid_of) == N_QUERIES:
                continue
            qid_of[question] = f"q{len(qid_of)}"
            queries[qid_of[question]] = question
        qrels.setdefault(qid_of[question], {})[doc_of[answer]] = 1
    assert len(queries) == N_QUERIES and len(corpus) == N_DOCS
    beir = write_beir(tmp / SPLIT, corpus, queries, qrels)
    out = tmp / "NanoTest"
    stage.run(load_config("data_pipeline", ["stage=nano", f"input={beir}", f"out={out}", "model=tiny_bert",
                                            f"model.path={tiny_bert_dir}", f"nano.dense.cache={tmp / 'cache'}",
                                            "nano.leakage.check=false"]))
    return out


@pytest.fixture(scope="module")
def ours(nano, spread_bert, tmp_path_factory) -> dict:
    """evaluate.py benchmark=nano on the folder: {view key: {metric: value}} of the dense method."""
    from evaluate import evaluate

    tmp = tmp_path_factory.mktemp("eval")
    cfg = load_config("evaluate", ["benchmark=nano", f"benchmark.nano.path={nano}", "~benchmark@extra_benchmark",
                                   "model=tiny_bert", f"model.path={spread_bert}", "baselines=[]",
                                   f"out_dir={tmp / 'out'}", "cache.enabled=false", "efficiency.enabled=false"])
    row = evaluate(cfg)["rows"][0]
    return {key: methods["dense"] for key, methods in row["methods"].items()}


@pytest.fixture(scope="module")
def encoder(spread_bert):
    from care.evaluation.mteb_adapter import encoder_from_config

    return encoder_from_config(["model=tiny_bert", f"model.path={spread_bert}"])


@pytest.fixture(scope="module")
def mteb_retrieval(nano, encoder) -> dict:
    from care.evaluation.mteb_adapter import run_mteb

    return run_mteb(encoder, nano)


def _diffs(got: dict, want: dict) -> dict[str, float]:
    return {m: abs(got[m] - want[t]) for m, t in PAIRS}


# ---- mteb's stock loader on the mteb subset ---------------------------------------------------------------

def test_stock_loader_reads_the_mteb_subset(nano, datasets_cache):
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalDatasetLoader

    from care.evaluation.mteb_adapter import load_in_memory, load_with_mteb_loader

    data = RetrievalDatasetLoader(hf_repo=str(nano), revision="local", split=SPLIT, config="mteb").load()
    s = load_split(nano, SPLIT)
    assert data["corpus"]["id"] == list(s.corpus) and data["corpus"]["text"] == list(s.corpus.values())
    assert data["queries"]["id"] == list(s.queries) and data["queries"]["text"] == list(s.queries.values())
    assert data["relevant_docs"] == s.qrels  # {qid: {did: 1}}, mteb's int32 scores
    assert all(type(g) is int for j in data["relevant_docs"].values() for g in j.values())
    assert data["top_ranked"] == s.candidates[HYBRID]
    assert {len(ids) for ids in data["top_ranked"].values()} <= {100, 101} and s.safeguards
    # the views are what makes it work: HAKARI's own qrels config has no score column
    with pytest.raises(ValueError, match="score"):
        RetrievalDatasetLoader(hf_repo=str(nano), revision="local", split=SPLIT, config=None).load()
    # the adapter's two sources give the same split (the loader's datasets cache is a temporary folder)
    before = sorted(datasets_cache.rglob("*"))
    via_loader, in_memory = load_with_mteb_loader(nano, SPLIT), load_in_memory(nano, SPLIT, reranking=True)
    assert sorted(datasets_cache.rglob("*")) == before
    for key in ("corpus", "queries"):
        assert via_loader[key].to_dict() == in_memory[key].to_dict()
    assert via_loader["relevant_docs"] == in_memory["relevant_docs"]
    assert via_loader["top_ranked"] == in_memory["top_ranked"]


# ---- mteb.evaluate == evaluate.py ----------------------------------------------------------------------------

def test_mteb_full_corpus_retrieval_equals_evaluate(mteb_retrieval, ours, mteb_cache):
    got, want = mteb_retrieval[SPLIT], ours[VIEWS["retrieval"]]
    assert got["main_score"] == got["ndcg_at_10"] > 0
    assert max(_diffs(got, want).values()) < TOL, (got, want)
    if mteb_cache is not None:  # mteb made its result folder where MTEB_CACHE said, and saved nothing there
        assert mteb_cache.is_dir() and not list(mteb_cache.rglob("*"))


@pytest.mark.parametrize("source", ["memory", "loader"])
def test_mteb_reranking_of_top_ranked_equals_the_hybrid_view(nano, encoder, ours, mteb_retrieval, source,
                                                             datasets_cache):
    """mteb scores exactly the listed candidates (every positive of the qrels counts: one the list misses is
    missed, as in evaluate.py), so its reranking equals the `<split>_hybrid` view."""
    from care.evaluation.mteb_adapter import run_mteb

    got, want = run_mteb(encoder, nano, reranking=True, source=source)[SPLIT], ours[VIEWS["hybrid"]]
    assert max(_diffs(got, want).values()) < TOL, (got, want)
    assert abs(got["ndcg_at_10"] - mteb_retrieval[SPLIT]["ndcg_at_10"]) > 10 * TOL  # another run, not the same


def test_mteb_reranking_without_safeguard_equals_the_nosg_view(nano, encoder, ours):
    from care.evaluation.mteb_adapter import run_mteb

    got, want = run_mteb(encoder, nano, reranking=True, safeguard=False)[SPLIT], ours[VIEWS["nosg"]]
    assert max(_diffs(got, want).values()) < TOL, (got, want)
    assert got["recall_at_100"] < ours[VIEWS["hybrid"]]["recall_100"]  # the safeguards were found before


# ---- the model protocol --------------------------------------------------------------------------------------

def test_mteb_encoder_protocol_sides_and_task_types(nano):
    from datasets import Dataset
    from mteb._create_dataloaders import create_dataloader
    from mteb.models import EncoderProtocol
    from mteb.types import PromptType

    from care.evaluation.mteb_adapter import MtebEncoder, nano_task

    rec = Recorder()
    model = MtebEncoder(rec)
    assert isinstance(model, EncoderProtocol)
    meta = model.mteb_model_meta
    assert meta.loader is None and meta.name == "care/recorder" and meta.revision == rec.fingerprint
    assert meta.similarity_fn_name.value == "cosine"
    retrieval, reranking = nano_task(nano, SPLIT).metadata, nano_task(nano, SPLIT, reranking=True).metadata
    assert (retrieval.type, reranking.type) == ("Retrieval", "Reranking")
    texts = ["一", "二三", "四五六"]
    docs = Dataset.from_dict({"id": ["a", "b", "c"], "text": texts})

    def run(m, metadata, prompt_type):
        loader = create_dataloader(docs, task_metadata=metadata, prompt_type=prompt_type, batch_size=2)
        return m.encode(loader, task_metadata=metadata, hf_split=SPLIT, hf_subset="default", prompt_type=prompt_type)

    out = run(model, retrieval, PromptType.document)
    assert out.dtype == np.float32 and out.shape == (3, 2) and rec.calls[-1] == ("document", "retrieval", texts)
    run(model, reranking, PromptType.query)
    assert rec.calls[-1][:2] == ("query", "reranking")  # C-MTEB reranking tasks: the reranking instruction
    run(model.with_task_types({reranking.name: "retrieval"}), reranking, PromptType.query)
    assert rec.calls[-1][:2] == ("query", "retrieval")  # a Nano split's hybrid view: retrieval, as evaluate.py
    run(model, retrieval, None)
    assert rec.calls[-1][0] == "query"  # symmetric tasks (STS) embed both sides as queries
    first = np.array(Recorder.vector(texts[0]))  # dot, not cosine (which would give 1.0)
    assert float(MtebEncoder(rec, similarity="dot").similarity(out, out)[0, 0]) == pytest.approx(first @ first)
    assert first @ first != pytest.approx(1.0)


# ---- the command line ----------------------------------------------------------------------------------------

def test_cli_prints_mteb_scores(nano, spread_bert, mteb_retrieval, capsys, tmp_path):
    from care.evaluation.mteb_adapter import main

    got = main(["model=tiny_bert", f"model.path={spread_bert}", f"nano={nano}", f"results={tmp_path / 'mteb'}"])
    assert got == mteb_retrieval
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith(f"| {SPLIT} |"))
    assert f"{100 * got[SPLIT]['ndcg_at_10']:.2f}" in row and "full-corpus retrieval" in printed
    with pytest.raises(ValueError, match="nano="):
        main(["model=tiny_bert"])


# ---- sentence-transformers 6.2.0 -----------------------------------------------------------------------------

def _st_model(folder: Path):
    """The project's tiny_bert encoder as a SentenceTransformer: CLS pooling, unit vectors, 128 tokens."""
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(folder), max_seq_length=128)
    return SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "cls"),
                                        models.Normalize()], device="cpu")


def test_sentence_transformers_nano_evaluators(nano, spread_bert, ours, datasets_cache, tmp_path):
    """The pinned sentence-transformers has no generic NanoEvaluator; NanoBEIREvaluator accepts only the 13
    NanoBEIR names and reads split `Nano<Name>`, so a Nano folder's own split names are refused.  Its
    InformationRetrievalEvaluator, fed from care.data.nano, gives evaluate.py's numbers; and NanoBEIREvaluator
    does read the HAKARI layout once the README calls the split by a NanoBEIR name."""
    import sentence_transformers
    import sentence_transformers.evaluation as st_evaluation
    from sentence_transformers.sentence_transformer.evaluation import (
        InformationRetrievalEvaluator,
        NanoBEIREvaluator,
    )

    assert not hasattr(st_evaluation, "NanoEvaluator"), (
        f"sentence-transformers {sentence_transformers.__version__} has NanoEvaluator now: test it on the folder")
    with pytest.raises(ValueError, match=r"\['cmedqa'\] are not valid NanoBEIR datasets"):
        NanoBEIREvaluator(dataset_names=[SPLIT], dataset_id=str(nano))

    model = _st_model(spread_bert)
    s = load_split(nano, SPLIT)
    ir = InformationRetrievalEvaluator(s.queries, s.corpus, {q: set(j) for q, j in s.qrels.items()}, name=SPLIT,
                                       accuracy_at_k=[1], precision_recall_at_k=[100], write_csv=False)(model)
    want = ours[VIEWS["retrieval"]]
    for st_name, metric in (("ndcg@10", "ndcg_cut_10"), ("recall@100", "recall_100"), ("mrr@10", "mrr_10")):
        assert ir[f"{SPLIT}_cosine_{st_name}"] == pytest.approx(want[metric], abs=TOL), st_name

    renamed = tmp_path / "NanoRenamed"
    shutil.copytree(nano, renamed)
    readme = renamed / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8").replace(f"- split: {SPLIT}\n", "- split: NanoSciFact\n"),
                      encoding="utf-8")
    nb = NanoBEIREvaluator(dataset_names=["scifact"], dataset_id=str(renamed), accuracy_at_k=[1],
                           precision_recall_at_k=[100], write_csv=False)(model)
    assert nb["NanoSciFact_cosine_ndcg@10"] == pytest.approx(want["ndcg_cut_10"], abs=TOL)
