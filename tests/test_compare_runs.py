"""care.evaluation.compare groups evaluated models by training recipe (seed and run settings ignored), gives
mean ± sd over seeds and a paired-bootstrap gain over the seed-averaged per-query values."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from care.config import recipe_group
from care.evaluation.compare import compare, main
from care.evaluation.significance import gain_interval

QUERIES = [f"q{i}" for i in range(30)]


def _model(root, name, group_size, seed, log_every):
    folder = root / "models" / name
    folder.mkdir(parents=True)
    config = {"seed": seed, "run_name": name, "trainer": {"group_size": group_size, "lr": 2e-5, "log_every": log_every},
              "model": {"name": "me5_small"}}
    (folder / "care_training.json").write_text(json.dumps({"config": config}), encoding="utf-8")
    return folder


def _run(root, run, models: dict, rng):
    """An evaluate.py-shaped folder: summary.json and one task JSON per model with per-query nDCG@10."""
    out = root / run
    rows, truth = [], {}
    for name, (path, shift) in models.items():
        per_query = {q: float(np.clip(rng.normal(0.5 + shift, 0.2), 0, 1)) for q in QUERIES}
        truth[name] = per_query
        task = out / name / "nano" / "kuake_qtr.json"
        task.parent.mkdir(parents=True)
        task.write_text(json.dumps({"primary": "ndcg_cut_10",
                                    "items": {"per_query": {q: {"ndcg_cut_10": v} for q, v in per_query.items()}}}))
        mean = 100 * float(np.mean(list(per_query.values())))
        rows.append({"name": name, "label": name, "model_path": str(path) if path else None,
                     "scores": {"nano/kuake_qtr": mean, "nano/avg": mean}})
    columns = [{"key": "nano/kuake_qtr", "title": "kuake_qtr nDCG@10"}, {"key": "nano/avg", "title": "Retrieval mean"}]
    (out / "summary.json").write_text(json.dumps({"models": rows, "columns": columns}), encoding="utf-8")
    return out, truth


@pytest.fixture
def runs(tmp_path):
    rng = np.random.default_rng(0)
    m = {name: _model(tmp_path, name, gs, seed, log_every)
         for name, gs, seed, log_every in [("inbatch-s0", 1, 0, 10), ("inbatch-s1", 1, 1, 50),
                                           ("hard3-s0", 4, 0, 10), ("hard3-s1", 4, 1, 10)]}
    r1, t1 = _run(tmp_path, "eval1", {"inbatch-s0": (m["inbatch-s0"], 0.0), "hard3-s0": (m["hard3-s0"], 0.1),
                                      "bm25": (None, -0.1)}, rng)
    r2, t2 = _run(tmp_path, "eval2", {"inbatch-s1": (m["inbatch-s1"], 0.0), "hard3-s1": (m["hard3-s1"], 0.1)}, rng)
    return [r1, r2], {**t1, **t2}


def test_groups_by_recipe_with_mean_sd_and_a_pooled_gain(runs):
    folders, truth = runs
    result = compare(folders)
    labels = [g["label"] for g in result["groups"]]
    assert labels == ["trainer.group_size=1", "trainer.group_size=4", "bm25"]  # log_every and seed do not split
    inbatch = result["groups"][0]
    assert inbatch["seeds"] == ["0", "1"] and inbatch["runs"] == 2
    values = [100 * np.mean(list(truth[n].values())) for n in ("inbatch-s0", "inbatch-s1")]
    cell = inbatch["cells"]["nano/kuake_qtr"]
    assert cell["mean"] == pytest.approx(np.mean(values)) and cell["sd"] == pytest.approx(np.std(values, ddof=1))
    assert result["groups"][2]["cells"]["nano/kuake_qtr"]["sd"] is None  # one run: no spread

    pooled = {name: {q: np.mean([truth[f"{name}-s{s}"][q] for s in (0, 1)]) for q in QUERIES}
              for name in ("inbatch", "hard3")}
    want = gain_interval({"per_query": pooled["inbatch"]}, {"per_query": pooled["hard3"]})
    (gain,) = result["gains"]  # by default one row: the second trained group over the first
    got = gain["intervals"]["nano/kuake_qtr"]
    assert (gain["of"], gain["over"]) == ("trainer.group_size=4", "trainer.group_size=1")
    assert got["difference"] == pytest.approx(-want["difference"])
    assert gain["intervals"]["nano/avg"] is None  # a mean column has no per-query values


def test_chosen_groups_and_the_cli_files(runs, tmp_path, capsys):
    folders, _ = runs
    (gain,) = compare(folders, [("group_size=4", "1")])["gains"]
    assert gain["of"] == "trainer.group_size=4" and gain["over"] == "trainer.group_size=1"
    # --a / --b repeated: one gain row per pair, in the order given, each the pair's own interval
    main([*map(str, folders), "--a", "2", "--b", "1", "--a", "1", "--b", "bm25", "--out", str(tmp_path / "cmp")])
    text = capsys.readouterr().out
    assert "±" in text and text.index("gain of trainer.group_size=4 over trainer.group_size=1") < \
        text.index("gain of trainer.group_size=1 over bm25")
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["runs"] == [Path(f).name for f in folders]  # no path of this machine in a results file
    assert [(g["of"], g["over"]) for g in saved["gains"]] == [("trainer.group_size=4", "trainer.group_size=1"),
                                                              ("trainer.group_size=1", "bm25")]
    assert saved["gains"][1]["intervals"] == compare(folders, [("1", "3")])["gains"][0]["intervals"]
    with pytest.raises(SystemExit):  # an --a without its --b
        main([*map(str, folders), "--a", "2", "--out", str(tmp_path / "cmp2")])
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["groups"][0]["runs"] == 2
    with pytest.raises(ValueError, match="matches 0 groups"):
        compare(folders, [("no-such", "1")])
    # or by a model's row name (a checkpoint folder's name), which a recipe label does not show
    assert compare(folders, [("hard3-s1", "inbatch-s0")])["gains"][0]["of"] == "trainer.group_size=4"
    # a baseline can be chosen too, by label or by its row number in the table (numbers count every row)
    for b in ("bm25", "3"):
        assert compare(folders, [("group_size=1", b)])["gains"][0]["over"] == "bm25"


def test_recipe_group_ignores_seed_and_run_settings_only():
    base = {"seed": 0, "run_name": "a", "trainer": {"lr": 1e-5, "log_every": 10}}
    assert recipe_group(base) == recipe_group({**base, "seed": 3, "run_name": "b",
                                               "trainer": {"lr": 1e-5, "log_every": 99}})
    assert recipe_group(base) != recipe_group({**base, "trainer": {"lr": 2e-5, "log_every": 10}})


def test_runs_on_different_training_files_are_different_groups(tmp_path):
    """data.dir is a run setting (left out of the recipe), but which training file a run read changes the
    weights: runs alike but for their file's content are two groups, labelled by the file; one file at two
    paths (same digest) is one group."""
    rng = np.random.default_rng(1)
    models = {}
    for name, examples, digest in [("window-s0", "data/train/train.jsonl", "aa"),
                                   ("window-s1", "elsewhere/train/train.jsonl", "aa"),
                                   ("margin-s0", "data/mined/margin/train.jsonl", "bb")]:
        folder = _model(tmp_path, name, 4, int(name[-1]), 10)
        record = json.loads((folder / "care_training.json").read_text())
        record["lineage"] = {"training_files": {"examples": examples, "examples_digest": digest}}
        (folder / "care_training.json").write_text(json.dumps(record))
        models[name] = (folder, 0.0)
    run, _ = _run(tmp_path, "eval", models, rng)
    found = compare([run])["groups"]
    assert [g["runs"] for g in found] == [2, 1]
    assert found[0]["label"] == "training_data=data/train/train.jsonl"
    assert found[1]["label"] == "training_data=data/mined/margin/train.jsonl"


def test_one_model_scored_whole_and_cut_is_two_groups(tmp_path):
    """evaluate.py truncate_dim=D rows (summary "truncate_dim") are not seeds of the whole model's recipe."""
    rng = np.random.default_rng(2)
    folder = _model(tmp_path, "mrl", 1, 0, 10)
    whole, _ = _run(tmp_path, "whole", {"mrl": (folder, 0.0)}, rng)
    cut, _ = _run(tmp_path, "cut", {"mrl": (folder, -0.1)}, rng)
    summary = json.loads((cut / "summary.json").read_text())
    summary["models"][0]["truncate_dim"] = 128
    (cut / "summary.json").write_text(json.dumps(summary))
    found = compare([whole, cut])["groups"]
    assert [g["label"] for g in found] == ["scored_at_dim=-", "scored_at_dim=128"]


def test_a_newer_key_at_its_neutral_value_keeps_the_recipe():
    """Records written before trainer.batching (a CARE stage's heldout_texts) existed group with new ones at
    batching=mixed (heldout_texts=0), and a non-neutral value is its own recipe, as a run's config hash treats
    them (care.config.NEUTRAL, care.training.checkpoint.config_hash)."""
    old = {"seed": 0, "trainer": {"lr": 2e-5}}
    assert recipe_group(old) == recipe_group({**old, "trainer": {"lr": 2e-5, "batching": "mixed", "rule_weights": None}})
    assert recipe_group(old) != recipe_group({**old, "trainer": {"lr": 2e-5, "batching": "by_rule"}})
    care = {"seed": 0, "model": {"stages": {"stage1": {"loss": {"temperature": 0.1}}}}}
    with_key = copy.deepcopy(care)
    with_key["model"]["stages"]["stage1"].update(heldout_texts=0, query_share=None)
    with_key["model"]["stages"]["stage1"]["loss"]["score_distill_weight"] = 0.0
    assert recipe_group(care) == recipe_group(with_key)
    with_key["model"]["stages"]["stage1"]["heldout_texts"] = 500
    assert recipe_group(care) != recipe_group(with_key)


def test_a_baseline_is_picked_by_its_exact_name_before_label_words(tmp_path):
    """Recipes that differ in model.name carry it in their labels ("model.name=me5_small"): --b me5_small is
    the baseline row of that name, not an ambiguity (make care-claim's gains over me5_small, care_me5)."""
    rng = np.random.default_rng(1)
    trained = {}
    for name, model in [("ft-big", "me5_small"), ("ft-cut", "me5_small_cut4")]:
        folder = tmp_path / "models" / name
        folder.mkdir(parents=True)
        # the folder, label and build hint differ with the name: the label shows the name alone
        config = {"seed": 0, "run_name": name, "trainer": {"lr": 2e-5},
                  "model": {"name": model, "path": f"/m/{model}", "label": model.upper(), "build_hint": f"build {model}"}}
        (folder / "care_training.json").write_text(json.dumps({"config": config}), encoding="utf-8")
        trained[name] = (folder, 0.0)
    run, _ = _run(tmp_path, "eval", {**trained, "me5_small": (None, 0.0), "me5_small_cut4": (None, 0.0)}, rng)
    labels = [g["label"] for g in compare([run])["groups"]]
    assert labels[:2] == ["model.name=me5_small", "model.name=me5_small_cut4"]
    gains = compare([run], [("ft-cut", "me5_small"), ("ft-big", "me5_small_cut4")])["gains"]
    assert [(g["of"], g["over"]) for g in gains] == [("model.name=me5_small_cut4", "me5_small"),
                                                      ("model.name=me5_small", "me5_small_cut4")]
    with pytest.raises(ValueError, match="matches 2 groups"):  # a label word alone still has to be unique
        compare([run], [("ft-cut", "name=me5_small")])


def test_record_less_rows_named_by_seed_are_one_group_of_their_seeds(tmp_path):
    """make care-claim's (h) rows are tower folders with no training record, linked as `h-...-s<seed>`: their
    seeds form one group (mean ± sd, a gain pooled over them), and a record-less row without the suffix stays
    its own group."""
    rng = np.random.default_rng(2)
    run, truth = _run(tmp_path, "eval", {"h-tower-s42": (None, 0.0), "h-tower-s1": (None, 0.05),
                                         "me5_small": (None, -0.1)}, rng)
    result = compare([run], [("h-tower", "me5_small")])
    found = {g["label"]: g for g in result["groups"]}
    assert sorted(found) == ["h-tower", "me5_small"]
    assert found["h-tower"]["seeds"] == ["1", "42"] and found["h-tower"]["runs"] == 2
    pooled = {q: (truth["h-tower-s42"][q] + truth["h-tower-s1"][q]) / 2 for q in QUERIES}
    expected = gain_interval({"per_query": pooled}, {"per_query": truth["me5_small"]})
    assert result["gains"][0]["intervals"]["nano/kuake_qtr"] == pytest.approx(expected)
