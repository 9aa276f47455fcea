# ruff: noqa: F811  (task_paths, imported from test_evaluate_cli, is a fixture named as a test parameter)
"""Evaluation's seams around a reranker row, and its small numbers (issue #40 items 3, 6, 7): what must be
refused in one line before anything is written, and what must read n/a instead of nan.

- a cross-encoder folder without its trained classifier head (a reranker's final/ whose classifier.* tensors
  are gone, or an encoder folder under model=me5_reranker) is refused, the out_dir and the model card left as
  they were; rerank.allow_untrained_head=true scores a head made from `seed`: the same numbers on every run,
  the row's label saying so, the card left alone, the caller's random state untouched;
- rerank.k=0, a rerank.retriever that is neither a folder nor a conf/model name, and a benchmark with nothing
  a reranker scores (STS only) are refused before anything is written;
- a gain interval that the bootstrap cannot give (a few STS pairs: Pearson undefined on some resamples) reads
  n/a with its reason, never [+nan, +nan]; encode.py ckpt=<folder> is labelled by its folder.

References: the files as they were before the run (bytes), the pair scores of transformers itself under a
fixed seed, and hand-made tiny inputs whose undefined resamples are counted here."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: a fixture)

from care.config import load_config
from care.data.io import write_json
from care.encoders.registry import TRAINING_RECORD
from care.models.tiny import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
CARD = "# my reranker\n\nmy own words\n"


def _reranker(folder, head: bool = True):
    """A reranker final/ as training writes it (care_training.json, a README of the user's), optionally without
    its classifier.* tensors."""
    save_tiny(folder, "reranker", seed=5)
    write_json(folder / TRAINING_RECORD, {"model": {"kind": "reranker", "name": "tiny_reranker", "path": ".",
                                                     "max_length": 128}})
    if not head:
        weights = load_file(folder / "model.safetensors")
        save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")},
                  folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "README.md").write_text(CARD, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return _reranker(tmp_path_factory.mktemp("reranker") / "run" / "final")


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    return _reranker(tmp_path_factory.mktemp("headless") / "run" / "final", head=False)


def _cfg(paths, tmp_path, *extra):
    return load_config("evaluate", overrides(paths, tmp_path, "efficiency.enabled=false", "baselines=[]",
                                             "backend=torch", *extra, cmedqa2=False))


def _refused(cfg, match: str) -> str:
    """evaluate.py's run (under its out_dir lock, as main runs it) refused with one line; nothing written."""
    from care.runlock import locked_out_dir
    from evaluate import evaluate

    with pytest.raises(ValueError, match=match) as e:
        locked_out_dir(evaluate)(cfg)
    assert "\n" not in str(e.value)
    assert not __import__("pathlib").Path(cfg.out_dir).exists()
    return str(e.value)


# ---- item 3: a cross-encoder without its trained head ----------------------------------------------------

def test_a_reranker_without_its_head_is_refused_and_its_card_kept(task_paths, headless, tiny_bert_dir, tmp_path):
    message = _refused(_cfg(task_paths, tmp_path, f"ckpt={headless}", f"rerank.retriever={tiny_bert_dir}"),
                       r"is no trained cross-encoder: its weights lack classifier\.bias, classifier\.weight.*"
                       r"rerank\.allow_untrained_head=true")
    assert str(headless) in message
    assert (headless / "README.md").read_text(encoding="utf-8") == CARD
    # an encoder folder under model=me5_reranker: no head at all
    _refused(_cfg(task_paths, tmp_path, "model=me5_reranker", f"model.path={tiny_bert_dir}",
                  f"rerank.retriever={tiny_bert_dir}"), r"is no trained cross-encoder: its weights lack .*classifier")


def test_an_untrained_head_asked_for_by_name_is_seeded(task_paths, headless, tiny_bert_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from care.encoders.cross_encoder import CrossEncoder
    from evaluate import evaluate

    # the pair scores: transformers' own model, its missing head made under the same seed (the reference)
    torch.manual_seed(0)
    reference = AutoModelForSequenceClassification.from_pretrained(headless, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(headless)
    pairs = [("头痛怎么办", "多喝水"), ("发烧", "及时就医，必要时做检查")]
    with torch.no_grad():
        expected = [float(reference(**tok(q, p, return_tensors="pt")).logits[0, 0]) for q, p in pairs]
    state = torch.get_rng_state()
    cross = CrossEncoder(str(headless), max_length=128, untrained_head_seed=0)
    scores = cross.score_pairs([q for q, _ in pairs], [p for _, p in pairs])
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state untouched
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert cross.untrained == ["classifier.bias", "classifier.weight"]

    rows = []
    for run in ("a", "b"):
        evaluate(_cfg(task_paths, tmp_path, f"ckpt={headless}", f"rerank.retriever={tiny_bert_dir}",
                      "rerank.allow_untrained_head=true", f"out_dir={tmp_path / run}"))
        rows.append(json.loads((tmp_path / run / "summary.json").read_text(encoding="utf-8"))["models"][0])
    assert rows[0]["scores"] == rows[1]["scores"] and rows[0]["fingerprint"] == rows[1]["fingerprint"]
    assert "[untrained head, seed 0]" in rows[0]["label"]
    assert (headless / "README.md").read_text(encoding="utf-8") == CARD


# ---- items 6 and 7: rerank settings and a benchmark with nothing to score ---------------------------------

def test_rerank_settings_and_an_sts_only_benchmark_are_refused_before_anything_is_written(
        task_paths, reranker, tiny_bert_dir, tmp_path):
    good = f"rerank.retriever={tiny_bert_dir}"
    _refused(_cfg(task_paths, tmp_path, f"ckpt={reranker}", good, "rerank.k=0"),
             r"^rerank\.k=0: .*a whole number >= 1")
    missing = tmp_path / "nonexistent"
    _refused(_cfg(task_paths, tmp_path, f"ckpt={reranker}", f"rerank.retriever={missing}"),
             rf"^rerank\.retriever={missing}: no such folder \({missing}\); it takes an encoder's model folder .*"
             r"or a conf/model name \(.*me5_small")
    _refused(_cfg(task_paths, tmp_path, f"ckpt={reranker}", "rerank.retriever=no_such_model"),
             r"^rerank\.retriever=no_such_model: no conf/model/no_such_model\.yaml")
    sts_only = [f"~benchmark.tasks.{t}" for t in ("cmed_v1", "cmed_v2", "retrieval", "rerank")]
    _refused(_cfg(task_paths, tmp_path, f"ckpt={reranker}", good, *sts_only),
             r"^model run/final: nothing to score: a cross-encoder scores retrieval, reranking, candidates tasks, "
             r"and cmedteb holds only sts")
    assert (reranker / "README.md").read_text(encoding="utf-8") == CARD


def test_a_judge_folder_that_does_not_exist_is_named_as_the_judge(tmp_path):
    from omegaconf import OmegaConf

    from data_pipeline.judge import judge_spec

    cfg = load_config("data_pipeline", ["stage=mine", f"mine.judge={tmp_path / 'nonexistent'}"])
    with pytest.raises(ValueError) as e:
        judge_spec(OmegaConf.to_container(cfg.mine, resolve=True), cfg)
    assert str(e.value).startswith(f"mine.judge={tmp_path / 'nonexistent'}: no such folder ({tmp_path / 'nonexistent'}); "
                                   "a judge is a cross-encoder folder")
    assert "teacher=" not in str(e.value) and "conf/model" not in str(e.value)


# ---- item 7: n/a instead of nan ------------------------------------------------------------------------

def test_an_interval_the_bootstrap_cannot_give_reads_n_a_with_its_reason():
    from care.data.numbers import fmt_gain, fmt_interval, fmt_number
    from care.evaluation.significance import RESAMPLES, gain_interval

    gold = [0.0, 1.0, 2.0, 3.0]
    a, b = [0.1, 0.9, 2.2, 2.8], [0.3, 0.2, 2.9, 1.0]
    got = gain_interval({"predicted": a, "gold": gold}, {"predicted": b, "gold": gold}, seed=0)
    # a resample that draws one pair four times has no Pearson (the values are distinct otherwise): counted
    # here from the draws scipy's paired bootstrap makes, one (resamples, n) matrix of indices from the seed
    idx = np.random.default_rng(0).integers(0, 4, size=(RESAMPLES, 4))
    constant = int((idx == idx[:, :1]).all(axis=1).sum())
    assert constant > 0 and got["low"] is None and got["high"] is None
    assert got["undefined"] == f"undefined on {constant} of {RESAMPLES} resamples: 4 items are too few"
    assert got["difference"] == pytest.approx(100 * (np.corrcoef(a, gold)[0, 1] - np.corrcoef(b, gold)[0, 1]))
    assert fmt_interval(got) == "n/a" and fmt_interval({"low": float("nan"), "high": float("nan")}) == "n/a"
    assert fmt_number(float("nan")) == "n/a" and fmt_gain(float("nan"), 1.0) == "n/a"
    # a constant prediction: no difference at all
    flat = gain_interval({"predicted": [1.0] * 4, "gold": gold}, {"predicted": b, "gold": gold}, seed=0)
    assert flat["difference"] is None and "undefined on the 4 items themselves" in flat["undefined"]
    json.dumps(got, allow_nan=False)  # stored as JSON without NaN


def test_the_table_reads_n_a_and_says_why(task_paths, tiny_bert_dir, tmp_path):
    """The small STS file of test_evaluate_cli (8 pairs, tied gold scores) against BM25: the STS interval."""
    from evaluate import evaluate

    result = evaluate(_cfg(task_paths, tmp_path, "model=tiny_bert", f"model.path={tiny_bert_dir}",
                           "baselines=[bm25]", "gain_over=bm25"))
    table = result["table"]
    row = json.loads((tmp_path / "eval" / "summary.json").read_text(encoding="utf-8"))["models"][0]
    sts = row["gain"]["intervals"]["cmedteb/sts"]
    assert sts["low"] is None and sts["undefined"].endswith("resamples: 8 items are too few")
    assert not re.search(r"\bnan\b", table, re.IGNORECASE)
    assert f"tiny BERT (random init, bert-base-chinese vocab), STS Pearson: {sts['undefined']}" in table
    gain_row = next(line for line in table.splitlines() if line.startswith("| 95% interval of that gain"))
    assert gain_row.split(" | ")[5] == "n/a"  # the STS column (after the model and four slots)


# ---- item 7: encode.py's label -----------------------------------------------------------------------

def test_encode_labels_a_checkpoint_by_its_folder(tiny_bert_dir, tmp_path):
    import shutil

    from encode import encode

    folder = tmp_path / "my_run" / "final"
    shutil.copytree(tiny_bert_dir, folder)
    (tmp_path / "texts.jsonl").write_text('{"id": "t1", "text": "头痛怎么办"}\n', encoding="utf-8")
    stats = encode(load_config("encode", [f"ckpt={folder}", f"corpus={tmp_path / 'texts.jsonl'}",
                                          f"cache.dir={tmp_path / 'cache'}", "backend=torch"]))
    assert stats["model"] == "my_run/final"
