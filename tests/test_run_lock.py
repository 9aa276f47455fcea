"""One run per folder: a second training or evaluation into a held folder is refused naming the holder; a
lock left by a dead process is taken over with a message; another host's only by a requeue or lock_force."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _training_helpers import make_training_files, train_config

from care.data.io import read_jsonl
from care.paths import PROJECT_ROOT
from care.runlock import LOCK_NAME, RunLock, RunLocked, lock_run_folder, locked_out_dir
from care.training.trainer import AlreadyFinished, Trainer

HOLD = ("import sys, time; from care.runlock import RunLock; RunLock(sys.argv[1], 'training').acquire(); "
        "print('held', flush=True); time.sleep(600)")


def holder_process(folder):
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_sidecar(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{LOCK_NAME}.json").write_text(json.dumps({"since": "2026-01-01T00:00:00", **fields}))


@pytest.fixture(scope="module")
def files(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("lock")
    return root, *make_training_files(root, request.getfixturevalue("shared"), n_questions=16)


def test_second_trainer_is_refused_and_a_killed_holder_is_taken_over(files, capsys):
    root, texts, train = files
    cfg = train_config(root, texts, train, "run", "trainer.max_steps=2")
    holder = holder_process(root / "run")
    try:
        with pytest.raises(RunLocked) as e:
            Trainer(cfg)
        message = str(e.value)
        assert "\n" not in message and f"pid {holder.pid} on host {socket.gethostname()}" in message, message
        assert "Slurm job 4242" in message and "since" in message, message
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the OS drops the flock, the record stays
        holder.wait()
    capsys.readouterr()
    first = Trainer(cfg)
    assert f"stale lock of pid {holder.pid}" in capsys.readouterr().err
    with pytest.raises(RunLocked, match=f"pid {os.getpid()} on host"):  # in-process: a second Trainer too
        Trainer(cfg)
    first.fit()
    rows = [r["step"] for r in read_jsonl(root / "run" / "metrics.jsonl") if "loss/loss" in r]
    assert rows == [1, 2]
    assert not (root / "run" / f"{LOCK_NAME}.json").exists()  # released at the end of fit
    with pytest.raises(AlreadyFinished):  # released on an error in __init__ too: the next one gets in
        Trainer(cfg)
    with pytest.raises(AlreadyFinished):
        Trainer(cfg)


def test_stale_and_foreign_sidecars(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    pid = dead_pid()
    write_sidecar(tmp_path / "a", pid=pid, host=socket.gethostname(), slurm_job_id=None)
    lock = RunLock(tmp_path / "a", "training").acquire()
    assert f"took over a stale lock of pid {pid}" in lock.notice and f"pid {pid}" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / f"{LOCK_NAME}.json").read_text())["pid"] == os.getpid()
    lock.release()

    # this host, the recorded process still running (this very test's parent): refused
    write_sidecar(tmp_path / "b", pid=os.getppid(), host=socket.gethostname())
    with pytest.raises(RunLocked, match="still running"):
        RunLock(tmp_path / "b").acquire()

    # another host: refused unless the same Slurm job (a requeue) or lock_force
    write_sidecar(tmp_path / "c", pid=1, host="node-elsewhere", slurm_job_id="77")
    with pytest.raises(RunLocked, match=r"pid 1 on host node-elsewhere, Slurm job 77.*lock_force=true"):
        RunLock(tmp_path / "c").acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert "requeued" in RunLock(tmp_path / "c").acquire().notice
    write_sidecar(tmp_path / "d", pid=1, host="node-elsewhere", slurm_job_id="78")
    with pytest.raises(RunLocked):
        RunLock(tmp_path / "d").acquire()
    assert "lock_force=true" in RunLock(tmp_path / "d", force=True).acquire().notice


def test_only_the_main_process_locks_and_evaluation_is_locked(tmp_path):
    worker = SimpleNamespace(is_main_process=False, num_processes=1)
    assert not lock_run_folder(tmp_path / "w", "training", worker).held and not (tmp_path / "w").exists()

    calls = []
    evaluate = locked_out_dir(lambda cfg: calls.append(cfg["out_dir"]) or "done")
    with RunLock(tmp_path / "eval", "evaluation"), \
            pytest.raises(RunLocked, match=r"in use by another evaluation \(pid"):
        evaluate({"out_dir": str(tmp_path / "eval")})
    assert calls == [] and evaluate({"out_dir": str(tmp_path / "eval")}) == "done"
    assert evaluate({"out_dir": str(tmp_path / "eval")}) == "done"  # released after each
