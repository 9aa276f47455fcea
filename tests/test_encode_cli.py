"""encode.py: a corpus embedded with a model's document side into the embedding cache, one chunk per shard.
One process and two (torchrun, gloo) write the same chunks and vectors; an interrupted run resumes with the
missing shards only; another document tower's chunk is refused; evaluation afterwards encodes no document."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from care.config import load_config
from care.data.io import write_jsonl
from care.encoders import dense
from care.encoders.cache import EmbeddingCache
from care.encoders.cache_chunks import ForeignChunkError
from care.paths import PROJECT_ROOT
from encode import encode

pytestmark = pytest.mark.usefixtures("one_thread")

SYMPTOMS = ["头痛", "发烧", "咳嗽有痰", "胃疼", "失眠", "腰疼", "高血压", "糖尿病"]
ADVICE = ["多喝水", "注意休息，避免熬夜", "及时到正规医院就诊，必要时做相关检查", "清淡饮食"]
UNIQUE = [f"{s}第{i}天，{ADVICE[i % len(ADVICE)]}" for i, s in enumerate(SYMPTOMS * 5)][:37]  # 37 texts, varied lengths
SHARD = 8  # -> shards of 8, 8, 8, 8, 5


def texts_with_duplicates() -> list[str]:
    return UNIQUE[:20] + UNIQUE[3:6] + UNIQUE[20:]  # three texts twice, under other ids


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "texts.jsonl"
    write_jsonl(path, ({"id": f"t{i}", "text": t, "source": "test"} for i, t in enumerate(texts_with_duplicates())))
    return path


@pytest.fixture
def encoded(monkeypatch):
    """{side: texts} the dense encoder has embedded since the test began (or since it was cleared)."""
    seen = {"query": [], "document": []}
    original = dense.HFDenseEncoder.encode

    def counting(self, texts, side, *a, **kw):
        seen[side].extend(texts)
        return original(self, texts, side, *a, **kw)

    monkeypatch.setattr(dense.HFDenseEncoder, "encode", counting)
    return seen


def clear(seen: dict) -> None:
    for texts in seen.values():
        texts.clear()


def args(model_dir, corpus, cache, *extra) -> list[str]:
    return ["model=tiny_bert", f"model.path={model_dir}", f"corpus={corpus}", f"shard_size={SHARD}", "batch_size=3",
            f"cache.dir={cache}", *extra]


def run(*overrides: str, **kw) -> dict:
    return encode(load_config("encode", list(overrides)), **kw)


def chunks(cache) -> dict[str, dict]:
    """{fingerprint/side-heads/name: arrays} of every chunk under a cache root."""
    out = {}
    for path in sorted(cache.rglob("*.npz")):
        with np.load(path) as z:
            out[str(path.relative_to(cache))] = {k: z[k] for k in z.files}
    return out


def cached_vectors(cache, stats, texts) -> np.ndarray:
    """The vectors of `texts` as evaluation reads them, through EmbeddingCache (encoding anything fails)."""
    def refuse(todo):
        raise AssertionError(f"{len(todo)} texts are not in the cache {cache}")

    (fp,) = stats["fingerprints"]
    return EmbeddingCache(cache).get(fp, "document", ("dense",), texts, refuse).dense


@pytest.mark.slow
def test_one_and_two_processes_write_the_same_chunks_and_vectors(tiny_bert_dir, corpus, tmp_path):
    one = run(*args(tiny_bert_dir, corpus, tmp_path / "one"))
    assert (one["shards"], one["encoded"], one["skipped"], one["processes"]) == (5, 5, 0, 1)

    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "encode.py",
           *args(tiny_bert_dir, corpus, tmp_path / "two")]
    two = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert two.returncode == 0, two.stderr[-3000:]
    # one summary, by the main process of a real two-process group: shards 0, 2, 4 and 1, 3
    assert two.stdout.count("encode.py: ") == 1 and "5 encoded, 0 skipped (already in the cache), 2 processes" in two.stdout
    assert "per process (encoded/skipped shards): 0: 3/0, 1: 2/0" in two.stdout
    assert f"fingerprint {one['fingerprints'][0]}" in two.stdout

    a, b = chunks(tmp_path / "one"), chunks(tmp_path / "two")
    assert len(a) == 5 and a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for k in a[name]:
            np.testing.assert_array_equal(a[name][k], b[name][k], err_msg=f"{name}: {k}")
    np.testing.assert_array_equal(cached_vectors(tmp_path / "one", one, UNIQUE), cached_vectors(tmp_path / "two", one, UNIQUE))


def test_an_interrupted_run_encodes_only_the_missing_shards(tiny_bert_dir, corpus, tmp_path, encoded):
    cache = tmp_path / "cache"
    first = run(*args(tiny_bert_dir, corpus, cache, "max_shards=1"))
    assert (first["encoded"], first["left"], first["encoded_texts"]) == (1, 4, SHARD)
    assert first["texts"] == len(texts_with_duplicates()) and first["unique_texts"] == len(UNIQUE)  # duplicates once
    assert len(chunks(cache)) == 1

    def crash_after_second(shard):  # a run killed half way: the shards it finished stay, nothing half-written
        if shard.index == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run(*args(tiny_bert_dir, corpus, cache), on_shard=crash_after_second)
    assert len(chunks(cache)) == 3 and not list(cache.rglob("*.tmp"))

    clear(encoded)
    last = run(*args(tiny_bert_dir, corpus, cache))
    assert (last["skipped"], last["encoded"], last["left"]) == (3, 2, 0)
    assert encoded["document"] == UNIQUE[3 * SHARD:] and last["encoded_texts"] == len(UNIQUE) - 3 * SHARD

    whole = run(*args(tiny_bert_dir, corpus, tmp_path / "uninterrupted"))
    assert chunks(cache).keys() == chunks(tmp_path / "uninterrupted").keys()
    np.testing.assert_array_equal(cached_vectors(cache, last, UNIQUE),
                                  cached_vectors(tmp_path / "uninterrupted", whole, UNIQUE))


def test_a_chunk_of_another_document_tower_is_refused(tiny_bert_dir, corpus, tmp_path):
    cache = tmp_path / "cache"
    mine = run(*args(tiny_bert_dir, corpus, cache))
    # another document tower (same weights, another document prompt) over the same corpus, elsewhere
    other = run(*args(tiny_bert_dir, corpus, tmp_path / "other", "model.prompts.document=passage: "))
    (fp,), (other_fp,) = mine["fingerprints"], other["fingerprints"]
    assert fp != other_fp
    # its shard 0 copied over ours: the same file name (same texts), other vectors
    name = next(iter(chunks(tmp_path / "other"))).split("/")[-1]
    victim = cache / fp / "doc-dense" / name
    assert victim.exists()
    shutil.copy(tmp_path / "other" / other_fp / "doc-dense" / name, victim)

    with pytest.raises(ForeignChunkError) as err:  # encode.py: refused before any shard is skipped or encoded
        run(*args(tiny_bert_dir, corpus, cache))
    assert str(victim) in str(err.value) and fp in str(err.value) and other_fp in str(err.value)
    with pytest.raises(ForeignChunkError, match=other_fp):  # evaluation's way in: the cache's get
        cached_vectors(cache, mine, UNIQUE[:3])

    # a chunk written before chunks recorded their fingerprint (no array, nor digests: they came later) is still read
    with np.load(victim) as z:
        legacy = {k: z[k] for k in z.files if k not in ("fingerprint", "digests")}
    with open(victim, "wb") as fh:
        np.savez(fh, **legacy)
    again = run(*args(tiny_bert_dir, corpus, cache))
    assert (again["skipped"], again["encoded"]) == (5, 0)


def assert_workload_counts(overrides: list[str], encoded_texts: set[str], model_dir) -> None:
    """bench/eval_workload.py counts the texts the evaluation encoded and their tokens, under the model's
    document prompt and evaluate.yaml's max_length, as the tokenizer gives them one by one."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from bench.eval_workload import document_tokens

    cfg = OmegaConf.to_container(load_config("evaluate", [*overrides, "~benchmark@extra_benchmark"]), resolve=True)
    prompt = (cfg["model"].get("prompts") or {}).get("document", "")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = sum(len(tokenizer(prompt + t, truncation=True, max_length=256)["input_ids"]) for t in encoded_texts)
    assert document_tokens(cfg)["all"] == {"texts": len(encoded_texts), "tokens": tokens}


def test_evaluation_afterwards_encodes_no_documents(tiny_bert_dir, tmp_path, encoded):
    from _evaluation_helpers import write_beir

    from evaluate import evaluate

    docs = {f"d{i}": t for i, t in enumerate(UNIQUE[:12])}
    write_beir(tmp_path / "retrieval", docs, {"q0": "头痛怎么办", "q1": "发烧吃什么药"}, {"q0": {"d0": 1}, "q1": {"d1": 2}})
    write_jsonl(tmp_path / "rerank.jsonl", ({"query": q, "positive": [UNIQUE[12 + i]], "negative": UNIQUE[14 + i:17 + i]}
                                            for i, q in enumerate(["咳嗽有痰", "胃疼怎么办"])))
    write_jsonl(tmp_path / "sts.jsonl", ({"sentence1": a, "sentence2": b, "score": s}
                                         for a, b, s in [("头痛", "头疼", 2), ("发烧", "胃疼", 0), ("失眠", "睡不着", 1)]))
    bench = ["benchmark=cmedteb", *(f"benchmark.tasks.{k}.path={tmp_path / 'rerank.jsonl'}" for k in ("cmed_v1", "cmed_v2", "rerank")),
             f"benchmark.tasks.retrieval.path={tmp_path / 'retrieval'}", f"benchmark.tasks.sts.path={tmp_path / 'sts.jsonl'}",
             "model=tiny_bert", f"model.path={tiny_bert_dir}", "model.max_length=512"]  # both cap it at max_length=256
    n_docs = 12 + 6  # the retrieval corpus and the reranking candidates; STS sentences are embedded as queries

    def evaluation(cache):
        clear(encoded)
        return evaluate(load_config("evaluate", [*bench, "~benchmark@extra_benchmark", "baselines=[]",
                                                 "efficiency.enabled=false", f"cache.dir={cache}",
                                                 f"out_dir={tmp_path / 'eval'}"]))

    evaluation(tmp_path / "cold")  # the counter sees documents being encoded when the cache lacks them
    assert len(set(encoded["document"])) == n_docs and encoded["query"]
    assert_workload_counts(bench, set(encoded["document"]), tiny_bert_dir)

    clear(encoded)
    stats = run(*bench, f"cache.dir={tmp_path / 'cache'}", "shard_size=5", "batch_size=4")
    assert (stats["unique_texts"], stats["shards"], stats["encoded"]) == (n_docs, 4, 4)
    assert len(encoded["document"]) == n_docs and not encoded["query"]  # encode.py runs the document side only
    result = evaluation(tmp_path / "cache")
    assert encoded["document"] == [] and encoded["query"]
    assert result["settings"]["embeddings_from_cache"] >= n_docs


def test_a_damaged_shard_is_reported_re_encoded_and_repaired(tiny_bert_dir, corpus, tmp_path, encoded, caplog):
    """A chunk whose keys read but whose vectors are damaged (bytes flipped: its zip CRC fails; or rewritten
    consistently: only its digest tells) and a truncated one are not skipped: reported, encoded again, rewritten."""
    from test_cache_integrity import flip_bytes, rewrite_changed

    cache, clean = tmp_path / "cache", tmp_path / "clean"
    first = run(*args(tiny_bert_dir, corpus, cache))
    run(*args(tiny_bert_dir, corpus, clean))
    names = sorted(chunks(cache))
    flip_bytes(cache / names[1], "dense")
    rewrite_changed(cache / names[2], "dense")
    (cache / names[4]).write_bytes((cache / names[4]).read_bytes()[:200])

    clear(encoded)
    with caplog.at_level("WARNING"):
        again = run(*args(tiny_bert_dir, corpus, cache))
    assert (again["skipped"], again["encoded"], again["repaired"]) == (2, 3, 3)
    for name in (names[1], names[2], names[4]):
        assert caplog.text.count(str(cache / name)) == 1, caplog.text
    assert "'dense' does not match its xxh3_128 digest" in caplog.text and "CRC" in caplog.text
    assert sorted(encoded["document"]) == sorted(UNIQUE[SHARD:3 * SHARD] + UNIQUE[4 * SHARD:])
    a, b = chunks(cache), chunks(clean)  # repaired on disk: the chunks of a clean run, array for array
    assert a.keys() == b.keys()
    for name in a:
        for k in b[name]:
            np.testing.assert_array_equal(a[name][k], b[name][k], err_msg=f"{name}: {k}")
    np.testing.assert_array_equal(cached_vectors(cache, first, UNIQUE), cached_vectors(clean, first, UNIQUE))
    assert run(*args(tiny_bert_dir, corpus, cache))["skipped"] == 5
