"""`python -m data_pipeline stage=...`: a stage, a list of stages, or a named set (all, training)."""
from __future__ import annotations

import subprocess
import sys

from care.paths import PROJECT_ROOT
from data_pipeline.__main__ import ORDER, STAGES, stage_names


def test_named_sets_lists_and_single_stages():
    assert stage_names("all") == ORDER == ["import", "dedup", "build", "mine", "benchmarks", "nano"]
    assert stage_names("training") == ["import", "dedup", "build", "mine", "benchmarks"]  # make run: no nano
    assert stage_names("score") == ["score"] and "score" in STAGES
    assert stage_names(["build", "mine"]) == ["build", "mine"]


def test_an_unknown_stage_in_a_list_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "data_pipeline", "stage=[import,minee]", f"out_root={tmp_path}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "unknown stage 'minee'" in proc.stderr and "training: import, dedup, build, mine, benchmarks" in proc.stderr
    assert not (tmp_path / "data" / "import").exists()  # nothing ran
