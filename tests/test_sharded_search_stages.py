"""The sharded engine in the stages: encoding as tasks (vectors independent of the number of tasks, encode.py's
shards), `mine.engine=sharded` writing native's train.jsonl, texts.jsonl and flag_train.jsonl byte for byte with
1, 2 and 3 tasks of the datatrove local executor, and `dedup.semantic.engine=sharded` native's kept.jsonl and
clusters.jsonl.  FAISS's tiles are made small (and its BLAS threshold low) so the small stages span several
cells; the native runs run under the same settings.
"""
from __future__ import annotations

import filecmp

import numpy as np
import pytest
from _mining_helpers import compose

from data_pipeline import mining
from data_pipeline.distributed import search as S

G = S.Geometry(tile=64, block=32, blas_threshold=1000, threads=1)
MINED = ("train.jsonl", "texts.jsonl", "flag_train.jsonl")


@pytest.fixture(autouse=True)
def small_tiles():
    with S.faiss_as(G):
        yield


# ---- encoding as tasks --------------------------------------------------------------------------------

def test_encoded_vectors_independent_of_task_count(tiny_bert_dir, shared, tmp_path):
    """Tasks 1, 2 (two processes of the local executor) and 3 write the same chunks, named and cut as encode.py
    cuts its shards; a second run encodes nothing."""
    from omegaconf import OmegaConf

    import encode
    from care.config import load_config
    from care.encoders import build_encoder
    from care.encoders.cache import EmbeddingCache
    from data_pipeline.distributed.encode_tasks import encode_as_tasks, make_shards
    from data_pipeline.planted import shared_texts

    texts = shared_texts()[:45] + shared_texts()[:3]   # 3 repeated: each encoded once
    model = load_config("data_pipeline", ["model=tiny_bert", f"model.path={tiny_bert_dir}"]).model
    encoder = build_encoder(model)
    spec = OmegaConf.to_container(model, resolve=True)
    theirs = encode.make_shards(encoder, [(None, texts)], 7)
    assert make_shards(texts, 7) == [s.texts for s in theirs]
    chunks = {}
    for tasks, executor in ((1, None), (2, {"executor": "local", "workers": 2}), (3, None)):
        cache = EmbeddingCache(tmp_path / f"cache{tasks}")
        settings = S.Settings(executor=executor, tasks=tasks, work_dir=str(tmp_path / "work"))
        done = encode_as_tasks(encoder, spec, {"document": texts}, cache, 8, 7, settings)
        assert (done["shards"], done["encoded"], done["texts"]) == (7, 7, 45)
        folder = cache.folder(encoder.side_fingerprint("document"), "document", encoder.default_heads)
        chunks[tasks] = {p.name: np.load(p)["dense"] for p in sorted(folder.glob("*.npz"))}
        assert set(chunks[tasks]) == {cache.chunk_path(s.fingerprint, "document", encoder.default_heads, s.texts).name
                                      for s in theirs}
        again = encode_as_tasks(encoder, spec, {"document": texts}, cache, 8, 7, settings)
        assert (again["encoded"], again["skipped"]) == (0, 7)
    for tasks in (2, 3):
        assert chunks[tasks].keys() == chunks[1].keys()
        assert all(np.array_equal(chunks[tasks][n].view(np.uint32), chunks[1][n].view(np.uint32)) for n in chunks[1])
    assert not list((tmp_path / "work").iterdir())   # work folders removed


# ---- mining -------------------------------------------------------------------------------------------

def mine(build_dir, out, model_dir, window, cache, *extra):
    lo, hi = window
    return mining.run(compose(build_dir, out, model_dir, f"mine.window=[{lo},{hi}]", f"mine.cache={cache}",
                              "mine.sharded.shard_rows=32", "mine.sharded.query_rows=64",
                              "mine.sharded.encode_shard=16", f"mine.sharded.work_dir={out}/work", *extra))


@pytest.mark.parametrize("similarity", ["question", "document"])
def test_mined_files_equal_native(build_dir, spread_bert, window, tmp_path, similarity):
    """Sharded with 1 task (filling a fresh cache), then native on that cache: the same files; sharded with 2
    tasks (two processes) and 3 tasks (one after the other), each on a fresh cache: the same files again."""
    mode = f"mine.similarity={similarity}"
    one = mine(build_dir, tmp_path / "s1", spread_bert, window, tmp_path / "c1", mode, "mine.engine=sharded",
               "mine.tasks=1")
    again = mine(build_dir, tmp_path / "s1", spread_bert, window, tmp_path / "c1", mode)   # native, same folder
    assert again.get("skipped") and again["fingerprint"] == one["fingerprint"]   # the engine keys stay out
    native = mine(build_dir, tmp_path / "native", spread_bert, window, tmp_path / "c1", mode)
    assert "engine" not in native
    assert one["engine"]["encode"]["encoded"] > 0 and len(one["engine"]["search"]) == len(native["pools"])
    assert all(s["cells"] >= 2 and s["shards"] >= 2 for s in one["engine"]["search"])
    for name in MINED:
        assert filecmp.cmp(tmp_path / "s1" / "train" / name, tmp_path / "native" / "train" / name, shallow=False)
    for tasks, workers in ((2, 2), (3, 1)):
        out = tmp_path / f"s{tasks}"
        stats = mine(build_dir, out, spread_bert, window, tmp_path / f"c{tasks}", mode, "mine.engine=sharded",
                     f"mine.tasks={tasks}", f"mine.workers={workers}")
        assert stats["engine"]["tasks"] == tasks and stats["engine"]["encode"]["encoded"] > 0
        for name in MINED:
            assert filecmp.cmp(out / "train" / name, tmp_path / "native" / "train" / name, shallow=False)


def test_sharded_engine_refusals(build_dir, spread_bert, window, tmp_path):
    with pytest.raises(ValueError, match=r"mine.engine='nope'"):
        mine(build_dir, tmp_path / "a", spread_bert, window, tmp_path / "c", "mine.engine=nope")
    with pytest.raises(ValueError, match="mine.cache cannot be null"):
        mine(build_dir, tmp_path / "b", spread_bert, window, "null", "mine.engine=sharded")


# ---- semantic dedup -----------------------------------------------------------------------------------

def test_semantic_dedup_equal_native(tiny_bert_dir, tmp_path):
    """dedup.semantic.engine=sharded (2 tasks): native's kept.jsonl and clusters.jsonl, on real texts with
    planted copies and near copies; the engine keys stay out of the fingerprint."""
    import json
    import random

    from test_dedup_stage import dedup_overrides

    from care.config import load_config
    from data_pipeline.dedup.stage import run
    from data_pipeline.planted import plant, shared_texts

    rows, _ = plant(random.Random(5).sample(shared_texts(), 300), n_exact=20, n_variant=20, n_near=40, ngram=2,
                    seed=6)
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")

    def dedup(out, *extra):
        return run(load_config("data_pipeline", [
            *dedup_overrides(), f"++input={src}", f"++out={tmp_path / out}", "dedup.stages=[semantic]",
            "dedup.roles=null", "dedup.sources=null", "model=tiny_bert", f"model.path={tiny_bert_dir}",
            "model.pooling=mean", "dedup.semantic.cosine=0.99", "dedup.semantic.block=100",
            f"dedup.semantic.cache={tmp_path / 'cache'}", "dedup.semantic.sharded.shard_rows=64",
            f"dedup.semantic.sharded.work_dir={tmp_path / 'work'}", "dedup.workers=1", *extra]))

    sharded = dedup("sharded", "dedup.semantic.engine=sharded", "dedup.semantic.tasks=2")
    assert dedup("sharded").get("skipped")   # native on the sharded engine's folder: up to date
    native = dedup("native")
    assert "engine" not in native["stages"]["semantic"]
    assert sharded["stages"]["semantic"]["clusters"] > 10 and sharded["stages"]["semantic"]["engine"]["tasks"] == 2
    for name in ("kept.jsonl", "clusters.jsonl"):
        assert filecmp.cmp(tmp_path / "sharded" / name, tmp_path / "native" / name, shallow=False)


# ---- Slurm, through the stand-in ------------------------------------------------------------------------

@pytest.mark.slow
def test_slurm_stand_in_failure_then_relaunch(tmp_path, monkeypatch):
    """The search's steps as Slurm job arrays (tests/fake_slurm: sbatch runs datatrove's scripts here): a lost
    cells task is named and the merge never runs; the same call then re-runs only the missing cells and
    gives one index's ids and scores."""
    import json
    from pathlib import Path

    import faiss

    from data_pipeline.distributed.executors import TasksFailed

    fake = Path(__file__).parent / "fake_slurm"
    monkeypatch.setenv("PATH", f"{fake}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path / "slurm"))
    x = np.random.default_rng(0).standard_normal((300, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    executor = {"executor": "slurm", "slurm": {"poll_s": 0.1, "timeout_min": 10}}
    settings = S.Settings(executor=executor, tasks=2, shard_rows=64, query_rows=64, work_dir=str(tmp_path / "w"))
    monkeypatch.setenv("FAKE_SLURM_FAIL", "search_cells:1")
    with pytest.raises(TasksFailed, match=r"search: cells: 1 of 2 tasks did not finish \(ranks 1[;)]"):
        S.knn(x, x, 10, settings)
    assert list((tmp_path / "w").glob("*/cells/*.npz")) and not list((tmp_path / "w").glob("*/merged/*"))
    monkeypatch.delenv("FAKE_SLURM_FAIL")
    D, I, _ = S.knn(x, x, 10, settings)
    runs = [json.loads(line) for line in (tmp_path / "slurm" / "jobs.jsonl").read_text().splitlines()]
    steps = [(j["name"], j["array"], j["state"]) for j in runs if not j["merge_stats"]]
    assert steps == [("search_cells", 2, "FAILED"), ("search_merge", 2, "CANCELLED"),
                     ("search_cells", 1, "COMPLETED"), ("search_merge", 2, "COMPLETED")]   # rank 1 alone again
    index = faiss.IndexFlatIP(32)
    index.add(x)
    D0, I0 = index.search(x, 10)
    assert np.array_equal(I, I0) and np.array_equal(D.view(np.uint32), D0.view(np.uint32))


# ---- the local pool -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_local_pool_never_forks_a_process_with_thread_pools(tmp_path):
    """Asked for `local.start_method=fork` after FAISS ran on two threads here, a forked worker inherits the
    OpenMP pool in a state that hangs it (a 1-second search never ended); the sharded engine starts its pool
    by forkserver (search.pool_safe), so the search finishes, equal to one index."""
    import subprocess
    import sys
    import textwrap

    from care.paths import PROJECT_ROOT

    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import tempfile
        import faiss
        import numpy as np
        from data_pipeline.distributed import search as S

        def main():
            x = np.random.default_rng(0).standard_normal((3000, 384)).astype(np.float32)
            faiss.omp_set_num_threads(2)
            index = faiss.IndexFlatIP(384)
            index.add(x)
            D0, I0 = index.search(x, 10)
            executor = {"executor": "local", "workers": 2, "local": {"start_method": "fork"}}
            settings = S.Settings(executor=executor, tasks=2, shard_rows=1024, threads=2,
                                  work_dir=tempfile.mkdtemp())
            D, I, info = S.knn(x, x, 10, settings)
            assert info["cells"] == 3 and np.array_equal(I, I0) and np.array_equal(D, D0)
            print("equal")

        if __name__ == "__main__":
            main()
        """), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=240,
                          cwd=PROJECT_ROOT)
    assert proc.returncode == 0 and "equal" in proc.stdout, proc.stderr[-2000:]
