"""The gain format and the efficiency columns, written once (care/data/numbers.py) for every table that shows
them: evaluate.py's report, the model card, the compare table.  Expected strings are written by hand."""
from __future__ import annotations

from care.data.numbers import EFFICIENCY_TITLES, efficiency_cells, fmt_gain, gain_rows

EFF = {"online_parameters": 117_653_760, "online_parameters_without_embeddings": 21_000_000,
       "query_latency_ms_p50": 12.345, "query_latency_ms_p95": 20.0, "docs_per_second": 1101.5}


def test_a_gain_is_signed_with_two_decimals_or_n_a():
    assert fmt_gain(52.5, 50.0) == "+2.50" and fmt_gain(50.0, 52.556) == "-2.56" and fmt_gain(0.0) == "+0.00"
    assert fmt_gain(None, 1.0) == fmt_gain(1.0, None) == "n/a"
    assert fmt_gain(-0.004) == "-0.00"  # a difference already taken (compare's rows)


def test_efficiency_columns_are_scaled_and_rounded():
    assert EFFICIENCY_TITLES == ["Online params (M)", "w/o token embeddings (M)", "Query ms p50", "Query ms p95",
                                 "Docs/s"]
    assert efficiency_cells(EFF) == ["117.7", "21.0", "12.3", "20.0", "1,102"]
    assert efficiency_cells({"docs_per_second": 5.0}) == ["n/a"] * 4 + ["5"]
    assert efficiency_cells(None) == ["n/a"] * 5


def test_gain_rows_pad_the_efficiency_columns_and_add_intervals_only_when_computed():
    keys = ["a", "b"]
    one = gain_rows("gain over X", {"a": 3.0, "b": None}, {"a": 1.0, "b": 2.0}, {"a": None}, keys)
    assert one == ["| gain over X | +2.00 | n/a |  |  |  |  |  |"]
    two = gain_rows("g", {"a": 3.0, "b": 4.0}, {"a": 1.0, "b": 2.0},
                    {"b": {"difference": 2.0, "low": 0.5, "high": 3.25}}, keys)
    assert two == ["| g | +2.00 | +2.00 |  |  |  |  |  |", "| 95% interval of that gain |  | [+0.50, +3.25]* |  |  |  |  |  |"]


def test_report_and_card_show_one_row_alike():
    """The report's and the card's cells of one model row come from the same helpers: same strings."""
    from care.config import load_config
    from care.evaluation.benchmarks import load_benchmark
    from care.evaluation.report import columns, markdown
    from care.export.card_sections import evaluation_section

    bench = load_benchmark(load_config("evaluate").benchmark)
    cols = columns([bench])
    rows = [{"name": "t", "label": "T", "baseline": False, "efficiency": EFF, "scores": {c["key"]: 51.0 for c in cols},
             "gain": {"over": "m", "intervals": {}}},
            {"name": "m", "label": "M", "baseline": True, "efficiency": {}, "scores": {c["key"]: 50.0 for c in cols}}]
    scores, gains = " | ".join(["51.00"] * len(cols)), " | ".join(["+1.00"] * len(cols))
    summary = {"run": "r", "columns": cols, "models": rows, "settings": {}, "benchmarks": []}
    card = evaluation_section(summary, "t")
    report = markdown("r", [bench], rows, {}).splitlines()
    assert f"| **T** | {scores} | 117.7 | 21.0 | 12.3 | 20.0 | 1,102 |" in card
    assert f"| T | {scores} | 117.7 | 21.0 | 12.3 | 20.0 | 1,102 |" in report
    assert f"| gain over M | {gains} |  |  |  |  |  |" in card
    assert f"| gain of T over M | {gains} |  |  |  |  |  |" in report
