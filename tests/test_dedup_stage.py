"""The dedup stage: per-encoder threshold refusal, bad input, and the stage end to end through the Hydra CLI
(second run skipped)."""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys

import pytest
from omegaconf import open_dict

from care.config import load_config
from care.data.io import DataError, read_text_store
from care.paths import PROJECT_ROOT
from data_pipeline.dedup.stage import ThresholdError, load_rows, run, semantic_thresholds
from data_pipeline.planted import plant, shared_texts

# ---- 4. thresholds belong to an encoder -------------------------------------------------------------------

def _cfg(overrides=(), thresholds=None):
    cfg = load_config("data_pipeline", list(dedup_overrides()) + ["model=tiny_bert", *overrides])
    if thresholds is not None:
        with open_dict(cfg):
            cfg.model.thresholds = thresholds
    return cfg


@functools.cache
def dedup_overrides() -> tuple[str, ...]:
    """`+pipeline=dedup` until conf/data_pipeline.yaml composes the dedup group itself."""
    return () if "dedup" in load_config("data_pipeline") else ("+pipeline=dedup",)


def test_threshold_refusal_and_override():
    with pytest.raises(ThresholdError, match="no thresholds.dedup_cosine"):
        semantic_thresholds(_cfg())
    other = {"dedup_cosine": 0.8, "mine_lo": 0.5, "mine_hi": 0.8, "calibrated_for": "bge_m3", "how": "judge"}
    with pytest.raises(ThresholdError, match="calibrated_for is 'bge_m3'"):
        semantic_thresholds(_cfg(thresholds=other))
    own = {**other, "calibrated_for": "tiny_bert"}
    assert semantic_thresholds(_cfg(thresholds=own))["source"] == "model.thresholds"
    forced = semantic_thresholds(_cfg(["dedup.semantic.cosine=0.9"], thresholds=other))
    assert forced["dedup_cosine"] == 0.9 and forced["source"] == "override"
    with pytest.raises(DataError, match=r"field 'thresholds.mine_lo'.*empty"):
        semantic_thresholds(_cfg(thresholds={**own, "mine_lo": 0.8, "mine_hi": 0.8}))


def test_stage_refuses_before_any_work(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "高血压"}\n', encoding="utf-8")
    cfg = _cfg([f"++input={src}", f"++out={tmp_path / 'out'}", "dedup.roles=null", "dedup.sources=null"])
    with pytest.raises(ThresholdError):
        run(cfg)
    assert not (tmp_path / "out").exists()


# ---- bad input --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, roles, line, field", [
    ('{"id": "a", "text": "一"}\n{"id": "a", "text": "二"}\n', None, 2, "id"),
    ('{"id": "a", "text": "一"}\n{"id": "b", "text": "  "}\n', None, 2, "text"),
    ('{"id": "a", "text": "一"}\n{"id": "b"}\n', None, 2, "text"),
    ('{"id": 5, "text": "一"}\n{"id": 5, "text": "二"}\n', None, 2, "id"),
    ('{"id": "a", "text": "一", "role": "answer"}\n{"id": "b", "text": "二"}\n', ["answer"], 2, "role"),
])
def test_bad_rows_name_file_line_field(tmp_path, content, roles, line, field):
    """The stage's reader and care.data.io.read_text_store share one text-store check: the same refusals."""
    src = tmp_path / "bad.jsonl"
    src.write_text(content, encoding="utf-8")
    readers = [lambda: load_rows(src, roles=roles, sources=None)]
    if not roles:
        readers.append(lambda: read_text_store(src))
    for read in readers:
        with pytest.raises(DataError) as e:
            read()
        assert (e.value.path, e.value.line, e.value.field) == (str(src), line, field)
        assert str(src) in str(e.value)


def test_undecodable_bytes(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes('{"id": "a", "text": "一"}\n'.encode() + b'{"id": "b", "text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match="line 2.*undecodable"):
        load_rows(src, roles=None, sources=None)


def test_a_directory_or_missing_file_is_named(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a directory"):
        load_rows(tmp_path, roles=None, sources=None)
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_rows(tmp_path / "nope.jsonl", roles=None, sources=None)


def test_role_and_source_filters(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": f"文本{i}", "role": r, "source": s}) + "\n"
                           for i, (r, s) in enumerate([("answer", "a"), ("question", "a"), ("answer", "b")])))
    rows, st = load_rows(src, roles=["answer"], sources=["a"])
    assert [r["id"] for r in rows] == ["0"] and st["rows_filtered_out"] == 2


# ---- 6. the stage, end to end through the CLI ------------------------------------------------------------

def test_stage_end_to_end_cli(tmp_path, tiny_bert_dir):
    texts = random.Random(3).sample(shared_texts(), 150)
    rows, pairs = plant(texts, n_exact=10, n_variant=10, n_near=30, ngram=2, seed=4)
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps({**r, "role": "answer", "source": "x"}, ensure_ascii=False) + "\n"
                           for r in rows), encoding="utf-8")
    out = tmp_path / "dedup"
    cmd = [sys.executable, "-m", "data_pipeline", *dedup_overrides(), "stage=dedup", f"++input={src}",
           f"++out={out}", "model=tiny_bert", f"model.path={tiny_bert_dir}", "model.pooling=mean",
           "dedup.semantic.cosine=0.99",
           f"dedup.semantic.cache={tmp_path / 'cache'}", "dedup.sources=[x]",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    first = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "semantic" in first.stdout and "->" in first.stdout

    kept = [json.loads(x) for x in (out / "kept.jsonl").read_text(encoding="utf-8").splitlines()]
    clusters = [json.loads(x) for x in (out / "clusters.jsonl").read_text(encoding="utf-8").splitlines()]
    stats = json.loads((out / "stats.json").read_text(encoding="utf-8"))
    order = {r["id"]: i for i, r in enumerate(rows)}
    removed = [i for c in clusters for i in c["removed_ids"]]
    kept_ids = [r["id"] for r in kept]
    assert len(removed) == len(set(removed)) and not set(removed) & set(kept_ids)
    assert set(removed) | set(kept_ids) == set(order)                     # every input accounted for once
    assert kept_ids == sorted(kept_ids, key=order.get)                    # input order
    assert kept == [r | {"role": "answer", "source": "x"} for r in rows if r["id"] in set(kept_ids)]
    for c in clusters:
        assert all(order[c["kept_id"]] < order[r] for r in c["removed_ids"])   # earliest kept
        if c["stage"] == "exact":
            assert c["min_edge_similarity"] == 1.0
        else:
            assert c["min_edge_similarity"] >= (0.8 if c["stage"] == "minhash" else 0.99) - 1e-6
    assert {c["stage"] for c in clusters} >= {"exact", "minhash"}
    stage_of = {r: c["stage"] for c in clusters for r in c["removed_ids"]}
    for p in pairs:   # of each planted pair the later one goes, at the stage that should catch it
        later = max(p.original, p.copy, key=order.get)
        if p.kind != "near":
            assert stage_of.get(later) == "exact"
        elif p.jaccard >= 0.8:
            assert stage_of.get(later) in ("exact", "minhash", "semantic")

    s = stats["stages"]
    assert s["exact"]["in"] == len(rows) == 200 and s["exact"]["out"] == s["minhash"]["in"]
    assert s["minhash"]["out"] == s["semantic"]["in"] and s["semantic"]["out"] == len(kept)
    for name in ("exact", "minhash", "semantic"):
        assert s[name]["in"] - s[name]["out"] == sum(len(c["removed_ids"]) for c in clusters if c["stage"] == name)
    assert s["minhash"]["p_candidate_at_threshold"] >= 0.95 and "0.80" in s["minhash"]["s_curve"]
    assert stats["thresholds"]["source"] == "override"
    assert stats["thresholds"]["encoder"]["name"] == "tiny_bert" and len(stats["thresholds"]["encoder"]["fingerprint"]) == 16
    assert (out / "nn_similarity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "skipped" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp


def test_cli_bad_input_is_one_clear_line_and_keeps_earlier_outputs(tmp_path):
    src = tmp_path / "texts.jsonl"
    src.write_text('{"id": "a", "text": "头痛怎么办", "role": "answer", "source": "x"}\n'
                   '{"id": "a", "text": "发烧了怎么办", "role": "answer", "source": "x"}\n', encoding="utf-8")
    out = tmp_path / "dedup"
    out.mkdir()
    earlier = '{"stage": "dedup", "fingerprint": "earlier"}'
    (out / "stats.json").write_text(earlier, encoding="utf-8")   # a previous run's file: must survive
    cmd = [sys.executable, "-m", "data_pipeline", *dedup_overrides(), "stage=dedup", f"++input={src}",
           f"++out={out}", "dedup.stages=[exact,minhash]", "dedup.sources=[x]", f"hydra.run.dir={tmp_path / 'h'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1
    assert "error in stage dedup" in run.stderr and f"{src}, line 2, field 'id'" in run.stderr and "duplicate id 'a'" in run.stderr
    assert "Traceback" not in run.stderr
    assert (out / "stats.json").read_text(encoding="utf-8") == earlier
