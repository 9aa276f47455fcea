"""Checkpoint manifests: a corrupted or truncated checkpoint is named and never resumed silently, one without a
manifest only with trainer.resume_unverified=true; resume=auto falls back to the newest checkpoint that
verifies and still ends with an uninterrupted run's weights."""
from __future__ import annotations

import json

import pytest
from _training_helpers import make_training_files, train_config
from test_resume import assert_same, final_weights

from care.training.checkpoint import MANIFEST
from care.training.trainer import ResumeError, Trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory, request):
    shared = request.getfixturevalue("shared")
    root = tmp_path_factory.mktemp("verify")
    texts, train = make_training_files(root, shared, n_questions=32)

    def cfg(run: str, *extra: str):  # as test_resume: 6 steps, checkpoints every 2, dropout on
        return train_config(root, texts, train, run, "trainer.max_steps=6", "trainer.epochs=3",
                            "trainer.checkpoint_every=2", *extra)

    Trainer(cfg("reference")).fit()
    return root, cfg, final_weights(root / "reference")


def flip_middle(path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file(setup):
    root, _, _ = setup
    manifest = json.loads((root / "reference/checkpoints/step-0000006" / MANIFEST).read_text())
    assert manifest["algorithm"] == "xxh3_128"
    assert {"state.pt", "rng-0.pt", "model/model.safetensors"} <= set(manifest["files"])
    assert all(len(f["xxh3_128"]) == 32 and f["size"] > 0 for f in manifest["files"].values())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_newest_checkpoint_falls_back(setup, capsys, damage):
    root, cfg, reference = setup
    run = f"damaged-{damage}"
    Trainer(cfg(run, "trainer.max_steps_this_session=4")).fit()  # checkpoints step 2 and step 4
    state = root / run / "checkpoints/step-0000004/state.pt"
    if damage == "flip":
        flip_middle(state)
    else:
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    capsys.readouterr()
    Trainer(cfg(run)).fit()
    out, err = capsys.readouterr()
    assert "step-0000004" in err and "state.pt" in err, err
    assert ("corrupted" if damage == "flip" else "truncated") in err, err
    assert "resuming from the newest checkpoint that verifies instead" in err and "step-0000002" in err, err
    assert f"resumed from {root / run / 'checkpoints/step-0000002'} at step 2" in out, out
    assert_same(final_weights(root / run), reference)


def test_no_checkpoint_verifies_is_one_line(setup, capsys):
    root, cfg, _ = setup
    Trainer(cfg("none", "trainer.max_steps_this_session=2")).fit()
    folder = root / "none/checkpoints/step-0000002"
    flip_middle(folder / "state.pt")
    with pytest.raises(ResumeError) as e:
        Trainer(cfg("none"))
    message = str(e.value)
    assert "\n" not in message and str(folder) in message and "state.pt" in message, message
    # an explicit trainer.resume=PATH that fails is refused
    with pytest.raises(ResumeError, match=r"trainer.resume=.*step-0000002.*state.pt.*refusing"):
        Trainer(cfg("none", f"trainer.resume={folder}"))
    assert folder.exists()  # nothing moved when nothing verifies


def test_checkpoint_without_manifest_is_refused_unless_asked(setup, capsys):
    """Written before manifests (or its manifest lost): it cannot be verified, so it is refused, in one line
    naming it and the setting that accepts it; trainer.resume_unverified=true resumes from it with a notice.
    A file of an accepted one that cannot be read is still named, one line."""
    root, cfg, _ = setup
    Trainer(cfg("legacy", "trainer.max_steps_this_session=2")).fit()
    folder = root / "legacy/checkpoints/step-0000002"
    (folder / MANIFEST).unlink()
    for extra in ((), (f"trainer.resume={folder}",)):  # resume=auto, and the checkpoint named
        with pytest.raises(ResumeError) as e:
            Trainer(cfg("legacy", *extra))
        message = str(e.value)
        assert "\n" not in message and str(folder) in message and "trainer.resume_unverified=true" in message, message
    capsys.readouterr()
    trainer = Trainer(cfg("legacy", "trainer.resume_unverified=true"))
    assert trainer.step == 2
    trainer.run_lock.release()
    del trainer
    err = capsys.readouterr().err
    assert "cannot be verified" in err and "trainer.resume_unverified=true" in err, err
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(ResumeError) as e:
        Trainer(cfg("legacy", "trainer.resume_unverified=true"))
    assert "\n" not in str(e.value) and str(state) in str(e.value), str(e.value)
