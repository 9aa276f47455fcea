"""Checkpoint/resume: a run killed mid-way and resumed ends with exactly the weights of an uninterrupted run."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from _training_helpers import make_training_files, train_config
from safetensors.torch import load_file

import care.training.checkpoint as checkpoint_mod
from care.data.io import DataError, read_jsonl
from care.training.runlog import RunLog
from care.training.trainer import AlreadyFinished, ResumeError, Trainer


class Crash(RuntimeError):
    pass


def crash_after(step: int):
    def callback(trainer: Trainer) -> None:
        if trainer.step == step:
            raise Crash(f"killed after step {step}")
    return callback


def final_weights(run) -> dict[str, torch.Tensor]:
    folder = run / "final"
    weights = load_file(folder / "model.safetensors")
    for head in ("colbert_linear.pt", "sparse_linear.pt"):
        weights.update({f"{head}:{k}": v for k, v in
                        torch.load(folder / head, map_location="cpu", weights_only=True).items()})
    return weights


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, request):
    shared = request.getfixturevalue("shared")
    root = tmp_path_factory.mktemp("resume")
    texts, train = make_training_files(root, shared, n_questions=32)

    def cfg(run: str, *extra: str):
        # 4 steps an epoch, so 6 steps cross an epoch boundary; checkpoints every 2 steps; dropout on.
        return train_config(root, texts, train, run, "trainer.max_steps=6", "trainer.epochs=3",
                            "trainer.checkpoint_every=2", *extra)

    reference = Trainer(cfg("reference")).fit()
    assert reference["step"] == 6 and reference["epoch"] == 1
    return root, cfg, final_weights(root / "reference")


def test_killed_run_resumes_to_identical_weights(setup):
    root, cfg, reference = setup
    with pytest.raises(Crash):
        Trainer(cfg("killed"), callbacks=[crash_after(3)]).fit()  # last checkpoint: step 2, mid-epoch
    assert [p.name for p in (root / "killed" / "checkpoints").iterdir()] == ["step-0000002"]
    # Everything in a checkpoint loads without pickle (docs/facts.md s.6).
    state = torch.load(root / "killed/checkpoints/step-0000002/state.pt", weights_only=True)
    rng = torch.load(root / "killed/checkpoints/step-0000002/rng-0.pt", weights_only=True)
    assert state["step"] == 2 and state["batch_in_epoch"] == 2 and isinstance(rng["numpy"]["keys"], torch.Tensor)

    summary = Trainer(cfg("killed")).fit()  # steps 3-6, across the epoch boundary
    assert summary["step"] == 6
    assert_same(final_weights(root / "killed"), reference)
    # The log is continuous: one row per step, the row of the lost step 3 replaced, not duplicated.
    rows = [r["step"] for r in read_jsonl(root / "killed" / "metrics.jsonl") if "loss/loss" in r]
    assert rows == list(range(1, 7))


def test_session_limit_then_resume_is_exact_and_rng_matters(setup, monkeypatch):
    root, cfg, reference = setup
    first = Trainer(cfg("sessions", "trainer.max_steps_this_session=3")).fit()
    assert first["stop_reason"] == "max_steps_this_session" and "final" not in first
    Trainer(cfg("sessions", "trainer.max_steps_this_session=2")).fit()  # steps 4-5
    Trainer(cfg("sessions")).fit()
    assert_same(final_weights(root / "sessions"), reference)

    # The same resume without restoring the RNG (dropout masks) must NOT match: the test can fail.
    monkeypatch.setattr(checkpoint_mod, "set_rng_state", lambda state: None)
    Trainer(cfg("no-rng", "trainer.max_steps_this_session=2")).fit()
    Trainer(cfg("no-rng")).fit()
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same(final_weights(root / "no-rng"), reference)


def test_refuses_another_configs_checkpoint_and_a_finished_run(setup):
    _, cfg, _ = setup
    Trainer(cfg("other", "trainer.max_steps_this_session=2")).fit()
    with pytest.raises(ResumeError, match=r"checkpoint .*step-0000002 belongs to another config"):
        Trainer(cfg("other", "trainer.lr=0.001"))
    # settings that do not change the weights may differ on resume
    Trainer(cfg("other", "trainer.log_every=4", "trainer.checkpoint_every=3")).fit()
    with pytest.raises(AlreadyFinished, match="already holds the final model of this run"):
        Trainer(cfg("other"))
    with pytest.raises(ResumeError, match="final model of another run"):
        Trainer(cfg("other", "trainer.lr=0.001"))


def test_a_kill_during_a_checkpoint_write_leaves_no_temporary_folder_for_ever(setup, capsys):
    """kill -9 inside atomic_folder (care/data/io.py) leaves its temporary folder, `.step-N.<random>` beside
    the checkpoints (`.best.<random>` beside best/); the next start of the run, holding the run folder's lock,
    removes them and says how much; a checkpoint moved aside as corrupt is kept for the user to look at."""
    root, cfg, reference = setup
    Trainer(cfg("torn-write", "trainer.max_steps_this_session=2")).fit()
    checkpoints = root / "torn-write" / "checkpoints"
    stale = [Path(tempfile.mkdtemp(prefix=".step-0000004.", dir=checkpoints)),
             Path(tempfile.mkdtemp(prefix=".best.", dir=checkpoints.parent))]
    shutil.copytree(checkpoints / "step-0000002", stale[0] / "model", dirs_exist_ok=True)
    (stale[1] / "model.safetensors").write_bytes(b"\0" * 1000)
    aside = checkpoints / ".corrupt-step-0000008"
    aside.mkdir()
    capsys.readouterr()
    Trainer(cfg("torn-write")).fit()
    err = capsys.readouterr().err
    assert not any(p.exists() for p in stale) and aside.exists()
    assert "removed what 2 interrupted writes left" in err and stale[0].name in err and "MB" in err, err
    assert_same(final_weights(root / "torn-write"), reference)


def test_a_torn_last_line_of_the_log_is_dropped_with_a_message(setup, capsys):
    """kill -9 while a row is appended to metrics.jsonl leaves the last line cut short (no newline): the resume
    drops it with a message naming the file and line, and the log ends continuous; a bad line with its
    newline (not a cut-short write) is still an error."""
    root, cfg, reference = setup
    with pytest.raises(Crash):
        Trainer(cfg("torn-log"), callbacks=[crash_after(3)]).fit()
    log = root / "torn-log" / "metrics.jsonl"
    lines = log.read_text(encoding="utf-8").count("\n")
    with log.open("a", encoding="utf-8") as fh:
        fh.write('{"step": 4, "loss/loss": 12.5, "lr": 0.0')
    capsys.readouterr()
    Trainer(cfg("torn-log")).fit()
    assert f"{log}, line {lines + 1}" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(log) if "loss/loss" in r] == list(range(1, 7))
    assert_same(final_weights(root / "torn-log"), reference)

    class MainProcess:
        is_main_process = True

    bad = root / "bad-log"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        RunLog(bad, MainProcess(), None, "hash").keep_until(1)


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path, shared):
    """The same loop under torchrun with 2 CPU processes (gloo; batches sharded by accelerate, negatives
    gathered across processes) ends with the weights of 1 process holding both halves of every batch.
    Dropout off: the two layouts draw different masks.  In float64: the two layouts sum the same gradients
    in another order, and in float32 AdamW turns that rounding (~1e-7 relative) into weight differences of
    ~5% of the learning rate on parameters whose gradient nearly cancels (token-type and position
    embeddings, LayerNorms); in float64 the layouts agree to ~1e-13.  AdamW and gradient clipping do not see
    the gradient's scale (a missing world-size factor), so the logged loss and pre-clipping gradient norm of
    every step are compared too."""
    import os
    import subprocess
    import sys

    from care.models.m3 import tiny_m3
    from care.paths import PROJECT_ROOT as ROOT

    texts, train = make_training_files(tmp_path, shared, n_questions=40)
    tiny_m3(dropout=0.0).save(tmp_path / "m3")
    common = ["model=tiny_m3", f"model.path={tmp_path / 'm3'}", "++trainer.dtype=float64", f"data.texts={texts}",
              f"data.examples={train}", "trainer.group_size=3", "trainer.chunk_size=4", "trainer.query_max_length=32",
              "trainer.passage_max_length=48", "trainer.max_steps=4", "trainer.lr=1e-3", "validation.task=null",
              f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    for launcher, batch, run in ((torchrun, 4, "two"), ([sys.executable], 8, "one")):
        proc = subprocess.run([*launcher, str(ROOT / "train.py"), *common, f"trainer.batch_size={batch}",
                               f"output_dir={tmp_path / run}"], env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    logs = {run: [r for r in read_jsonl(tmp_path / run / "metrics.jsonl") if "loss/loss" in r] for run in ("two", "one")}
    assert [r["step"] for r in logs["two"]] == [r["step"] for r in logs["one"]] == [1, 2, 3, 4]
    for key in ("loss/loss", "grad_norm"):
        assert [r[key] for r in logs["two"]] == pytest.approx([r[key] for r in logs["one"]], rel=1e-9), key
    two, one = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    start = load_file(tmp_path / "m3" / "model.safetensors")
    assert one["embeddings.LayerNorm.weight"].dtype == torch.float64  # it did train in float64
    assert max((two[k] - one[k]).abs().max().item() for k in one) < 1e-10
    assert max((one[k] - start[k]).abs().max().item() for k in start) > 1e-4  # it did train


# ---- a run that diverges -------------------------------------------------------------------------------------

def test_a_diverging_run_stops_at_its_first_nan_step_without_a_final_model(setup):
    """trainer.lr=1e12: step 1 is warmup (lr 0), step 2 throws the weights far out, step 3's loss and gradient
    are NaN.  The run stops at step 3 in one line naming it (a FloatingPointError: train.py's error edge prints
    it and exits 1), takes no optimizer step with the NaN gradient, writes no checkpoint of step 3 and no
    final/, keeps the step-2 checkpoint (finite weights) and records stop_reason 'diverged' in metrics.jsonl."""
    from care.errors import describe
    from care.training.trainer import Diverged

    root, cfg, _ = setup
    with pytest.raises(Diverged, match=r"^training diverged at step 3: loss = nan, grad_norm = nan; stopped "
                                       r"without a final model and the last checkpoint, .*step-0000002, is kept"
                       ) as caught:
        Trainer(cfg("diverged", "trainer.lr=1e12")).fit()
    assert describe(caught.value) == str(caught.value) and "\n" not in str(caught.value)
    run = root / "diverged"
    assert not (run / "final").exists() and not (run / "tuned").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-0000002"]
    state = torch.load(run / "checkpoints/step-0000002/state.pt", weights_only=True)
    assert all(bool(v.isfinite().all()) for v in state["model"].values() if v.is_floating_point())
    rows = list(read_jsonl(run / "metrics.jsonl"))
    assert rows[-1] == {"step": 3, "stop_reason": "diverged", "non_finite": "loss = nan, grad_norm = nan"}
    assert [r["step"] for r in rows if "loss/loss" in r] == [1, 2, 3]
    # the same command again resumes from step 2 and stops at the same step, the checkpoint still kept
    with pytest.raises(Diverged, match="at step 3"):
        Trainer(cfg("diverged", "trainer.lr=1e12")).fit()
    assert not (run / "final").exists() and (run / "checkpoints/step-0000002").is_dir()


@pytest.mark.parametrize("crash", [2, 6])
def test_resuming_a_nan_checkpoint_unverified_is_stopped_as_diverged(setup, crash):
    """A checkpoint without a manifest whose weights are NaN, resumed with trainer.resume_unverified=true,
    mid-run (step 2 of 6) or at the last step (which went straight to final/): stopped in one line naming
    the checkpoint, no final/ written."""
    from care.training.trainer import Diverged

    root, cfg, _ = setup
    name = f"nan-resume-{crash}"
    with pytest.raises(Crash):
        Trainer(cfg(name, "trainer.merge_with_start=0.5"), callbacks=[crash_after(crash)]).fit()
    folder = root / name / "checkpoints" / f"step-{crash:07d}"
    state = torch.load(folder / "state.pt", weights_only=True)
    state["model"] = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                      for k, v in state["model"].items()}
    torch.save(state, folder / "state.pt")
    (folder / "manifest.json").unlink()
    with pytest.raises(Diverged, match=rf"diverged at step {crash}: the weights of the resumed checkpoint "
                                       rf"step-{crash:07d} hold NaN or infinite values"):
        Trainer(cfg(name, "trainer.merge_with_start=0.5", "trainer.resume_unverified=true")).fit()
    assert not (root / name / "final").exists() and not (root / name / "tuned").exists()
    assert list(read_jsonl(root / name / "metrics.jsonl"))[-1]["stop_reason"] == "diverged"


# ---- a refused resume says what changed --------------------------------------------------------------------

def test_a_run_hashed_with_the_older_weights_digest_is_told_what_changed(setup):
    """A checkpoint (and a final model) of a run trained before whole-file weights digests records a config
    hash made with the older digest (first and last MiB; care.training.checkpoint.legacy_weights_digest, the
    same value as the older care/models/hub.py gave), and no config_parts: the same config is refused, and
    the message says that only the starting weights' digest changed and how to go on, not to 'use the config
    it was trained with'."""
    from care.data.io import read_json, write_json
    from care.training.checkpoint import config_hash, legacy_weights_digest, write_manifest

    root, cfg, _ = setup
    Trainer(cfg("legacy", "trainer.max_steps_this_session=2")).fit()
    folder = root / "legacy" / "checkpoints" / "step-0000002"
    state = torch.load(folder / "state.pt", weights_only=True)
    old = config_hash(cfg("legacy"), legacy_weights_digest)
    assert state["config_parts"] and old != state["config_hash"]
    state.pop("config_parts")
    torch.save({**state, "config_hash": old}, folder / "state.pt")
    write_manifest(folder)
    with pytest.raises(ResumeError, match=rf"belongs to another config \(hash {old}, this run's is \w+; the config, "
                                          r"the training files and the starting weights are the same: only the "
                                          r"digest of the starting weights changed .*Move .*legacy away or choose "
                                          r"another run_name= .* or pass overwrite=true"):
        Trainer(cfg("legacy"))

    Trainer(cfg("legacy-final", "trainer.max_steps=2")).fit()
    record = root / "legacy-final" / "final" / "care_training.json"
    write_json(record, {**read_json(record), "config_hash": config_hash(cfg("legacy-final", "trainer.max_steps=2"),
                                                                         legacy_weights_digest)})
    with pytest.raises(ResumeError, match=r"final model of another run .*only the digest of the starting weights "
                                          r"changed .*Move the folder away or choose another run_name="):
        Trainer(cfg("legacy-final", "trainer.max_steps=2"))


def test_a_refused_checkpoint_names_the_part_of_the_config_that_differs(setup):
    _, cfg, _ = setup
    Trainer(cfg("parts", "trainer.max_steps_this_session=2")).fit()
    with pytest.raises(ResumeError, match=r"what differs: the recipe \(the config's settings that shape the "
                                          r"weights\)\): resuming would mix two runs"):
        Trainer(cfg("parts", "trainer.lr=0.001"))
