"""A recipe study's table (care/training/study.py) from training runs' metrics.jsonl: arms grouped over seeds
(mean and sample sd checked against numpy), the last validation against step 0, CARE stage folders, and a
run without validation refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from care.training.study import arms, main, run_row


def write_run(folder, values, align=None, steps=3, step_seconds=2.0):
    """A run log: training rows, then validations at step 0 and at the last step."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "val/map_cut_10": values[0], "val/best": values[0], "val/seconds": 1.0}]
    rows += [{"step": s, "loss/loss": 1.0 / s, "step_seconds": step_seconds} for s in range(1, steps + 1)]
    rows.append({"step": steps, "val/map_cut_10": values[1], "val/best": max(values), "val/seconds": 1.0})
    if align:
        rows.append({"step": steps, "val/align_cos": align[0], "val/align_acc": align[1], "val/align_seconds": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


def test_arms_average_their_seeds_best_first(tmp_path):
    a0 = write_run(tmp_path / "study-lr3e-4-s0", (0.30, 0.41), align=(0.80, 0.50))
    a1 = write_run(tmp_path / "study-lr3e-4-s1", (0.30, 0.45), align=(0.84, 0.60))
    b0 = write_run(tmp_path / "study-base-s0", (0.30, 0.42), steps=5)
    rows = [run_row(f, "stage1") for f in (b0, a0, a1)]  # the worse arm first: the table sorts them
    assert rows[1]["arm"] == "study-lr3e-4" and rows[1]["seed"] == 0 and rows[1]["start"] == 0.30
    assert rows[0]["steps"] == 5 and rows[0]["train_seconds"] == 10.0
    entries = arms(rows)
    assert [e["arm"] for e in entries] == ["study-lr3e-4", "study-base"]  # mean 0.43 before 0.42
    lr = entries[0]
    assert lr["n"] == 2 and lr["seeds"] == [0, 1]
    assert lr["value"] == pytest.approx(np.mean([0.41, 0.45]))
    assert lr["value_sd"] == pytest.approx(np.std([0.41, 0.45], ddof=1))
    assert lr["val/align_cos"] == pytest.approx(0.82) and lr["val/align_acc_sd"] == pytest.approx(np.std([0.5, 0.6], ddof=1))
    assert entries[1]["value_sd"] is None and "val/align_cos" not in entries[1]


def test_a_care_run_is_read_from_its_stage_folder_and_the_cli_writes_the_table(tmp_path, capsys):
    run = tmp_path / "care_study-spread-s0"
    write_run(run / "stage1", (0.10, 0.20))
    write_run(run / "stage2", (0.20, 0.90))
    main([str(run), "--out", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "study.json").read_text())["arms"][0]["value"] == 0.20
    assert "| care_study-spread | 0 | 3 | 20.00 | 10.00 |" in (tmp_path / "out" / "study.md").read_text()
    assert "1 runs, 1 arms" in capsys.readouterr().out
    main([str(run), "--stage", "stage2", "--out", str(tmp_path / "out2")])
    assert json.loads((tmp_path / "out2" / "study.json").read_text())["arms"][0]["value"] == 0.90


def test_a_run_without_validation_is_refused(tmp_path):
    folder = tmp_path / "run-s0"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/loss": 1.0}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no validation row"):
        run_row(folder, "stage1")
    with pytest.raises(FileNotFoundError, match="not a training run folder"):
        run_row(tmp_path / "empty", "stage1")


def make_dry_run(arms: str):
    import subprocess

    from care.paths import PROJECT_ROOT
    return subprocess.run(["make", "-n", "care-study", f"CARE_STUDY_ARMS={arms}", "CARE_STUDY_SEEDS=0 1"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, check=False)


def test_make_care_study_combines_arms_and_refuses_an_unknown_one():
    """`make care-study` (dry run): an arm joined by + takes each part's overrides, one run per seed and arm;
    a misspelt arm stops make instead of training today's recipe under the wrong name."""
    done = make_dry_run("spread+lr1e-3 base")
    assert done.returncode == 0, done.stderr
    runs = [line for line in done.stdout.splitlines() if " train.py " in line]
    assert [r.split("run_name=")[1].split()[0] for r in runs] == [
        "care_study-spread+lr1e-3-s0", "care_study-base-s0", "care_study-spread+lr1e-3-s1", "care_study-base-s1"]
    # the screen's base is pinned (first layers, lr 1e-4); an arm's overrides come after it, so they win
    pins = ["model.query.build.pick=first", "model.stages.stage1.trainer.lr=1e-4"]
    assert all(pin in runs[1] for pin in pins) and "pick=spread" not in runs[1] and "lr=1e-3" not in runs[1]
    arm = runs[0].split()
    assert arm.index("model.query.build.pick=spread") > arm.index(pins[0])
    assert arm.index("model.stages.stage1.trainer.lr=1e-3") > arm.index(pins[1])
    wrong = make_dry_run("spread+lr1e-5")
    assert wrong.returncode != 0 and "unknown CARE study arm 'lr1e-5'" in wrong.stderr
