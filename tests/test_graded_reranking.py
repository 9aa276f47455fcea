"""Graded reranking: `positive_grades` (C-MTEB reranking JSON Lines, written by data_pipeline/benchmarks.py
for cMedIR) is each positive's nDCG gain, while MAP, MRR and Hit stay binary; the scores of a hand-made
graded file through the reranking runner equal pytrec_eval's (trec_eval: grade >= 1 is relevant, nDCG
gain = grade).  Bad grades name file, line and field.  Reranking tasks report the full-list MAP
(`map_cut_1000`, C-MTEB's main score for its CMedQA sets) beside MAP@10."""
from __future__ import annotations

import json

import numpy as np
import pytest
import pytrec_eval

from care.config import load_config
from care.data.io import DataError
from care.data.tasks import load_task
from care.evaluation.benchmarks import load_benchmark
from care.evaluation.report import metric_label
from care.evaluation.tasks import run_reranking

METRICS = ["ndcg_cut_10", "map_cut_10", "map_cut_1000", "success_1", "recall_100"]
PYTREC = {"ndcg_cut_10": ("ndcg_cut", "ndcg_cut_10"), "map_cut_10": ("map_cut", "map_cut_10"),
          "map_cut_1000": ("map_cut", "map_cut_1000"), "success_1": ("success", "success_1"),
          "recall_100": ("recall", "recall_100")}

# (query, positives with grades, negatives); the second query has no grades (every positive gains 1) and is
# split over two lines (merged by the reader); the third has 14 candidates, one positive below rank 10.
ROWS = [
    {"query": "头痛怎么办", "positive": ["多休息", "吃止痛药", "看医生"], "positive_grades": [3, 1, 2],
     "negative": ["多运动", "喝咖啡", "熬夜", "吃辣", "跑步"]},
    {"query": "发烧", "positive": ["多喝水"], "negative": ["吃冰淇淋", "洗冷水澡"]},
    {"query": "发烧", "positive": ["退烧药"], "negative": ["熬夜"]},
    {"query": "咳嗽", "positive": ["润喉", "止咳糖浆"], "positive_grades": [4, 2],
     "negative": [f"无关{i}" for i in range(12)]},
]


class FixedScorer:
    """Scores from a hand-written table: {(query, candidate): score}."""

    methods = ("fixed",)

    def __init__(self, table: dict[tuple[str, str], float]):
        self.table = table

    def prepare(self, queries, docs, task=None):
        table = self.table

        class Prepared:
            def score(self, method, qi, positions):
                return np.array([table[(queries[qi], docs[p])] for p in positions], dtype=np.float64)

        return Prepared()


def _write(path, rows, blank_first=False):
    path.write_text(("\n" if blank_first else "") + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _scores() -> dict[tuple[str, str], float]:
    """A ranking that is not the ideal one: the grade-1 positive first, the grade-3 one third, ..."""
    rng = np.random.default_rng(0)
    table = {}
    for row in ROWS:
        for text in row["positive"] + row["negative"]:
            table[(row["query"], text)] = float(rng.random())
    table[("头痛怎么办", "吃止痛药")], table[("头痛怎么办", "多休息")] = 0.99, 0.5
    table[("咳嗽", "润喉")], table[("咳嗽", "止咳糖浆")] = -1.0, 0.999  # grade 4 ranked last of 14
    return table


def test_grades_become_qrels_grades(tmp_path):
    data = load_task("reranking", _write(tmp_path / "test.jsonl", ROWS))
    by_text = {data.queries[q]: {data.docs[d]: g for d, g in judged.items()} for q, judged in data.qrels.items()}
    assert by_text["头痛怎么办"] == {"多休息": 3, "吃止痛药": 1, "看医生": 2, "多运动": 0, "喝咖啡": 0, "熬夜": 0,
                                "吃辣": 0, "跑步": 0}
    assert by_text["发烧"] == {"多喝水": 1, "吃冰淇淋": 0, "洗冷水澡": 0, "退烧药": 1, "熬夜": 0}
    assert by_text["咳嗽"]["润喉"] == 4 and by_text["咳嗽"]["止咳糖浆"] == 2


def test_runner_matches_pytrec_eval_on_a_graded_file(tmp_path):
    data = load_task("reranking", _write(tmp_path / "test.jsonl", ROWS))
    table = _scores()
    items: dict = {}
    got = run_reranking(data, FixedScorer(table), METRICS, items=items)["fixed"]

    run = {q: {d: table[(data.queries[q], data.docs[d])] for d in judged} for q, judged in data.qrels.items()}
    measures = {family for family, _ in PYTREC.values()}
    ref = pytrec_eval.RelevanceEvaluator(data.qrels, measures).evaluate(run)
    for metric, (_, key) in PYTREC.items():
        per_query = {q: items["fixed"]["per_query"][q][metric] for q in data.qrels}
        assert per_query == pytest.approx({q: ref[q][key] for q in data.qrels}, abs=1e-9), metric
        assert got[metric] == pytest.approx(np.mean([ref[q][key] for q in data.qrels]), abs=1e-9), metric

    # nDCG really is graded (binary relevance would give another number); MAP is binary (same numbers)
    binary = {q: {d: int(g >= 1) for d, g in judged.items()} for q, judged in data.qrels.items()}
    flat = pytrec_eval.RelevanceEvaluator(binary, {"ndcg_cut", "map_cut"}).evaluate(run)
    assert got["ndcg_cut_10"] != pytest.approx(np.mean([flat[q]["ndcg_cut_10"] for q in binary]), abs=1e-6)
    assert got["map_cut_10"] == pytest.approx(np.mean([flat[q]["map_cut_10"] for q in binary]), abs=1e-9)
    # the full-list MAP sees the positive ranked 14th that MAP@10 misses
    assert got["map_cut_1000"] > got["map_cut_10"]


GOOD = {"query": "头痛", "positive": ["休息", "吃药"], "negative": ["运动"]}


@pytest.mark.parametrize("grades, field", [
    ([2], "positive_grades"),                 # one grade for two positives
    ("3", "positive_grades"),                 # not a list
    ([2, 0], "positive_grades[1]"),           # grades start at 1 (a positive is relevant)
    ([2, -1], "positive_grades[1]"),
    ([1.5, 2], "positive_grades[0]"),
    (["2", 1], "positive_grades[0]"),
    ([True, 2], "positive_grades[0]"),
])
def test_bad_grades_name_file_line_field(tmp_path, grades, field):
    path = _write(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "query": "发烧", "positive_grades": grades}], blank_first=True)
    with pytest.raises(DataError) as err:
        load_task("reranking", path)
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 3, field)


def test_a_positive_listed_twice_keeps_its_highest_grade_and_sides_still_conflict(tmp_path):
    rows = [{"query": "头痛", "positive": ["休息"], "positive_grades": [2], "negative": ["运动"]},
            {"query": "头痛", "positive": ["休息", "吃药"], "positive_grades": [3, 1], "negative": []}]
    data = load_task("reranking", _write(tmp_path / "t.jsonl", rows))
    (judged,) = data.qrels.values()
    assert {data.docs[d]: g for d, g in judged.items()} == {"休息": 3, "运动": 0, "吃药": 1}
    with pytest.raises(DataError, match="both as positive and as negative") as err:
        load_task("reranking", _write(tmp_path / "c.jsonl", rows + [{**GOOD, "negative": ["休息"]}]))
    assert err.value.line == 3


def test_reranking_tasks_report_full_list_map_beside_map_at_10():
    for name in ("cmedteb_open", "cmedteb"):
        bench = load_benchmark(load_config("evaluate", [f"benchmark={name}"]).benchmark)
        reranking = [t for t in bench.tasks if t.type == "reranking"]
        assert [t.key for t in reranking] == ["cmed_v1", "cmed_v2", "rerank"]
        for t in reranking:
            assert "map_cut_1000" in t.metrics and "map_cut_10" in t.metrics and t.primary == "map_cut_10"
    assert metric_label("map_cut_1000") == "MAP@1000"
