"""care.evaluation.tradeoff: each row a share of the reference of its own evaluation run."""
import json
from itertools import pairwise

import pytest

from care.data.io import write_json
from care.evaluation.tradeoff import label_heights, main, run_rows


def summary(folder, run, models):
    """A summary.json as evaluate.py writes it (care/evaluation/report.py write_summary), with `models` as
    (name, slot scores, p50 ms)."""
    cols = [{"key": f"b/{k}", "title": k, "benchmark": "b", "slot": True} for k in ("v1", "sts", "avg")]
    rows = [{"name": name, "label": name.upper(), "scores": {**{f"b/{k}": v for k, v in scores.items()},
                                                             "b/avg": sum(scores.values()) / len(scores)},
             "efficiency": {} if p50 is None else {"query_latency_ms_p50": p50, "query_latency_ms_p95": 2 * p50,
                                                   "online_parameters": 7_300_000,
                                                   "online_parameters_without_embeddings": 1_250_000}}
            for name, scores, p50 in models]
    write_json(folder / "summary.json", {"run": run, "columns": cols, "models": rows,
                                         "benchmarks": [{"name": "b", "avg": "Avg"}]})
    return folder


def test_each_row_is_a_share_of_its_own_runs_reference(tmp_path):
    one = summary(tmp_path / "one", "one", [("bm25", {"v1": 10, "sts": 0}, 1.0), ("me5_small", {"v1": 50, "sts": 70}, 12.0),
                                              ("care", {"v1": 30, "sts": 60}, 4.0)])
    two = summary(tmp_path / "two", "two", [("me5_small", {"v1": 50, "sts": 70}, 20.0), ("care8", {"v1": 40, "sts": 68}, 9.0)])
    rows = run_rows(one, "me5_small", None, keep_reference=False) + run_rows(two, "me5_small", None, False)
    assert [r["model"] for r in rows] == ["care", "care8"]  # BM25 and the reference are left out
    care, care8 = rows
    assert care["avg_pct"] == round(100 * 45 / 60, 1) and care["latency_pct"] == round(100 * 4 / 12, 1)
    assert care8["latency_pct"] == 45.0  # 9 ms against run two's 20 ms, not run one's 12
    assert care["slots"] == {"v1": 30, "sts": 60} and care["online_parameters_without_embeddings_M"] == 1.2
    kept = run_rows(one, "me5_small", None, keep_reference=True)
    assert [r["avg_pct"] for r in kept if r["model"] == "me5_small"] == [100.0]


def test_a_run_without_the_reference_or_latency(tmp_path):
    run = summary(tmp_path / "r", "r", [("care", {"v1": 30, "sts": 60}, None), ("me5_small", {"v1": 50, "sts": 70}, None)])
    assert run_rows(run, "me5_small", None, False)[0]["latency_pct"] is None  # efficiency off: no latency share
    with pytest.raises(ValueError, match="summary.json: no reference model 'other'"):
        run_rows(run, "other", None, False)
    with pytest.raises(ValueError, match="no benchmark 'nope'"):
        run_rows(run, "me5_small", "nope", False)


def test_the_command_writes_json_table_and_plot(tmp_path, capsys):
    run = summary(tmp_path / "r", "r", [("me5_small", {"v1": 50, "sts": 70}, 12.0), ("care", {"v1": 30, "sts": 60}, 4.0)])
    out = tmp_path / "res" / "care.json"
    main([str(run), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["runs"] == ["r"] and saved["rows"][0]["avg_pct"] == 75.0
    assert (tmp_path / "res" / "care_tradeoff.png").stat().st_size > 0
    assert "| r | CARE | 30.00 | 60.00 | 45.00 | 75.0 | 4.0 | 12.0 | 33.3 |" in capsys.readouterr().out
    assert out.with_suffix(".md").read_text().count("\n") == 3


def test_seed_groups_mean_and_sd_over_a_runs_seeds(tmp_path, capsys):
    """Rows named <stem>-s<seed> in one run form a group: mean and sample sd (numpy, ddof=1) of each cell; a
    name without a seed stays alone; the same stem in another run is another group."""
    import numpy as np

    one = summary(tmp_path / "one", "one", [("me5_small", {"v1": 50, "sts": 70}, 10.0),
                                              ("t/g-s42", {"v1": 30, "sts": 60}, 4.0), ("t/g-s1", {"v1": 34, "sts": 61}, 5.0),
                                              ("t/g-s2", {"v1": 29, "sts": 65}, 3.0), ("t/h-s42", {"v1": 20, "sts": 50}, 4.0),
                                              ("t/e", {"v1": 55, "sts": 70}, 11.0)])
    two = summary(tmp_path / "two", "two", [("me5_small", {"v1": 50, "sts": 70}, 20.0), ("t/g-s7", {"v1": 1, "sts": 2}, 4.0)])
    out = tmp_path / "res" / "claim.json"
    main([str(one), str(two), "--out", str(out), "--note", "idle"])
    saved = json.loads(out.read_text())
    groups = {(g["run"], g["model"]): g for g in saved["seed_groups"]}
    assert set(groups) == {("one", "t/g"), ("one", "t/h"), ("two", "t/g")}
    g = groups[("one", "t/g")]
    assert g["seeds"] == [1, 2, 42] and g["n"] == 3
    v1 = np.array([30, 34, 29])
    assert g["slots"]["v1"]["mean"] == pytest.approx(v1.mean()) and g["slots"]["v1"]["sd"] == pytest.approx(v1.std(ddof=1))
    lat = np.array([40.0, 50.0, 30.0])  # % of run one's 10 ms
    assert g["latency_pct"]["mean"] == pytest.approx(lat.mean()) and g["latency_pct"]["sd"] == pytest.approx(lat.std(ddof=1))
    assert groups[("one", "t/h")]["avg"] == {"mean": 35.0, "sd": None}  # one seed: no spread
    assert groups[("two", "t/g")]["avg_pct"]["mean"] == pytest.approx(round(100 * 1.5 / 60, 1))
    assert saved["measured"]["note"] == "idle" and [m["run"] for m in saved["measured"]["runs"]] == ["one", "two"]
    assert "| one | t/g | 1, 2, 42 | 31.00 ± 2.65 |" in capsys.readouterr().out
    assert (tmp_path / "res" / "claim_tradeoff.png").stat().st_size > 0


def test_seed_group_labels_keep_apart_and_never_sit_above_their_point():
    # d60, d20, c and h as measured: within 3 points of each other, so labels at their points would overlap
    ys = [98.7, 96.4, 95.4, 93.7, 84.1]
    heights = label_heights(ys, gap=2.2)
    order = sorted(range(len(ys)), key=lambda i: -ys[i])
    assert all(heights[i] <= ys[i] for i in range(len(ys)))
    assert all(heights[a] - heights[b] >= 2.2 - 1e-9 for a, b in pairwise(order))
    assert heights[0] == 98.7 and heights[4] == 84.1  # a label with room stays level with its point
    assert label_heights([50.0, 90.0], gap=2.2) == [50.0, 90.0]  # points' order kept
