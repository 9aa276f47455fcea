"""The sharded engine's tasks as datatrove pipeline steps, run by executors.py's executors (local, Slurm, Ray).

Each step reads one work folder (search.py's Job, encode_tasks.py's EncodeJob) and does the share of rank r of
N: the items r, r + N, r + 2N, ... of its list (shards, cells, query blocks).  Every item's output is written
atomically and skipped when present, so a relaunch redoes only what is missing, whatever datatrove's
per-task completions say.
"""
from __future__ import annotations

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep


class _JobStep(PipelineStep):
    """`job`: the work folder; `job_class`: the class that reads it (search.py's Job, encode_tasks.py's EncodeJob),
    handed in by the caller and pickled by reference, so this module never imports them back (imports point one
    way: tests/test_layers.py)."""
    type = "🔎 - SEARCH"

    def __init__(self, job: str, job_class):
        super().__init__()
        self.job, self.job_class = job, job_class

    def work(self, rank: int, world_size: int) -> None:
        raise NotImplementedError

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.track_time(unit="task"):
            self.work(rank, world_size)
        if data:
            yield from data


class EncodeShards(_JobStep):
    name = "encode shards"
    type = "🔢 - ENCODE"

    def work(self, rank: int, world_size: int) -> None:
        done = self.job_class(self.job).run_task(rank, world_size)
        self.stat_update("encoded_shards", value=done["encoded"], unit="task")
        self.stat_update("skipped_shards", value=done["skipped"], unit="task")


class BuildShards(_JobStep):
    name = "shard indexes"

    def work(self, rank: int, world_size: int) -> None:
        job = self.job_class(self.job)
        for s in range(rank, len(job.plan.shards), world_size):
            job.build_shard(s)
            self.stat_update("shards", unit="task")


class SearchCells(_JobStep):
    name = "search cells"

    def work(self, rank: int, world_size: int) -> None:
        job = self.job_class(self.job)
        for cell in job.plan.cells()[rank::world_size]:
            job.run_cell(cell)
            self.stat_update("cells", unit="task")


class MergeBlocks(_JobStep):
    name = "merge blocks"

    def work(self, rank: int, world_size: int) -> None:
        job = self.job_class(self.job)
        for b in range(rank, len(job.plan.blocks), world_size):
            job.merge(b)
            self.stat_update("blocks", unit="task")
