"""The score stage (data_pipeline/score.py): a teacher's pair scores checked against the teacher called
directly, cross-encoder and bi-encoder told apart, the chunk cache's resume, the skip of an unchanged re-run,
the one-line refusals, and the FlagEmbedding export carrying the teacher's scores."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from _evaluation_helpers import pair_logits
from _training_helpers import make_training_files
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import write_jsonl
from data_pipeline import score, teachers

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16
MAX_LENGTH = 64


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory, shared) -> Path:
    """Real cEpilepsyQA questions, their answers as positives, 4 other answers as negatives; the first example
    repeated (its pairs are scored once)."""
    root = tmp_path_factory.mktemp("train")
    _, train = make_training_files(root, shared, n_questions=10, n_negs=4)
    rows = rows_of(train)
    write_jsonl(train, [*rows, {**rows[0], "note": "repeat"}])
    return root


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory) -> Path:
    """A tiny one-label BertForSequenceClassification (a cross-encoder) with the bert-base-chinese vocabulary."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from care.models.tiny import chinese_tokenizer

    tok = chinese_tokenizer()
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=1, initializer_range=0.2)
    out = tmp_path_factory.mktemp("cross")
    BertForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@functools.cache
def base_config():
    return load_config("data_pipeline", ["stage=score", "model=tiny_bert", f"score.max_length={MAX_LENGTH}",
                                         f"score.chunk_pairs={CHUNK}", "score.batch_size=8"])


def compose(root: Path, train_dir: Path, teacher, *extra: str):
    """The real config (composed once) for a run under `root`: data_dir, cache_root and the input folder."""
    return OmegaConf.merge(base_config(), OmegaConf.from_dotlist(
        [f"data_dir={root / 'data'}", f"cache_root={root / 'cache'}", f"score.input_dir={train_dir}",
         f"teacher={teacher if teacher is not None else 'null'}", *extra]))


def texts_of(train_dir: Path) -> dict[str, str]:
    return {r["id"]: r["text"] for r in rows_of(train_dir / "texts.jsonl")}


def direct_logits(cross_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    return pair_logits(cross_dir, pairs, MAX_LENGTH)


@pytest.fixture(scope="module")
def cross_run(tmp_path_factory, train_dir, cross_dir):
    root = tmp_path_factory.mktemp("cross-run")
    stats = score.run(compose(root, train_dir, cross_dir))
    return root, stats


def test_cross_encoder_scores_are_the_raw_pair_logits(cross_run, train_dir, cross_dir):
    root, stats = cross_run
    out = root / "data" / "scored"
    assert {p.name for p in out.iterdir()} - {".run.lock"} == set(score.OUTPUTS)  # and the stage's run lock
    assert (out / "teacher_scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "texts.jsonl").read_bytes() == (train_dir / "texts.jsonl").read_bytes()
    inputs, rows = rows_of(train_dir / "train.jsonl"), rows_of(out / "train.jsonl")
    # the input rows as they were, plus the two aligned score lists
    assert [{k: v for k, v in r.items() if not k.startswith("teacher_")} for r in rows] == inputs
    texts = texts_of(train_dir)
    pairs = [(texts[r["query_id"]], texts[t]) for r in rows for t in r["pos_ids"] + r["neg_ids"]]
    got = [s for r in rows for s in r["teacher_pos_scores"] + r["teacher_neg_scores"]]
    assert all(len(r["teacher_pos_scores"]) == len(r["pos_ids"]) for r in rows)
    assert all(len(r["teacher_neg_scores"]) == len(r["neg_ids"]) for r in rows)
    assert all(s == round(s, 6) for s in got)
    np.testing.assert_allclose(got, direct_logits(cross_dir, pairs), atol=2e-5)
    assert np.std(got) > 1e-3  # the tiny teacher does tell pairs apart

    assert stats["teacher"]["kind"] == "cross-encoder"
    assert stats["teacher"]["fingerprint"] == teachers.cross_fingerprint(str(cross_dir.resolve()),
                                                                         {"max_length": MAX_LENGTH})
    distinct = len(set(pairs))
    assert stats["pairs"] == {"total": len(pairs), "distinct": distinct, "queries": len(rows) - 1,
                              "passages": len({p for _, p in pairs})}
    assert stats["cache"]["pairs_computed"] == distinct and stats["cache"]["pairs_cached"] == 0
    chunks = sorted((root / "cache" / "teacher_scores" / stats["teacher"]["fingerprint"]).glob("*.npz"))
    assert len(chunks) == stats["cache"]["chunks_written"] == -(-distinct // CHUNK)
    pos = [s for r in rows for s in r["teacher_pos_scores"]]
    neg = [s for r in rows for s in r["teacher_neg_scores"]]
    assert stats["positives"]["count"] == len(pos) and stats["positives"]["mean"] == round(float(np.mean(pos)), 4)
    assert stats["negatives"]["count"] == len(neg)
    signal = stats["false_negative_signal"]
    assert signal["examples"] == len(rows)
    assert signal["neg_above_best_pos"] == sum(max(r["teacher_neg_scores"]) > max(r["teacher_pos_scores"])
                                               for r in rows)
    assert "pairs by cross-encoder" in score.summary(stats)


def test_unchanged_rerun_is_skipped_and_a_new_limit_is_not(cross_run, train_dir, cross_dir, tmp_path, monkeypatch):
    root, first = cross_run
    again = score.run(compose(root, train_dir, cross_dir))
    assert again.get("skipped") and again["fingerprint"] == first["fingerprint"]
    # a run setting (batch size, chunk size, cache folder) changes no score: still skipped
    assert score.run(compose(root, train_dir, cross_dir, "score.batch_size=3")).get("skipped")
    # force: redone, every pair from the cache, nothing computed
    monkeypatch.setattr(teachers.CrossEncoderTeacher, "_score_chunk", lambda *a: pytest.fail("scored again"))
    forced = score.run(compose(root, train_dir, cross_dir, "force=true"))
    assert forced["cache"]["pairs_computed"] == 0 and forced["cache"]["pairs_cached"] == first["pairs"]["distinct"]
    monkeypatch.undo()
    # another token limit is another teacher fingerprint: scored afresh
    other = score.run(compose(root, train_dir, cross_dir, "score.max_length=32", f"score.out_dir={tmp_path}"))
    assert other.get("skipped") is None and other["teacher"]["fingerprint"] != first["teacher"]["fingerprint"]
    assert other["cache"]["pairs_computed"] == first["pairs"]["distinct"]


def test_an_interrupted_run_resumes_after_its_last_chunk(cross_run, train_dir, cross_dir, tmp_path, monkeypatch):
    _, reference = cross_run
    original = teachers.CrossEncoderTeacher._score_chunk
    calls = []

    def failing(self, pairs, bar):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(len(pairs))
        return original(self, pairs, bar)

    monkeypatch.setattr(teachers.CrossEncoderTeacher, "_score_chunk", failing)
    cfg = compose(tmp_path, train_dir, cross_dir)
    with pytest.raises(KeyboardInterrupt):
        score.run(cfg)
    folder = tmp_path / "cache" / "teacher_scores" / reference["teacher"]["fingerprint"]
    assert len(list(folder.glob("*.npz"))) == 2 and not list(folder.glob(".*"))  # whole chunks only
    assert not (tmp_path / "data" / "scored" / "train.jsonl").exists()

    calls.clear()
    monkeypatch.setattr(teachers.CrossEncoderTeacher, "_score_chunk",
                        lambda self, pairs, bar: calls.append(len(pairs)) or original(self, pairs, bar))
    resumed = score.run(cfg)
    distinct = reference["pairs"]["distinct"]
    assert len(calls) == -(-distinct // CHUNK) - 2 and sum(calls) == distinct - 2 * CHUNK
    assert resumed["cache"]["pairs_cached"] == 2 * CHUNK
    assert (rows_of(tmp_path / "data" / "scored" / "train.jsonl")
            == rows_of(cross_run[0] / "data" / "scored" / "train.jsonl"))


def test_bi_encoder_teacher_scores_as_evaluation_does(train_dir, tmp_path):
    from care.encoders import build_encoder
    from care.models.tiny import save_tiny

    named = save_tiny(tmp_path / "cache" / "models" / "tiny-bert")  # where conf/model/tiny_bert.yaml points
    stats = score.run(compose(tmp_path, train_dir, "tiny_bert"))
    assert stats["teacher"]["kind"] == "bi-encoder" and stats["teacher"]["score"] == "dense inner product"
    rows = rows_of(tmp_path / "data" / "scored" / "train.jsonl")
    texts = texts_of(train_dir)
    encoder = build_encoder({"kind": "dense", "path": str(named), "pooling": "cls", "max_length": MAX_LENGTH})
    q = encoder.encode_queries([texts[r["query_id"]] for r in rows]).dense
    for i, r in enumerate(rows):
        d = encoder.encode_documents([texts[t] for t in r["pos_ids"] + r["neg_ids"]]).dense
        cos = d @ q[i] / np.linalg.norm(d, axis=1) / np.linalg.norm(q[i])
        np.testing.assert_allclose(r["teacher_pos_scores"] + r["teacher_neg_scores"], cos, atol=2e-6)
    assert stats["cache"]["texts_encoded"] > 0

    # the same weights as a folder (built like model=tiny_bert): the same scores, every text from the cache
    again = score.run(compose(tmp_path, train_dir, named, "score.out_dir=" + str(tmp_path / "again")))
    assert again["cache"]["texts_encoded"] == 0
    assert again["teacher"]["fingerprint"] == stats["teacher"]["fingerprint"]
    assert rows_of(tmp_path / "again" / "train.jsonl") == rows


def test_multi_head_teacher_combines_heads_as_the_hybrid(train_dir, tmp_path):
    from care.encoders import build_encoder
    from care.encoders.scores import colbert_score, lexical_score
    from care.models.m3 import tiny_m3

    folder = tmp_path / "m3"
    tiny_m3().save(folder)
    stats = score.run(compose(tmp_path, train_dir, folder, "score.embedding_cache=null"))
    assert stats["teacher"]["score"].startswith("hybrid of 1*dense + 0.3*sparse + 1*colbert")
    rows = rows_of(tmp_path / "data" / "scored" / "train.jsonl")[:3]
    texts = texts_of(train_dir)
    encoder = build_encoder({"kind": "m3", "path": str(folder), "max_length": MAX_LENGTH})
    heads = ("dense", "sparse", "colbert")
    for r in rows:
        q = encoder.encode_queries([texts[r["query_id"]]], heads=heads)
        d = encoder.encode_documents([texts[t] for t in r["pos_ids"] + r["neg_ids"]], heads=heads)
        want = [(float(d.dense[j] @ q.dense[0]) + 0.3 * lexical_score(q.sparse[0], d.sparse[j])
                 + colbert_score(q.colbert[0], d.colbert[j])) / 2.3 for j in range(len(d))]
        np.testing.assert_allclose(r["teacher_pos_scores"] + r["teacher_neg_scores"], want, atol=2e-5)


def test_flag_export_carries_the_teacher_scores(cross_run):
    """The contract of data_pipeline.build.export_flag: FlagEmbedding's pos_scores / neg_scores are the
    teacher's scores (teacher_pos_scores / teacher_neg_scores)."""
    out = cross_run[0] / "data" / "scored"
    flag, rows = rows_of(out / "flag_train.jsonl"), rows_of(out / "train.jsonl")
    assert len(flag) == len(rows)
    for f, r in zip(flag, rows):
        assert f["pos_scores"] == r["teacher_pos_scores"] and f["neg_scores"] == r["teacher_neg_scores"]


def test_refusals_are_one_line(train_dir, cross_dir, tmp_path, capsys):
    import data_pipeline.__main__ as pipeline

    assert "score" in pipeline.STAGES and "score" not in pipeline.ORDER  # never part of stage=all
    with pytest.raises(ValueError, match=r"no teacher given: pass teacher=FOLDER .* or teacher=NAME"):
        score.run(compose(tmp_path, train_dir, None))
    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "weights.txt").write_text("not a model", encoding="utf-8")
    neither_kind = re.escape(str(neither)) + r" is neither a cross-encoder folder .* nor an encoder folder"
    with pytest.raises(ValueError, match=neither_kind):
        score.run(compose(tmp_path, train_dir, neither))
    with pytest.raises(ValueError, match=r"no conf/model/nope\.yaml"):
        score.run(compose(tmp_path, train_dir, "nope"))
    two = tmp_path / "two-labels"
    config = json.loads((cross_dir / "config.json").read_text(encoding="utf-8"))
    two.mkdir()
    (two / "config.json").write_text(json.dumps({**config, "id2label": {"0": "no", "1": "yes"}}), encoding="utf-8")
    with pytest.raises(ValueError, match="classifier with 2 labels"):
        score.run(compose(tmp_path, train_dir, two))

    for teacher, part in ((None, "no teacher given"), (neither, "is neither a cross-encoder")):
        with pytest.raises(SystemExit) as e:
            pipeline.main(compose(tmp_path, train_dir, teacher))
        assert e.value.code == 1
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and part in err[0]
        assert err[0].startswith("python -m data_pipeline: error in stage score: teacher=" if teacher else
                                 "python -m data_pipeline: error in stage score: no teacher given")
