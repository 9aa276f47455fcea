"""The seam proven by a fourth family written only in the tests (issue #42, tests/_sparse_family.py): sparse
lexical weights alone, registered through care.families.register_family, no production file edited for it.
evaluate.py scores it by sparse dot products (the retrieval and reranking slots equal trec_eval on the
reference weights), encode.py writes its chunks (sparse arrays only, read back through the cache as the
reference weights), and a re-run of evaluate.py reads them instead of encoding.  The apps that need dense
vectors refuse it in one line: tests/test_family_refusals.py."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from _evaluation_helpers import ref_lexical, trec
from _sparse_family import NAME, model_config, reference_weights, registered

from care.config import load_config
from care.data.io import write_jsonl
from care.data.tasks import load_task
from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache
from care.families import FAMILIES, family_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sparse_family():
    with registered() as family:
        yield family


def model_overrides(tiny_bert_dir) -> list[str]:
    """`model=` of an app: the tiny BERT config, made this family's (its kind, seed and token limit)."""
    return ["model=tiny_bert", f"model.kind={NAME}", f"model.path={tiny_bert_dir}", "model.name=sparse_tiny",
            "model.label=sparse tiny", "+model.seed=0", "model.max_length=64"]


def test_the_family_lives_in_the_tests_and_says_what_it_gives(sparse_family, tiny_bert_dir):
    module = importlib.import_module(sparse_family.encoder.partition(":")[0])
    assert Path(module.__file__).parent == Path(__file__).parent  # its code is the tests', not the project's
    assert family_of(model_config(tiny_bert_dir)) is FAMILIES[NAME] and sparse_family.outputs == ("sparse",)
    assert sparse_family.embeds and not sparse_family.cross_encoder and sparse_family.trainer is None
    encoder = build_encoder(model_config(tiny_bert_dir))
    assert encoder.heads == ("sparse",) and encoder.default_heads == ("sparse",)
    texts = ["头痛发烧怎么办", "糖尿病人能吃西瓜吗，西瓜"]
    got = encoder.encode_documents(texts)
    assert got.dense is None and got.colbert is None and len(got) == 2
    for mine, ref in zip(got.sparse, reference_weights(tiny_bert_dir, texts)):
        assert mine.keys() == ref.keys() and all(mine[t] == pytest.approx(ref[t], abs=1e-5) for t in ref)


def _evaluate(samples, tiny_bert_dir, tmp_path):
    from evaluate import evaluate

    return evaluate(load_config("evaluate", [
        *model_overrides(tiny_bert_dir), "baselines=[]", "~benchmark@extra_benchmark", "benchmark=cmedteb",
        f"benchmark.tasks.cmed_v1.path={samples['reranking']}", f"benchmark.tasks.cmed_v2.path={samples['reranking']}",
        f"benchmark.tasks.retrieval.path={samples['retrieval']}", f"benchmark.tasks.rerank.path={samples['reranking']}",
        f"benchmark.tasks.sts.path={samples['sts']}", f"out_dir={tmp_path / 'eval'}", f"cache.dir={tmp_path / 'cache'}",
        "efficiency.queries=3", "efficiency.docs=8"]))


def test_evaluate_scores_it_by_sparse_dot_products(sparse_family, samples, tiny_bert_dir, tmp_path):
    first = _evaluate(samples, tiny_bert_dir, tmp_path)
    (row,) = first["rows"]
    assert row["name"] == "sparse_tiny" and set(row["methods"]["cmedteb/retrieval"]) == {"sparse"}
    assert row["efficiency"]["docs_per_second"] > 0  # timed on its one head
    out = tmp_path / "eval" / "sparse_tiny" / "cmedteb"
    for slot, kind, metric in (("retrieval", "retrieval", "ndcg_cut_10"), ("rerank", "reranking", "map_cut_10")):
        record = json.loads((out / f"{slot}.json").read_text(encoding="utf-8"))
        assert record["table_method"] == "sparse" and record["primary"] == metric
        data = load_task(kind, samples[kind])
        qids, dids = list(data.queries), list(data.docs)
        q = dict(zip(qids, reference_weights(tiny_bert_dir, [data.queries[i] for i in qids])))
        d = dict(zip(dids, reference_weights(tiny_bert_dir, [data.docs[i] for i in dids])))
        judged = {qid: (list(data.qrels[qid]) if kind == "reranking" else dids) for qid in qids}
        run = {qid: {did: ref_lexical(q[qid], d[did]) for did in judged[qid]} for qid in qids}
        assert record["value"] == pytest.approx(100 * trec(run, data.qrels, [metric])[metric], abs=1e-4), slot
        assert 0 < record["value"] < 100
    # the same run again reads every vector from the cache (its chunks are sparse only)
    again = _evaluate(samples, tiny_bert_dir, tmp_path)
    assert again["settings"]["embeddings_encoded"] == 0 and again["settings"]["embeddings_from_cache"] > 0
    assert again["rows"][0]["scores"] == row["scores"]
    chunk = next((tmp_path / "cache").rglob("doc-sparse/*.npz"))
    with np.load(chunk) as z:
        assert "dense" not in z.files and {"sparse_indptr", "sparse_indices", "sparse_values"} <= set(z.files)


def test_encode_writes_its_sparse_chunks(sparse_family, samples, tiny_bert_dir, tmp_path):
    from encode import encode

    texts = list(dict.fromkeys(t.strip() for t in samples["corpus"].values()))[:30]
    store = tmp_path / "texts.jsonl"
    write_jsonl(store, ({"id": f"t{i}", "text": t} for i, t in enumerate(texts)))
    cache = tmp_path / "cache"
    stats = encode(load_config("encode", [*model_overrides(tiny_bert_dir), f"corpus={store}", "shard_size=8",
                                          "batch_size=3", f"cache.dir={cache}"]))
    assert stats["heads"] == ["sparse"] and stats["encoded"] == stats["shards"] == 4
    (fp,) = stats["fingerprints"]
    assert stats["folders"] == [str(cache / fp / "doc-sparse")]

    def refuse(todo):
        raise AssertionError(f"{len(todo)} texts are not in the cache")

    got = EmbeddingCache(cache).get(fp, "document", ("sparse",), texts, refuse)
    assert got.dense is None and len(got) == len(texts)
    for mine, ref in zip(got.sparse, reference_weights(tiny_bert_dir, texts)):
        assert mine.keys() == ref.keys() and all(mine[t] == pytest.approx(ref[t], abs=1e-5) for t in ref)
    again = encode(load_config("encode", [*model_overrides(tiny_bert_dir), f"corpus={store}", "shard_size=8",
                                          "batch_size=3", f"cache.dir={cache}"]))
    assert (again["encoded"], again["skipped"]) == (0, 4)
