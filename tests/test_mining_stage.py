"""The mining stage's files and rerun skip, its refusals (window, thresholds, similarity) and bad input."""

from __future__ import annotations

import json

import pytest
from _mining_helpers import compose, load_rows
from omegaconf import open_dict

from care.data.io import DataError
from data_pipeline import mining
from data_pipeline.dedup.stage import ThresholdError
from data_pipeline.mining_window import mining_window


def test_stage_outputs_and_rerun_skipped(build_dir, spread_bert, window, tmp_path):
    lo, hi = window
    cfg = compose(build_dir, tmp_path, spread_bert, f"mine.window=[{lo},{hi}]")
    first = mining.run(cfg)
    out = tmp_path / "train"
    assert {p.name for p in out.iterdir()} - {".run.lock"} == {  # and the stage's run lock
        "train.jsonl",
        "texts.jsonl",
        "flag_train.jsonl",
        "leakage.json",
        "stats.json",
        "neg_similarity.png",
    }
    assert (out / "neg_similarity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    store = {r["id"] for r in load_rows(out / "texts.jsonl")}
    rows = load_rows(out / "train.jsonl")
    assert {t for r in rows for t in [r["query_id"], *r["pos_ids"], *r["neg_ids"]]} == store
    assert len(load_rows(out / "flag_train.jsonl")) == len(rows)
    again = mining.run(cfg)
    assert again.get("skipped") and again["fingerprint"] == first["fingerprint"]
    assert (
        mining.run(compose(build_dir, tmp_path, spread_bert, f"mine.window=[{lo},{hi + 0.01}]")).get(
            "skipped"
        )
        is None
    )


def test_window_and_thresholds_refused(build_dir, spread_bert, tmp_path):
    with pytest.raises(DataError, match=r"lo >= hi"):
        mining.run(compose(build_dir, tmp_path, spread_bert, "mine.window=[0.8,0.8]"))
    with pytest.raises(ThresholdError, match="no thresholds.mine_lo"):
        mining.run(compose(build_dir, tmp_path, spread_bert))
    cfg = compose(build_dir, tmp_path, spread_bert)
    with open_dict(cfg):
        cfg.model.thresholds = {"mine_lo": 0.5, "mine_hi": 0.8, "calibrated_for": "bge_m3"}
    with pytest.raises(ThresholdError, match="calibrated_for is 'bge_m3'"):
        mining.run(cfg)
    cfg.model.thresholds.calibrated_for = "tiny_bert"
    assert mining_window(cfg) == {
        "lo": 0.5,
        "hi": 0.8,
        "source": "model.thresholds",
        "calibrated_for": "tiny_bert",
    }
    with pytest.raises(ValueError, match="mine.similarity"):
        mining.run(
            compose(build_dir, tmp_path, spread_bert, "mine.window=[0.5,0.8]", "mine.similarity=answer")
        )


def test_bad_inputs(build_dir, spread_bert, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("texts.jsonl", "leakage.json"):
        (bad / name).write_bytes((build_dir / name).read_bytes())
    ok = (build_dir / "examples.jsonl").read_text(encoding="utf-8").splitlines()
    cases = {
        "unknown": (
            ok[:3] + [json.dumps({"query_id": "nope", "pos_ids": ["x"], "pool": "answers"})],
            r"examples.jsonl, line 4, field 'query_id': unknown text id 'nope'",
        ),
        "empty": ([], r"no training examples"),
        "nopos": (
            [json.dumps({"query_id": json.loads(ok[0])["query_id"], "pos_ids": [], "pool": "answers"})],
            r"line 1, field 'pos_ids': an example with no positive",
        ),
    }
    for lines, message in cases.values():
        (bad / "examples.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        with pytest.raises(DataError, match=message):
            mining.run(compose(bad, tmp_path, spread_bert, "mine.window=[0.5,0.8]", f"mine.input_dir={bad}"))
    (bad / "examples.jsonl").write_text("\n".join(ok) + "\n", encoding="utf-8")
    dup = (build_dir / "texts.jsonl").read_text(encoding="utf-8").splitlines()
    (bad / "texts.jsonl").write_text("\n".join(dup + dup[:1]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"texts.jsonl, line {len(dup) + 1}, field 'id': duplicate id"):
        mining.run(compose(bad, tmp_path, spread_bert, "mine.window=[0.5,0.8]", f"mine.input_dir={bad}"))
    assert not (tmp_path / "train").exists()  # nothing written by a refused run
