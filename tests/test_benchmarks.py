"""Task files (bad input, cMedQA2 release folders), benchmarks as configs, reports and the stand-in builder."""
from __future__ import annotations

import csv
import json
from collections import Counter

import pytest
from _evaluation_helpers import write_beir

from care.config import load_config
from care.data.io import DataError, write_jsonl
from care.data.tasks import load_task
from care.evaluation.benchmarks import averages, load_benchmark, resolve_paths
from care.evaluation.report import columns, write_summary

# ---- bad input ---------------------------------------------------------------------------------------------

def test_bad_task_files_name_file_line_and_field(tmp_path, samples):
    folder = write_beir(tmp_path / "beir", {"d1": "头痛"}, {"q1": "头疼怎么办"}, {"q1": {"d1": 1, "d404": 1}})
    with pytest.raises(DataError) as err:
        load_task("retrieval", folder)
    assert "qrels/test.tsv" in str(err.value) and "line 3" in str(err.value) and "d404" in str(err.value)

    empty = tmp_path / "empty.jsonl"
    write_jsonl(empty, [{"query": "头痛", "positive": [], "negative": []}])
    with pytest.raises(DataError, match="line 1.*no candidates"):
        load_task("reranking", empty)

    wrong = tmp_path / "sts.jsonl"
    write_jsonl(wrong, [{"text1": "头痛", "text2": "头疼", "score": 1}])
    with pytest.raises(DataError) as err:
        load_task("sts", wrong)
    assert str(wrong) in str(err.value) and "sentence1" in str(err.value) and "line 1" in str(err.value)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_task("sts", tmp_path / "missing.jsonl")


# ---- benchmarks, Avg, reports -------------------------------------------------------------------------------

def test_benchmark_configs_compose_and_missing_paths_are_named():
    cfg = load_config("evaluate")
    assert cfg.model.name == "me5_small" and cfg.benchmark.name == "cmedteb_open"
    assert cfg.extra_benchmark.name == "cmedqa2_retrieval" and list(cfg.baselines) == ["bm25", "me5_small"]
    open_bench = load_benchmark(cfg.benchmark)
    assert [t.slot for t in open_bench.tasks] == ["CMed v1", "CMed v2", "Retrieval", "Rerank", "STS"]
    assert [t.primary for t in open_bench.tasks] == ["map_cut_10", "map_cut_10", "ndcg_cut_10", "map_cut_10", "pearson"]
    assert open_bench.open_stand_in

    real = load_benchmark(load_config("evaluate", ["benchmark=cmedteb"]).benchmark)
    with pytest.raises(FileNotFoundError) as err:  # conftest sets HF_HUB_OFFLINE=1: no hub fallback
        resolve_paths(real)
    msg = str(err.value)
    for key in ("cmed_v1", "cmed_v2", "retrieval", "rerank", "sts"):
        assert f"benchmark.tasks.{key}.path=" in msg
    assert "C-MTEB/CMedQAv1-reranking" in msg and "BEIR folder" in msg

    extra = load_benchmark(load_config("evaluate").extra_benchmark, "extra_benchmark")
    assert [t.key for t in resolve_paths(extra, "extra_benchmark")] == ["cmedqa2"]  # the optional one is skipped
    assert averages(open_bench, dict(zip([t.key for t in open_bench.tasks], [0.5, 0.6, 0.4, 0.7, 0.9]))) == \
        {"avg": pytest.approx(100 * (0.5 + 0.6 + 0.4 + 0.7 + 0.9) / 5)}
    assert averages(open_bench, {"cmed_v1": 0.5}) == {}


def test_report_files_say_open_stand_in(tmp_path):
    bench = load_benchmark(load_config("evaluate").benchmark)
    cols = columns([bench])
    rows = [{"label": f"m{i}", "scores": {c["key"]: 10.0 * (i + 1) for c in cols},
             "efficiency": {"online_parameters": 117_000_000, "online_parameters_without_embeddings": 21_000_000,
                            "query_latency_ms_p50": 12.0, "query_latency_ms_p95": 20.0, "docs_per_second": 80.0}}
            for i in range(2)]
    text = write_summary(tmp_path, "run", [bench], rows, {"table_method": "dense"})
    assert "open stand-in" in text and "| m1 | 20.00 |" in text and "| 117.0 | 21.0 | 12.0 | 20.0 | 80 |" in text
    assert "| Model | CMed v1 MAP@10 (stand-in) |" in text and "| Avg (stand-in) |" in text
    assert "cEpilepsyQA" in text  # slot sources named
    assert (tmp_path / "slots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["benchmarks"][0]["open_stand_in"] is True


def test_report_shows_the_gain_over_the_zero_shot_baseline(tmp_path):
    bench = load_benchmark(load_config("evaluate").benchmark)
    cols = columns([bench])
    scores = {"tuned": 50.0, "me5": 47.5, "bm25": 90.0}
    rows = [{"name": n, "label": n, "baseline": n != "tuned", "efficiency": {},
             "scores": {c["key"]: v + j for j, c in enumerate(cols)}} for n, v in scores.items()]
    text = write_summary(tmp_path, "run", [bench], rows, {"table_method": "dense"})
    gain = next(line for line in text.splitlines() if line.startswith("| gain of tuned over me5 |"))
    # the difference to the first encoder baseline (never BM25), on every score column
    assert gain.split(" | ")[1:1 + len(cols)] == ["+2.50"] * len(cols)
    assert not any(line.startswith("| gain of me5") or "over bm25" in line for line in text.splitlines())


# ---- the stand-in builder on the real shared data ---------------------------------------------------------

def test_stand_in_builder_matches_the_raw_files(shared, tmp_path):
    from omegaconf import OmegaConf

    from data_pipeline.benchmarks import build

    data = OmegaConf.to_container(load_config("data_pipeline").data, resolve=True)
    stats = build("cmedteb_open", data, tmp_path)
    out = tmp_path / "benchmarks" / "cmedteb_open"

    # Retrieval: every distinct non-empty KUAKE-QTR title; dev queries with a title labelled >= 1
    titles, dev_q = set(), {}
    for split in ("train", "dev", "test"):
        for r in json.loads((shared / "cblue_kuake_qtr" / f"KUAKE-QTR_{split}.json").read_text(encoding="utf-8")):
            if r["title"].strip():
                titles.add(r["title"].strip())
            if split == "dev":
                dev_q[r["query"].strip()] = max(dev_q.get(r["query"].strip(), 0), int(r["label"]))
    ret = load_task("retrieval", out / "retrieval", split="dev")
    assert set(ret.docs.values()) == titles
    assert sorted(ret.queries.values()) == sorted(q for q, best in dev_q.items() if best >= 1)
    assert stats["slots"]["retrieval"]["dropped_no_relevant"] == sum(best < 1 for best in dev_q.values())

    # STS: KUAKE-QQR dev without s9
    qqr = [r for r in json.loads((shared / "cblue_kuake_qqr" / "KUAKE-QQR_dev.json").read_text(encoding="utf-8"))
           if r["id"] != "s9"]
    sts = load_task("sts", out / "sts" / "dev.jsonl", split="dev")
    assert sts.gold == [float(r["label"]) for r in qqr]

    # CMed v2: the trusted questions (1-2 positives) of the ChineseBLUE cMedQA2 test file
    pos = Counter()
    with open(shared / "chineseblue_cmedqa2_pairs" / "test.txt", encoding="utf-8", newline="") as fh:
        for label, question, answer in csv.reader(fh, delimiter="\t"):  # csv-quoted TSV
            pos[question.strip()] += int(label)
    v2 = load_task("reranking", out / "cmed_v2" / "test.jsonl")
    assert sorted(v2.queries.values()) == sorted(q for q, n in pos.items() if 1 <= n <= 2)

    # CMed v1: 490 cEpilepsyQA test questions, one positive each, 95-100 unique candidates
    v1 = load_task("reranking", out / "cmed_v1" / "test.jsonl")
    sizes = [len(j) for j in v1.qrels.values()]
    assert len(v1.queries) == 490 and min(sizes) >= 95 and max(sizes) <= 100
    assert all(sum(j.values()) == 1 for j in v1.qrels.values())

    # Rerank: every positive came from a cMedIR label >= 2
    labels = {}
    for line in (shared / "chineseblue_cmedir" / "test.json").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        for d in r["documents"]:
            key = (r["query"].strip(), d["title"].lstrip(":").strip())
            labels[key] = max(labels.get(key, 0), int(d["label"]))  # a title judged twice keeps its best label
    for row in map(json.loads, (out / "rerank" / "test.jsonl").read_text(encoding="utf-8").splitlines()):
        assert all(labels[(row["query"], t)] >= 2 for t in row["positive"])
        assert all(labels[(row["query"], t)] <= 1 for t in row["negative"])
        assert row["positive_grades"] == [labels[(row["query"], t)] for t in row["positive"]]

    mtime = (out / "sts" / "dev.jsonl").stat().st_mtime_ns
    assert build("cmedteb_open", data, tmp_path).get("skipped") is True  # idempotent
    assert (out / "sts" / "dev.jsonl").stat().st_mtime_ns == mtime


def test_a_cmedqa2_release_folder_loads_as_retrieval(shared):
    """cEpilepsyQA ships in cMedQA2's release format: the loader behind `cmedqa2_release` (reader: cmedqa_release)."""
    data = load_task("retrieval", shared / "cepilepsyqa", split="test", reader="cmedqa_release")
    with open(shared / "cepilepsyqa" / "answer.csv", encoding="utf-8", newline="") as fh:
        answers = {r["ans_id"]: r["content"].strip() for r in csv.DictReader(fh)}
    with open(shared / "cepilepsyqa" / "test_candidates.txt", encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(data.docs.values()) == sorted(answers.values())  # the corpus is every answer
    assert len(data.queries) == len({r["question_id"] for r in rows})
    positives = {(r["question_id"], r["ans_id"]) for r in rows if r["label"] == "1"}
    got = {(q.split(":", 2)[2], d.split(":", 2)[2]) for q, j in data.qrels.items() for d, g in j.items() if g >= 1}
    assert got == positives
