"""CARE's encoder interface: which tower each side runs, per-side fingerprints, instructions, online size."""
# ruff: noqa: F811  (the fixtures imported from _care_helpers are named as test parameters)
from __future__ import annotations

import numpy as np
import pytest
import torch
from _care_helpers import encoder, model_config, stage2_family, texts, towers  # noqa: F401  (texts, towers)
from safetensors import safe_open

from care.encoders.cache import EmbeddingCache, embed

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 2. the encoder interface -------------------------------------------------------------------------

def test_each_side_runs_only_its_own_tower(towers, texts):
    enc = encoder(towers)
    calls = {"query": 0, "document": 0}
    for side, tower in enc.towers.items():
        tower.model.register_forward_hook(lambda *a, side=side: calls.__setitem__(side, calls[side] + 1))
    enc.encode_queries(texts, batch_size=4)
    assert calls == {"query": 3, "document": 0}
    enc.encode_documents(texts, batch_size=4)
    assert calls == {"query": 3, "document": 3}


def test_the_document_fingerprint_depends_on_the_document_tower_only(towers, texts, tmp_path):
    base, other_query, other_document = encoder(towers), encoder(towers, query_seed=1), encoder(towers, document_seed=1)
    assert other_query.towers["query"].width == base.towers["query"].width  # same width: same cut
    assert other_query.side_fingerprint("document") == base.side_fingerprint("document")
    assert other_query.side_fingerprint("query") != base.side_fingerprint("query")
    assert other_document.side_fingerprint("document") != base.side_fingerprint("document")  # the control
    assert other_document.side_fingerprint("query") == base.side_fingerprint("query")
    # so a corpus cached with one query tower is not encoded again for another
    cache = EmbeddingCache(tmp_path)
    first = embed(base, texts, "document", cache, show_progress=False).dense
    again = embed(other_query, texts, "document", cache, show_progress=False).dense
    assert (cache.misses, cache.hits) == (len(texts), len(texts)) and np.array_equal(first, again)
    embed(other_document, texts, "document", cache, show_progress=False)
    assert cache.misses == 2 * len(texts)


def test_queries_take_the_instruction_of_their_task_and_training_uses_the_same_text(towers, texts, tmp_path):
    enc = encoder(towers)
    instructions = model_config(".", ".")["instructions"]
    assert enc.prompts.apply(["头痛"], "query", "sts") == [f"<instruct>{instructions['sts']}\n<query>头痛"]
    assert enc.prompts.apply(["头痛"], "document", "sts") == ["头痛"]  # documents get none
    retrieval, sts = enc.encode_queries(texts[:3]).dense, enc.encode_queries(texts[:3], task="sts").dense
    assert np.abs(retrieval - sts).max() > 1e-4  # the instruction changes the vector ...
    assert enc.side_fingerprint("query", "sts") != enc.side_fingerprint("query", "retrieval")  # ... and its key
    assert enc.side_fingerprint("document", "sts") == enc.side_fingerprint("document", "retrieval")
    with pytest.raises(ValueError, match="no instruction for task type 'clustering'"):
        enc.encode_queries(["头痛"], task="clustering")
    # the training loop tokenizes a query exactly as the encoder does for retrieval (the training task)
    family = stage2_family(towers, tmp_path)
    trained = family.tokenize(texts[:3], ["query"] * 3, 64)
    served = enc.towers["query"].tokenize(enc.prompts.apply(texts[:3], "query", "retrieval"))
    assert torch.equal(trained["input_ids"], served["input_ids"])
    documents = family.tokenize(texts[:3], ["document"] * 3, 128)
    assert torch.equal(documents["input_ids"], enc.towers["document"].tokenize(texts[:3])["input_ids"])


def test_online_parameters_are_the_query_towers(towers):
    enc = encoder(towers)
    with safe_open(towers / "seed0" / "query" / "model.safetensors", "np") as weights:
        total = sum(weights.get_tensor(k).size for k in weights.keys())  # noqa: SIM118 (no __iter__)
        lookup = weights.get_tensor("embeddings.word_embeddings.weight").size
    document = sum(p.numel() for p in enc.towers["document"].parameters())
    assert enc.online_parameters == total and enc.online_embedding_parameters == lookup
    assert document > total  # the document tower never counts, though it is the larger
