"""The CLI of care/evaluation/trec.py against pytrec_eval, and its run and qrels readers on bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from _metrics_helpers import TOL, brute_map_min_r, pytrec, random_case, reference_order

from care.data.io import DataError
from care.evaluation.metrics import DEFAULT_METRICS
from care.evaluation.trec import main, read_trec_qrels, read_trec_run
from care.paths import PROJECT_ROOT

# ---------------------------------------------------------------- the CLI

def write_trec_files(tmp_path, run, qrels):
    rng = np.random.default_rng(0)
    lines = [f"{qid} Q0 {doc} {rng.integers(1, 99)} {score!r} tag"  # rank column deliberately wrong
             for qid, docs in run.items() for doc, score in docs.items()]
    rng.shuffle(lines)  # file order plays no part either
    (tmp_path / "run.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "qrels.txt").write_text(
        "".join(f"{qid}\t0\t{doc}\t{rel}\n" for qid, docs in qrels.items() for doc, rel in docs.items()),
        encoding="utf-8")
    return tmp_path / "run.txt", tmp_path / "qrels.txt"


def test_cli_matches_pytrec_eval(tmp_path):
    run, qrels = random_case(6)
    run = {qid: docs for qid, docs in run.items() if docs}  # a run file cannot hold an empty list
    run_path, qrels_path = write_trec_files(tmp_path, run, qrels)
    assert read_trec_run(run_path) == run and read_trec_qrels(qrels_path) == qrels
    extra = "ndcg_cut_20,map_cut_100,recall_1000,success_5,mrr_100,map_min_r_10"
    proc = subprocess.run([sys.executable, "-m", "care.evaluation.trec", str(run_path), str(qrels_path),
                           "--metrics", extra], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1
    out = json.loads(proc.stdout)
    expected_keys = {"num_q", *DEFAULT_METRICS, *extra.split(",")}
    assert set(out) == expected_keys and out["num_q"] == len(qrels)

    ref = pytrec(run, qrels, {"ndcg_cut.10,20", "map_cut.10,100", "recip_rank", "success.1,5,10,1000",
                              "recall.100,1000"})
    for name in expected_keys - {"num_q", "mrr_10", "mrr_100", "map_min_r_10"}:
        # queries missing from the run add 0 to the sum: the mean is over all qrels queries
        assert out[name] == pytest.approx(sum(v[name] for v in ref.values()) / len(qrels), abs=TOL), name
    assert out["mrr_100"] == pytest.approx(sum(v["recip_rank"] for v in ref.values()) / len(qrels), abs=TOL)
    cut = {qid: {d: docs[d] for d in reference_order(docs)[:10]} for qid, docs in run.items()}
    mrr10 = pytrec(cut, qrels, {"recip_rank"})
    assert out["mrr_10"] == pytest.approx(sum(v["recip_rank"] for v in mrr10.values()) / len(qrels), abs=TOL)
    min_r = [brute_map_min_r(reference_order(run.get(q, {})), j, 10, 1) for q, j in qrels.items()]
    assert out["map_min_r_10"] == pytest.approx(np.mean(min_r), abs=TOL)


def test_cli_skip_missing_and_unknown_metric(tmp_path, capsys):
    run, qrels = random_case(8)
    run = {qid: docs for qid, docs in run.items() if docs}
    run_path, qrels_path = write_trec_files(tmp_path, run, qrels)
    assert main([str(run_path), str(qrels_path), "--skip-missing"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = pytrec(run, qrels, {"success.10"})
    assert out["num_q"] == len(ref) < len(qrels)
    assert out["success_10"] == pytest.approx(np.mean([v["success_10"] for v in ref.values()]), abs=TOL)
    with pytest.raises(SystemExit) as exc:
        main([str(run_path), str(qrels_path), "--metrics", "ndcg@10"])
    assert exc.value.code == 2 and "unknown metric 'ndcg@10'" in capsys.readouterr().err


@pytest.mark.parametrize("kind,text,line,field", [
    ("run", "q1 Q0 d1 1 0.5 t\nq1 Q0 d2 2 0.4\n", 2, None),
    ("run", "q1 Q0 d1 1 0.5 t\n\nq1 Q0 d2 2 high t\n", 3, "score"),
    ("run", "q1 Q0 d1 1 nan t\n", 1, "score"),
    ("run", "q1 Q0 d1 1 0.5 t\nq2 Q0 d1 1 0.5 t\nq1 Q0 d1 3 0.2 t\n", 3, "docid"),
    ("qrels", "q1 0 d1 1\nq1 0 d2 1 extra\n", 2, None),
    ("qrels", "q1 0 d1 1\nq1 0 d2 1.5\n", 2, "rel"),
    ("qrels", "q1 0 d1 1\nq1 0 d1 2\n", 2, "docid"),
])
def test_bad_input_names_file_line_field(tmp_path, kind, text, line, field):
    path = tmp_path / f"{kind}.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as exc:
        (read_trec_run if kind == "run" else read_trec_qrels)(path)
    assert (exc.value.path, exc.value.line, exc.value.field) == (str(path), line, field)
    assert str(path) in str(exc.value) and f"line {line}" in str(exc.value)


def test_cli_reports_bad_input_and_exits_nonzero(tmp_path):
    (tmp_path / "run.txt").write_text("q1 Q0 d1 1 0.5 t\nq1 Q0 d2 2 oops t\n", encoding="utf-8")
    (tmp_path / "qrels.txt").write_text("q1 0 d1 1\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "care.evaluation.trec", str(tmp_path / "run.txt"),
                           str(tmp_path / "qrels.txt")], capture_output=True, text=True, cwd=PROJECT_ROOT,
                          timeout=60, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"{tmp_path / 'run.txt'}, line 2, field 'score'" in proc.stderr
