"""Encoding as tasks: the texts a sharded stage searches (`mine.engine=sharded`, `dedup.semantic.engine=sharded`)
go into the embedding cache (care/encoders/cache.py) by tasks of the stage's executor, before the stage reads
them back through the cache as it always does.

The shard rule is encode.py's: one side's texts, each once, in the order given, cut into consecutive shards
of `shard_size`; task r of N encodes shards r, r + N, r + 2N, ...; a shard is encoded alone (batches that
depend on its texts only) and stored as one chunk (EmbeddingCache.put_chunk), so the vectors are the same
whatever the number of tasks, and a relaunch skips every shard whose chunk is already stored and sound
(chunk_state "ok").  A task loads the encoder only when one of its shards is missing.

The work folder (`<work root>/encode-<digest>/`, removed once every task finished):
    job.json            the model config, the cache folder, each side's fingerprint and texts, the sizes
    counts/RRRRR.json   what task R encoded and skipped
    logs/               the executor's
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from care.data.io import atomic_open
from care.encoders.cache import EmbeddingCache


def make_shards(texts: list[str], size: int) -> list[list[str]]:
    """encode.py's shards of one side: the texts each once, in order, cut every `size`."""
    if size < 1:
        raise ValueError(f"encode shard size must be >= 1, got {size}")
    unique = list(dict.fromkeys(texts))
    return [unique[s:s + size] for s in range(0, len(unique), size)]


class EncodeJob:
    """One encoding's work folder (module docstring)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._spec = None

    @classmethod
    def create(cls, root: str | Path, model: dict, cache_dir: str | Path, sides: dict[str, tuple[str, list[str]]],
               batch_size: int, shard_size: int, heads: list[str]) -> EncodeJob:
        """`sides`: side ("query" | "document") -> (that side's fingerprint, its texts); `heads`: what the stage
        reads back (care.encoders.cache.embed's default, the encoder's default_heads)."""
        from data_pipeline.distributed.search import digest

        spec = {"model": model, "cache": str(cache_dir), "batch_size": int(batch_size), "shard_size": int(shard_size),
                "heads": list(heads),
                "sides": {side: {"fingerprint": fp, "texts": list(dict.fromkeys(texts))}
                          for side, (fp, texts) in sides.items()}}
        text = json.dumps(spec, sort_keys=True, ensure_ascii=False, default=str)
        job = cls(Path(root) / f"encode-{digest(text=text)}")
        if not (job.folder / "job.json").exists():
            with atomic_open(job.folder / "job.json", "w") as fh:
                fh.write(text)
        return job

    @property
    def spec(self) -> dict:
        if self._spec is None:
            self._spec = json.loads((self.folder / "job.json").read_text("utf-8"))
        return self._spec

    def shards(self) -> list[tuple[str, list[str]]]:
        """(side, texts) of every shard, side after side."""
        return [(side, shard) for side, s in self.spec["sides"].items()
                for shard in make_shards(s["texts"], self.spec["shard_size"])]

    def run_task(self, rank: int, world: int) -> dict:
        """Task `rank` of `world`: its shards encoded into the cache unless already there; its counts."""
        spec, cache = self.spec, EmbeddingCache(self.spec["cache"])
        heads = tuple(spec["heads"])
        encoder, done = None, {"rank": rank, "encoded": 0, "skipped": 0, "texts": 0, "seconds": 0.0}
        for side, texts in self.shards()[rank::world]:
            fp = spec["sides"][side]["fingerprint"]
            if cache.chunk_state(fp, side, heads, texts) == "ok":
                done["skipped"] += 1
                continue
            if encoder is None:
                from care.encoders import build_encoder

                encoder = build_encoder(spec["model"])
                own = encoder.side_fingerprint(side, None)
                if own != fp:
                    raise RuntimeError(f"encode task {rank}: the encoder built here has {side} fingerprint {own}, "
                                       f"the submitting process's was {fp} (another model folder or code?)")
            encode = encoder.encode_queries if side == "query" else encoder.encode_documents
            t0 = time.perf_counter()
            cache.put_chunk(fp, side, heads, texts, lambda todo, encode=encode: encode(
                todo, batch_size=spec["batch_size"], heads=heads, show_progress=False, task=None))
            done["seconds"] += time.perf_counter() - t0
            done["encoded"] += 1
            done["texts"] += len(texts)
        with atomic_open(self.folder / "counts" / f"{rank:05d}.json", "w") as fh:
            json.dump(done, fh)
        return done

    def counts(self) -> dict:
        parts = [json.loads(p.read_text("utf-8")) for p in sorted((self.folder / "counts").glob("*.json"))]
        return {key: sum(p[key] for p in parts) for key in ("encoded", "skipped", "texts")}


def encode_as_tasks(encoder, model: dict, sides: dict[str, list[str]], cache: EmbeddingCache, batch_size: int,
                    shard_size: int, settings) -> dict:
    """Encode `sides` (side -> texts) into `cache` as tasks of `settings` (search.Settings: the executor section,
    tasks and work folder; executor None: the tasks one after the other here).  `encoder` is the stage's own,
    used only for its side fingerprints; the tasks build theirs from `model` (a resolved model config)."""
    sides = {side: texts for side, texts in sides.items() if texts}
    if not sides:
        return {"shards": 0, "encoded": 0, "skipped": 0, "texts": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    job = EncodeJob.create(settings.work_dir, model, cache.root,
                           {side: (encoder.side_fingerprint(side, None), texts) for side, texts in sides.items()},
                           batch_size, shard_size, encoder.default_heads)
    n = len(job.shards())
    tasks = max(1, min(settings.tasks, n))
    if settings.executor is None:
        for rank in range(tasks):
            job.run_task(rank, tasks)
    else:
        from data_pipeline.distributed.executors import make_executor, run_steps
        from data_pipeline.distributed.search import pool_safe
        from data_pipeline.distributed.search_steps import EncodeShards

        executor = pool_safe(settings.executor)   # the encoder's thread pools: never fork this process
        step = make_executor(executor, [EncodeShards(str(job.folder), EncodeJob)],
                             job.folder / "logs" / f"encode-{tasks}", tasks, "encode_shards")
        run_steps(executor, [("encode: shards", step)])   # raises, naming the tasks that failed
    counts = job.counts()
    shutil.rmtree(job.folder, ignore_errors=True)
    return {"shards": n, "tasks": tasks, **counts, "seconds": round(time.perf_counter() - t0, 3)}
