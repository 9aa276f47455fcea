"""A trained reranker as the score stage's teacher and the mine stage's false-negative judge (issue #35 item 3),
on a tiny reranker folder as the trainer writes it (a one-label classifier with care_training.json naming
kind reranker).  References independent of the code: each pair scored alone by transformers'
AutoModelForSequenceClassification, and the judge's rule counted by hand from those scores (a negative at or
above the lowest positive less the margin: dropped, or moved to the positives)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _evaluation_helpers import pair_logits
from _mining_helpers import compose as mine_compose
from _mining_helpers import load_rows
from _training_helpers import make_training_files
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import write_json, write_jsonl
from care.encoders.registry import TRAINING_RECORD
from care.models.tiny import save_tiny
from data_pipeline import mining, score
from data_pipeline.judge import judge_rows, judge_spec

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> Path:
    folder = save_tiny(tmp_path_factory.mktemp("reranker") / "final", "reranker", seed=3)
    write_json(folder / TRAINING_RECORD, {"model": {"kind": "reranker", "name": "tiny", "path": ".",
                                                     "max_length": MAX_LENGTH}})
    return folder


@pytest.fixture(scope="module")
def mined(tmp_path_factory, shared) -> Path:
    """A small mined file: real questions, their answers, 4 other answers as negatives, the last one a
    fallback negative, the miner's similarities."""
    root = tmp_path_factory.mktemp("mined")
    _, train = make_training_files(root, shared, n_questions=12, n_negs=4)
    rows = [{**r, "pos_scores": [0.9] * len(r["pos_ids"]), "fallback": 1} for r in load_rows(train)]
    write_jsonl(train, rows)
    return root


def by_hand(folder: Path, pairs: list[tuple[str, str]]) -> list[float]:
    return pair_logits(folder, pairs, MAX_LENGTH)


def config(root: Path, *extra: str):
    return OmegaConf.merge(load_config("data_pipeline", ["stage=score", "model=tiny_bert"]), OmegaConf.from_dotlist(
        [f"data_dir={root / 'data'}", f"cache_root={root / 'cache'}", f"score.max_length={MAX_LENGTH}",
         "score.batch_size=8", *extra]))


def test_score_stage_with_a_reranker_teacher_writes_the_pairs_own_scores(reranker, mined, tmp_path):
    stats = score.run(config(tmp_path, f"score.input_dir={mined}", f"teacher={reranker}"))
    assert stats["teacher"]["kind"] == "cross-encoder"
    texts = {r["id"]: r["text"] for r in load_rows(mined / "texts.jsonl")}
    for row in load_rows(tmp_path / "data" / "scored" / "train.jsonl"):
        q = texts[row["query_id"]]
        for ids, got in ((row["pos_ids"], row["teacher_pos_scores"]), (row["neg_ids"], row["teacher_neg_scores"])):
            assert got == pytest.approx(by_hand(reranker, [(q, texts[t]) for t in ids]), abs=1e-5)


def test_judge_drop_and_relabel_equal_a_hand_count(reranker, mined, tmp_path):
    texts = {r["id"]: r["text"] for r in load_rows(mined / "texts.jsonl")}
    rows = load_rows(mined / "train.jsonl")
    gaps = []  # per row: lowest positive score - each negative's score
    for r in rows:
        q = texts[r["query_id"]]
        pos = by_hand(reranker, [(q, texts[t]) for t in r["pos_ids"]])
        gaps.append(min(pos) - np.array(by_hand(reranker, [(q, texts[t]) for t in r["neg_ids"]])))
    ordered = np.sort(np.concatenate(gaps))
    cut = int(np.searchsorted(ordered, 0.0)) + len(ordered) // 4  # a margin flagging a few beyond the ties
    margin = float((ordered[cut - 1] + ordered[cut]) / 2)  # midway between two gaps: no pair on the edge
    assert margin > 0
    flagged = [g <= margin for g in gaps]  # s >= p - margin
    assert 0 < sum(f.sum() for f in flagged) < len(ordered)
    for rule in ("drop", "relabel"):
        cfg = config(tmp_path, f"mine.judge={reranker}", f"mine.judge_rule={rule}", f"mine.judge_margin={margin}")
        opts = OmegaConf.to_container(cfg.mine, resolve=True)
        out, stats = judge_rows(rows, texts, judge_spec(opts, cfg), opts, cfg)
        n = int(sum(f.sum() for f in flagged))
        assert (stats["flagged"], stats[{"drop": "dropped", "relabel": "relabelled"}[rule]]) == (n, n)
        assert stats["examples_affected"] == sum(bool(f.any()) for f in flagged)
        for r, o, f in zip(rows, out, flagged):
            negs = [t for t, hit in zip(r["neg_ids"], f) if not hit]
            assert o["neg_ids"] == negs and o["fallback"] == int(not f[-1])
            moved = [t for t, hit in zip(r["neg_ids"], f) if hit]
            assert o["pos_ids"] == r["pos_ids"] + (moved if rule == "relabel" else [])
            assert len(o["pos_scores"]) == len(o["pos_ids"]) and len(o["neg_scores"]) == len(o["neg_ids"])


def test_mine_stage_with_a_judge_counts_it_in_stats(build_dir, spread_bert, window, reranker, tmp_path):
    lo, hi = window
    plain = mining.run(mine_compose(build_dir, tmp_path / "plain", spread_bert, f"mine.window=[{lo},{hi}]"))
    judged = mining.run(mine_compose(build_dir, tmp_path / "judged", spread_bert, f"mine.window=[{lo},{hi}]",
                                     f"mine.judge={reranker}", "mine.judge_rule=relabel", "mine.judge_margin=0.5",
                                     f"cache_root={tmp_path / 'cache'}"))
    assert "judge" not in plain and judged["fingerprint"] != plain["fingerprint"]
    before, after = (load_rows(tmp_path / d / "train" / "train.jsonl") for d in ("plain", "judged"))
    moved = sum(len(a["pos_ids"]) - len(b["pos_ids"]) for a, b in zip(after, before))
    stats = json.loads((tmp_path / "judged" / "train" / "stats.json").read_text())["judge"]
    assert moved > 0 and stats["relabelled"] == moved == sum(len(b["neg_ids"]) - len(a["neg_ids"]) for a, b in zip(after, before))
    assert stats["negatives_judged"] == sum(len(b["neg_ids"]) for b in before) and stats["rule"] == "relabel"


def test_refusals(reranker, tmp_path, tiny_bert_dir):
    for extra, message in (([f"mine.judge={reranker}", "mine.judge_rule=keep"], "mine.judge_rule='keep'"),
                           ([f"mine.judge={reranker}", "mine.judge_margin=-1"], "mine.judge_margin=-1"),
                           ([f"mine.judge={tiny_bert_dir}"], "not a bi-encoder")):
        cfg = config(tmp_path, *extra)
        with pytest.raises(ValueError, match=message):
            judge_spec(OmegaConf.to_container(cfg.mine, resolve=True), cfg)
