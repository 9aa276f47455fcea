"""train.py's Hydra main returns the validation metric a sweeper optimises (a float), also when it skips."""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
from _training_helpers import make_training_files, train_config

from care.paths import PROJECT_ROOT


def train_main():
    spec = importlib.util.spec_from_file_location("train_app", PROJECT_ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread(one_thread):
    yield


def test_main_returns_the_best_validation_metric(tmp_path, shared):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    main = train_main()
    cfg = train_config(tmp_path, texts, train, "run", f"validation.task={tmp_path / 'dev.jsonl'}",
                       "validation.max_queries=3", "validation.every_steps=1", "trainer.max_steps=2")
    value = main(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validations = [r["val/map_cut_10"] for r in rows if "val/map_cut_10" in r]
    assert isinstance(value, float) and len(validations) == 3 and value == max(validations)
    assert main(cfg) == value  # the finished run is skipped, and says what it reached
    no_validation = train_config(tmp_path, texts, train, "plain", "validation.task=null", "trainer.max_steps=1")
    assert math.isnan(main(no_validation))


def test_the_last_step_is_validated_when_every_steps_does_not_divide_it(tmp_path, shared):
    """Otherwise final/ (the best by validation) could never be the trained weights: a 20-step stage with
    validation every 60 steps once kept its step-0 weights."""
    texts, train = make_training_files(tmp_path, shared, n_questions=32)  # 4 steps an epoch
    cfg = train_config(tmp_path, texts, train, "run", f"validation.task={tmp_path / 'dev.jsonl'}",
                       "validation.max_queries=3", "validation.every_steps=2", "trainer.max_steps=3")
    train_main()(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/map_cut_10" in r] == [0, 2, 3]
