"""Merging a fine-tuned model with its start (care.training.merge): equal to LM-Cocktail's own arithmetic,
backbone only, the ends of the weight range, clear errors, and the command line."""
from __future__ import annotations

import pytest
import torch

from care.models.m3 import M3Model, tiny_m3
from care.training.merge import main, merge_state, merge_with_start

torch.set_num_threads(1)


def test_merge_equals_lm_cocktail_merge_param():
    from LM_Cocktail.utils import merge_param  # FlagEmbedding's LM-Cocktail: the reference

    tuned, start = tiny_m3(seed=0).backbone, tiny_m3(seed=7).backbone
    expected = merge_param([{k: v.clone() for k, v in tuned.state_dict().items()}, start.state_dict()], [0.3, 0.7])
    merge_state(tuned, start, 0.3)
    got = tuned.state_dict()
    assert got.keys() == expected.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


def test_backbone_only_and_the_ends_of_the_weight_range():
    tuned, start = tiny_m3(seed=0), tiny_m3(seed=7)
    heads = {k: v.clone() for k, v in tuned.state_dict().items() if not k.startswith("backbone.")}
    kept = {k: v.clone() for k, v in tuned.backbone.state_dict().items()}
    merge_with_start(tuned, start, 1.0)  # all fine-tuned: nothing moves
    assert all(torch.equal(v, kept[k]) for k, v in tuned.backbone.state_dict().items())
    merge_with_start(tuned, start.backbone, 0.0)  # a plain encoder as the start; all start: its backbone
    assert all(torch.equal(v, start.backbone.state_dict()[k]) for k, v in tuned.backbone.state_dict().items())
    assert all(torch.equal(v, heads[k]) for k, v in tuned.state_dict().items() if k in heads)  # heads as trained


def test_bad_merges_are_refused():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        merge_state(tiny_m3().backbone, tiny_m3().backbone, 1.5)
    with pytest.raises(ValueError, match="different architectures"):
        merge_state(tiny_m3(layers=2).backbone, tiny_m3(layers=1).backbone, 0.5)
    with pytest.raises(ValueError, match=r"word_embeddings.weight is \(21128, 64\) in the fine-tuned model and \(21128, 32\)"):
        merge_state(tiny_m3(hidden=64, heads=2).backbone, tiny_m3(hidden=32, heads=2).backbone, 0.5)


def test_command_line_writes_a_loadable_checkpoint_and_never_replaces_one(tmp_path, capsys):
    tiny_m3(seed=0).save(tmp_path / "tuned")
    tiny_m3(seed=7).backbone.save_pretrained(tmp_path / "start")
    main([str(tmp_path / "tuned"), str(tmp_path / "start"), "--weight", "0.5", "--out", str(tmp_path / "merged")])
    merged = M3Model.load(tmp_path / "merged").backbone.state_dict()
    a, b = tiny_m3(seed=0).backbone.state_dict(), tiny_m3(seed=7).backbone.state_dict()
    name = "encoder.layer.0.attention.self.query.weight"
    torch.testing.assert_close(merged[name], 0.5 * a[name] + 0.5 * b[name])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "tuned"), str(tmp_path / "start"), "--out", str(tmp_path / "merged")])
    assert "never replaces" in capsys.readouterr().err


def test_command_line_errors_are_one_line(tmp_path, capsys):
    """A start of another architecture: one line naming the problem, exit 1, no traceback, nothing written."""
    tiny_m3(layers=2).save(tmp_path / "tuned")
    tiny_m3(layers=1).backbone.save_pretrained(tmp_path / "start")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "tuned"), str(tmp_path / "start"), "--out", str(tmp_path / "merged")])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("python -m care.training.merge: error: cannot merge models of different architectures")
    assert not (tmp_path / "merged").exists()
