"""One run per stage folder and a skip check that reads the files (care/data/stage_start.py): a second run into
a folder another run holds (care/runlock.py's lock, held here by a separate process as tests/test_run_lock.py
does) is refused in one line naming it, and touches nothing; an output changed after its run (truncated,
edited to the same size, mixed in by another run) makes the next run redo the stage, naming the file, where
it used to say "skipped"; a stats.json written before outputs were recorded is still trusted on its
fingerprint; the whole-folder swap keeps the lock held.  Last, a syntax-tree check that every stage module
starts through the one helper and reads `force` nowhere else.  The references: file bytes compared before and
after, and the pid of the holding process."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import atomic_folder, write_jsonl
from care.data.stage_cache import LOCK_FILES, RECORD
from care.paths import PROJECT_ROOT
from care.runlock import RunLock, RunLocked
from data_pipeline.__main__ import STAGES
from data_pipeline.dedup import stage as dedup

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONPATH": str(PROJECT_ROOT)}
HOLD = ("import sys, time; from care.runlock import RunLock; RunLock(sys.argv[1], 'test').acquire(); "
        "print('held', flush=True); time.sleep(600)")
PLAIN = [{"id": "a", "text": "头痛怎么办"}, {"id": "b", "text": "头痛怎么办"}, {"id": "c", "text": "发烧了吃什么药"}]


def dedup_cfg(src, out, *extra):
    return OmegaConf.merge(load_config("data_pipeline"), OmegaConf.from_dotlist(
        [f"input={src}", f"out={out}", "dedup.stages=[exact,minhash]", *extra]))


def snapshot(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in LOCK_FILES}


def test_a_held_stage_folder_refuses_a_second_run(tmp_path):
    src, out = tmp_path / "plain.jsonl", tmp_path / "out"
    write_jsonl(src, PLAIN)
    dedup.run(dedup_cfg(src, out))
    write_jsonl(src, PLAIN[:2])  # a change: this run would rewrite every file
    before = snapshot(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=rf"{out} is in use by another dedup stage run \(pid {holder.pid} on "):
            dedup.run(dedup_cfg(src, out))
        cmd = [sys.executable, "-m", "data_pipeline", "stage=dedup", f"input={src}", f"out={out}",
               "dedup.stages=[exact,minhash]", f"hydra.run.dir={tmp_path / 'h'}"]
        cli = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, env=ENV, timeout=120)
        assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr[-2000:]
        line = cli.stderr.strip().splitlines()[-1]
        assert f"error in stage dedup: {out} is in use by another dedup stage run (pid {holder.pid}" in line, line
        assert snapshot(out) == before  # nothing written, nothing removed
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert dedup.run(dedup_cfg(src, out))["texts_in"] == 2  # the holder is gone: the stage runs


def test_a_changed_output_reruns_the_stage_instead_of_skipping(tmp_path, capsys):
    src, out = tmp_path / "plain.jsonl", tmp_path / "out"
    write_jsonl(src, PLAIN)
    first = dedup.run(dedup_cfg(src, out))
    kept = out / "kept.jsonl"
    assert dedup.run(dedup_cfg(src, out)).get("skipped")
    good = kept.read_bytes()

    kept.write_bytes(good[: len(good) // 2])  # truncated
    capsys.readouterr()
    again = dedup.run(dedup_cfg(src, out))
    assert not again.get("skipped") and kept.read_bytes() == good
    said = capsys.readouterr().out
    assert f"dedup: {kept} has {len(good) // 2:,} bytes, not the {len(good):,} its run wrote" in said, said

    kept.write_bytes(good.replace("头痛".encode(), "头疼".encode()))  # edited in place, same size
    assert len(kept.read_bytes()) == len(good)
    assert not dedup.run(dedup_cfg(src, out)).get("skipped") and kept.read_bytes() == good
    assert "its xxh3_128 digest differs" in capsys.readouterr().out

    (out / "clusters.jsonl").unlink()  # missing
    assert not dedup.run(dedup_cfg(src, out)).get("skipped")
    assert dedup.run(dedup_cfg(src, out)).get("skipped")  # as written again: skipped

    stats = json.loads((out / "stats.json").read_text(encoding="utf-8"))
    assert set(stats[RECORD]) == {"kept.jsonl", "clusters.jsonl"} == set(first[RECORD])
    assert stats[RECORD]["kept.jsonl"]["bytes"] == len(good)

    # a stats.json from before outputs were recorded: trusted on its fingerprint, as it always was
    del stats[RECORD]
    (out / "stats.json").write_text(json.dumps(stats), encoding="utf-8")
    kept.write_bytes(good[:10])
    assert dedup.run(dedup_cfg(src, out)).get("skipped")


def test_the_whole_folder_swap_keeps_the_lock_held(tmp_path):
    folder = tmp_path / "Nano"
    folder.mkdir()
    (folder / "README.md").write_text("old", encoding="utf-8")
    with RunLock(folder, "nano stage run"):
        with atomic_folder(folder, keep=lambda old: LOCK_FILES) as tmp:
            (tmp / "README.md").write_text("new", encoding="utf-8")
        assert (folder / "README.md").read_text(encoding="utf-8") == "new"
        with pytest.raises(RunLocked, match=f"pid {os.getpid()} on host"):  # the new folder's lock is the held one
            RunLock(folder, "nano stage run").acquire()
    RunLock(folder, "nano stage run").acquire().release()  # released with the run


def _calls(path) -> set[str]:
    """Names of every function called in a module, `a.b(...)` as b."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(tree) if isinstance(n, ast.Call)}


def _reads_force(path) -> bool:
    """Whether a module reads a "force" key itself (cfg.get("force"), cfg["force"], cfg.force)."""
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Constant) and n.value == "force":
            return True
        if isinstance(n, ast.Attribute) and n.attr == "force" and not (isinstance(n.value, ast.Name)
                                                                       and n.value.id == "start"):
            return True
    return False


@pytest.mark.parametrize("module", list(STAGES.values()))
def test_every_stage_starts_through_the_one_helper(module):
    path = PROJECT_ROOT / (module.replace(".", "/") + ".py")
    calls = _calls(path)
    assert "stage_start" in calls, f"{path.name} does not start through care.data.stage_start"
    by_hand = calls & {"up_to_date", "claim_outputs", "mark_in_progress", "atomic_folder", "RunLock",
                       "written_by", "changed_output"}
    assert not by_hand, f"{path.name} calls {sorted(by_hand)} itself: that is stage_start's"
    assert not _reads_force(path), f"{path.name} reads `force` itself (care.data.stage_start.forced does)"
    source = path.read_text(encoding="utf-8")
    assert '/ "stats.json"' not in source, f"{path.name} writes stats.json itself (StageStart.finish does)"


def test_every_stage_says_its_seconds_and_the_timeline_reads_them(tmp_path):
    """A stage whose stats give no top-level `seconds` of their own (dedup: seconds per sub-stage) still says
    its wall time (stage_start's finish), so bench/timeline.py lists it beside the others."""
    from bench.timeline import pipeline

    src, out = tmp_path / "plain.jsonl", tmp_path / "data" / "dedup"
    write_jsonl(src, PLAIN)
    dedup.run(dedup_cfg(src, out))
    seconds = json.loads((out / "stats.json").read_text(encoding="utf-8"))["seconds"]
    assert isinstance(seconds, float) and seconds >= 0
    assert [name for name, _ in pipeline(tmp_path)] == ["pipeline dedup"]
