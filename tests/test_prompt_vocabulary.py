"""One prompt vocabulary for every model kind (care/encoders/prompts.py): `prompts: {query, document}`; the older
keys (`query_prefix` / `doc_prefix`, a CARE tower's `prompt`) still read, with a deprecation message, by
configs, saved training records and the run hash alike."""
from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest

from care.config import CONF_DIR, model_config
from care.encoders import build_encoder, detect
from care.encoders.prompts import Prompts, legacy_keyed
from care.encoders.registry import TRAINING_RECORD
from care.families import family_of

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = "<instruct>{instruction}\n<query>{text}"
DENSE_NEW = {"kind": "dense", "name": "m", "path": "p", "prompts": {"query": "query: ", "document": "passage: "}}
DENSE_OLD = {"kind": "dense", "name": "m", "path": "p", "query_prefix": "query: ", "doc_prefix": "passage: "}
CARE_NEW = {"kind": "care", "name": "c", "query": {"path": "q", "pooling": "cls"},
            "document": {"path": "d", "pooling": "last_token"},
            "prompts": {"query": TEMPLATE, "document": ""}, "instructions": {"retrieval": "find"}}
CARE_OLD = {"kind": "care", "name": "c", "query": {"path": "q", "pooling": "cls", "prompt": TEMPLATE},
            "document": {"path": "d", "pooling": "last_token", "prompt": ""}, "instructions": {"retrieval": "find"}}


def quietly(model: dict) -> Prompts:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new vocabulary: no deprecation message
        return Prompts.from_config(model)


@pytest.mark.parametrize(("new", "old", "names"), [(DENSE_NEW, DENSE_OLD, "`query_prefix` / `doc_prefix`"),
                                                    (CARE_NEW, CARE_OLD, "`query.prompt` / `document.prompt`")])
def test_both_vocabularies_give_the_same_prompts_the_old_one_with_a_message(new, old, names):
    with pytest.warns(FutureWarning, match=f"{names} is the older name of `prompts"):
        assert Prompts.from_config(old) == quietly(new)
    assert quietly(new).query == new["prompts"]["query"] and quietly(new).instructions == new.get("instructions", {})


def test_a_config_giving_both_or_an_unknown_side_is_refused():
    with pytest.raises(ValueError, match="gives its prompts twice"):
        Prompts.from_config({**DENSE_NEW, "query_prefix": "q: "})
    with pytest.raises(ValueError, match=r"unknown side\(s\) \['passage'\]"):
        Prompts.from_config({"prompts": {"query": "", "passage": "p: "}})
    assert quietly({"kind": "dense"}) == Prompts()  # none given: no prompts, no message


def test_every_shipped_model_config_speaks_the_new_vocabulary():
    names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    assert {"me5_small", "care_me5", "care_0.3b_4b", "tiny_bert"} <= set(names)
    for name in names:
        model = model_config(name)
        if family_of(model).cross_encoder:  # reads the raw (query, passage) pair: no prompts, old or new
            assert not {"prompts", "query_prefix", "doc_prefix", "prompt"} & set(model), name
            continue
        assert "prompts" in model, name
        quietly(model)
    assert quietly(model_config("me5_small")) == Prompts("query: ", "passage: ")
    assert quietly(model_config("care_me5")) == Prompts("query: ", "passage: ")


def test_hashes_see_the_prompts_under_their_old_keys():
    # a run trained (a stage run) before the rename has the same hash, so it is not trained (run) again
    assert legacy_keyed(DENSE_NEW) == DENSE_OLD
    assert legacy_keyed(CARE_NEW) == CARE_OLD
    assert legacy_keyed(DENSE_OLD) == DENSE_OLD
    other = {**DENSE_NEW, "prompts": {"query": "q: ", "document": "passage: "}}
    assert legacy_keyed(other) != DENSE_OLD  # a different prompt is a different run


def test_a_model_folder_saved_with_the_old_keys_loads_with_a_message(tiny_bert_dir, tmp_path):
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "old")
    record = {"model": {"kind": "dense", "name": "old", "path": ".", "pooling": "cls", "max_length": 32,
                        "query_prefix": "Q: ", "doc_prefix": "D: "}}
    (folder / TRAINING_RECORD).write_text(json.dumps(record), encoding="utf-8")
    with pytest.warns(FutureWarning, match="query_prefix"):
        old = build_encoder(detect(folder, {}), device="cpu")
    new = build_encoder({"kind": "dense", "name": "new", "path": str(folder), "pooling": "cls", "max_length": 32,
                         "prompts": {"query": "Q: ", "document": "D: "}}, device="cpu")
    texts = ["癫痫患者可以正常怀孕吗？", "头痛"]
    np.testing.assert_array_equal(old.encode_queries(texts).dense, new.encode_queries(texts).dense)
    assert old.fingerprint == new.fingerprint  # the same prompts: the embedding cache is shared
