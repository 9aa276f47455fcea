"""dedup.engine=datatrove (data_pipeline/distributed/): the native engine's stage folder, to the byte.

The native engine is the reference (itself held to datasketch's MinHashLSH pair for pair by
tests/test_minhash_numpy.py).  On a slice of the real cEpilepsyQA answers and questions with planted exact,
normalisation-only and near duplicates (some near ones below the Jaccard threshold, so candidates are
rejected too), the datatrove engine's kept.jsonl and clusters.jsonl equal the native ones byte for byte and
its per-stage stats equal the native ones but for seconds, for 1, 2 and 4 local tasks, for other stage
orders, and with the semantic stage after it.
"""
from __future__ import annotations

import json
import random

import pytest
from test_dedup_stage import dedup_overrides

from care.config import load_config
from care.data.io import DataError
from data_pipeline.dedup.stage import run
from data_pipeline.planted import plant, shared_texts

RESULT_FILES = ("kept.jsonl", "clusters.jsonl")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """1,400 real texts (short questions and long answers), 260 planted duplicates, shuffled; extra fields kept."""
    texts = random.Random(7).sample(shared_texts(), 1400)
    rows, _ = plant(texts, n_exact=60, n_variant=60, n_near=140, ngram=2, near_range=(0.6, 1.0), seed=8)
    path = tmp_path_factory.mktemp("store") / "texts.jsonl"
    path.write_text("".join(json.dumps({**r, "source": "x", "n": i}, ensure_ascii=False) + "\n"
                            for i, r in enumerate(rows)), encoding="utf-8")
    return path


@pytest.fixture(scope="module", autouse=True)
def cache_root(tmp_path_factory):
    """One cache root for every run: dedup.semantic.cache (under it) is part of the stage's fingerprint."""
    CACHE[0] = tmp_path_factory.mktemp("cache")
    return CACHE[0]


CACHE = [None]


def dedup(src, out, engine, *extra):
    cfg = load_config("data_pipeline", [*dedup_overrides(), f"++input={src}", f"++out={out}",
                                        "dedup.stages=[exact,minhash]", "dedup.roles=null", "dedup.sources=null",
                                        f"dedup.engine={engine}", f"cache_root={CACHE[0]}", *extra])
    return run(cfg)


def without_seconds(stats: dict) -> dict:
    """Per-stage stats but the timings (seconds, the semantic stage's encoding seconds and rate)."""
    return {name: {k: v for k, v in s.items() if not k.endswith(("seconds", "_per_s"))}
            for name, s in stats["stages"].items()}


@pytest.fixture(scope="module")
def native(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("native") / "dedup"
    return out, dedup(store, out, "native")


def assert_same_folder(out, ref, stats, ref_stats):
    for name in RESULT_FILES:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert without_seconds(stats) == without_seconds(ref_stats)
    for key in ("texts_in", "texts_out", "rows_read", "rows_filtered_out", "fingerprint", "stage_order"):
        assert stats[key] == ref_stats[key], key


@pytest.mark.parametrize("tasks", [1, 2, 4])
def test_datatrove_engine_equals_native_for_1_2_4_tasks(store, native, tmp_path, tasks):
    ref, ref_stats = native
    out = tmp_path / "dedup"
    stats = dedup(store, out, "datatrove", f"dedup.tasks={tasks}", "dedup.workers=2")
    assert stats["engine"] == {**stats["engine"], "name": "datatrove", "tasks": tasks, "executor": "local"}
    assert_same_folder(out, ref, stats, ref_stats)
    s = stats["stages"]["minhash"]
    # the slice exercises every path: exact groups, verified MinHash clusters, candidates the check rejects
    assert stats["stages"]["exact"]["clusters"] > 50 and s["clusters"] > 50
    assert s["candidate_pairs"] > s["verified_pairs"] > 0
    assert not list((CACHE[0] / "datatrove").rglob("completions"))   # the work folder is gone after success


@pytest.mark.parametrize("stages", ["[minhash,exact]", "[minhash]", "[exact]"])
def test_other_stage_orders(store, tmp_path, stages):
    ref = dedup(store, tmp_path / "native", "native", f"dedup.stages={stages}")
    stats = dedup(store, tmp_path / "dt", "datatrove", f"dedup.stages={stages}", "dedup.tasks=3", "dedup.workers=1")
    assert_same_folder(tmp_path / "dt", tmp_path / "native", stats, ref)


def test_semantic_stage_after_the_datatrove_stages(store, tmp_path, tiny_bert_dir):
    semantic = ["dedup.stages=[exact,minhash,semantic]", "model=tiny_bert", f"model.path={tiny_bert_dir}",
                "model.pooling=mean", "dedup.semantic.cosine=0.99", "dedup.semantic.cache=null"]
    ref = dedup(store, tmp_path / "native", "native", *semantic)
    stats = dedup(store, tmp_path / "dt", "datatrove", *semantic, "dedup.tasks=2", "dedup.workers=1")
    assert_same_folder(tmp_path / "dt", tmp_path / "native", stats, ref)
    assert stats["stages"]["semantic"]["clusters"] > 0
    assert (tmp_path / "dt" / "nn_similarity.png").is_file()


def test_semantic_must_come_last(store, tmp_path):
    with pytest.raises(ValueError, match="semantic stage comes last"):
        dedup(store, tmp_path / "dt", "datatrove", "dedup.stages=[semantic,exact]", "dedup.semantic.cosine=0.9")


def test_either_engine_folder_is_up_to_date_for_the_other(store, native, tmp_path):
    ref, _ = native
    again = dedup(store, ref, "datatrove", "dedup.tasks=2")
    assert again.get("skipped") is True   # the engine keys are not in the fingerprint


def test_work_folder_kept_on_request_and_resumed(store, native, tmp_path):
    """keep_work leaves every step's completions; a run over them skips every task and writes the same."""
    ref, ref_stats = native
    work = tmp_path / "work"
    first = dedup(store, tmp_path / "a", "datatrove", "dedup.tasks=2", "dedup.workers=1", "dedup.keep_work=true",
                  f"dedup.work_dir={work}")
    done = sorted(p.relative_to(work).as_posix() for p in work.glob("logs/*/completions/*"))
    assert len(done) == 2 + 2 + 2 + 2 + 2 + 1   # exact digests, groups; MinHash signatures, buckets, check, clusters
    second = dedup(store, tmp_path / "b", "datatrove", "dedup.tasks=2", "dedup.workers=1", f"dedup.work_dir={work}")
    assert_same_folder(tmp_path / "b", ref, second, ref_stats)
    assert_same_folder(tmp_path / "a", ref, first, ref_stats)
    assert not work.exists()


def test_bad_input_same_error_as_native(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"id": "a", "text": "高血压"}\n{"id": "b", "text": "糖尿病"}\n{"id": "a", "text": "头痛"}\n',
                   encoding="utf-8")
    messages = []
    for engine in ("native", "datatrove"):
        with pytest.raises(DataError) as err:
            dedup(src, tmp_path / engine, engine)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "line 3" in messages[0] and "duplicate id" in messages[0]


def test_tasks_setting_is_checked(store, tmp_path):
    with pytest.raises(ValueError, match="dedup.tasks=0"):
        dedup(store, tmp_path / "dt", "datatrove", "dedup.tasks=0")
    with pytest.raises(ValueError, match="dedup.engine='spark'"):
        dedup(store, tmp_path / "x", "spark")


def test_filters_blank_lines_and_line_ends(store, tmp_path):
    """The positions are those of the rows the filters keep: other roles and sources, blank lines, CRLF line
    ends and a last line without a newline change nothing."""
    lines = store.read_text(encoding="utf-8").splitlines()[:900]
    out = []
    for i, line in enumerate(lines):
        row = json.loads(line)
        row["role"] = "question" if i % 5 == 0 else "answer"
        row["source"] = "y" if i % 7 == 0 else "x"
        out.append(json.dumps(row, ensure_ascii=False) + ("\r\n" if i % 3 == 0 else "\n") + ("\n" if i % 50 == 0 else ""))
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(out).rstrip("\n"), encoding="utf-8")
    picked = ["dedup.roles=[answer]", "dedup.sources=[x]"]
    ref = dedup(src, tmp_path / "native", "native", *picked)
    stats = dedup(src, tmp_path / "dt", "datatrove", *picked, "dedup.tasks=3", "dedup.workers=1")
    assert_same_folder(tmp_path / "dt", tmp_path / "native", stats, ref)
    assert ref["rows_filtered_out"] > 200 and stats["stages"]["minhash"]["clusters"] > 0


def test_auto_task_count():
    """auto: one task per 100,000 texts; locally a multiple of the workers (no round of one task alone)."""
    from omegaconf import OmegaConf

    from data_pipeline.distributed.dedup_engine import task_count

    def count(n, **d):
        return task_count(OmegaConf.create({"tasks": "auto", **d}), n)

    assert count(50_000, workers=2) == 1 and count(250_000, workers=2) == 4 and count(250_000, workers=3) == 3
    assert count(250_000, workers=2, executor="slurm") == 3 and count(0) == 1
    assert count(250_000, workers=2, tasks=5) == 5
