"""Project benchmarks and C-MTEB tasks as local mteb tasks, filled in memory from a loaded TaskData.

    mteb_task(task_data, name, spec)  any loaded project task as a local mteb task (Retrieval, Reranking, STS)
    benchmark_tasks(benchmark)        a project benchmark's tasks (cmedteb_open by default), as evaluate.py loads them
    cmteb_task(name, path=None)       a C-MTEB task: mteb's own (data from the hub), or a local copy of it
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from care.data.io import json_digest
from care.data.tasks import TaskData
from care.evaluation.metrics import parse_metric
from care.evaluation.mteb_adapter.data import load_local_copy
from care.evaluation.mteb_adapter.model import LANGUAGES, import_mteb
from care.evaluation.mteb_adapter.scores import DATA_TYPES, MTEB_TYPES, STS_SCORES, default_spec, mteb_score


def data_revision(data: TaskData) -> str:
    """A digest of a loaded task's content, as its mteb dataset revision (never resolved: the data is in memory)."""
    payload = [data.type, data.queries, data.docs, data.qrels, data.pairs, data.gold, data.candidates,
               data.safeguards]
    return json_digest(payload, 16, sort_keys=True, ensure_ascii=False)


def retrieval_split(data: TaskData, top_ranked: Mapping[str, Sequence[str]] | None = None) -> dict:
    """A project TaskData as mteb's RetrievalSplitData, in memory: queries with qrels, every graded judgement
    as relevant_docs (0 = judged not relevant), top_ranked for reranking."""
    from datasets import Dataset

    queries = {q: t for q, t in data.queries.items() if data.qrels.get(q)}
    return {"corpus": Dataset.from_dict({"id": list(data.docs), "text": list(data.docs.values())}),
            "queries": Dataset.from_dict({"id": list(queries), "text": list(queries.values())}),
            "relevant_docs": {q: {d: int(g) for d, g in data.qrels[q].items()} for q in queries},
            "top_ranked": None if top_ranked is None else {q: list(top_ranked[q]) for q in queries}}


@functools.cache
def _care_task_classes():
    """The task classes filled from a project TaskData, defined on first use (mteb is imported lazily)."""
    import_mteb()
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.sts import AbsTaskSTS

    class CareTask:
        """A task whose data is a loaded project task (care.data.tasks.TaskData), so that mteb scores exactly
        what evaluate.py's runners score.  mteb_task makes one subclass per task: `metadata` (and k_values,
        min_score, max_score) must be on the class (AbsTask.unload_data drops an instance's own metadata)."""

        #: the project task type both sides are embedded for (the query instruction): the task's own type,
        #: "retrieval" for a Nano split's candidate lists (as evaluate.py's run_candidates embeds them)
        care_task_type: str | None = None

        def __init__(self, data: TaskData, split: str, spec, top_ranked=None, **kwargs: Any):
            self.care_data, self.care_split, self.care_spec, self.care_top_ranked = data, split, spec, top_ranked
            super().__init__(**kwargs)

    class CareRetrievalTask(CareTask, AbsTaskRetrieval):
        def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
            if not self.data_loaded:
                self.dataset = {"default": {self.care_split: retrieval_split(self.care_data, self.care_top_ranked)}}
                self.data_loaded = True

    class CareSTSTask(CareTask, AbsTaskSTS):
        def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
            from datasets import Dataset

            if not self.data_loaded:
                d = self.care_data
                pairs = {"sentence1": [a for a, _ in d.pairs], "sentence2": [b for _, b in d.pairs],
                         "score": [float(g) for g in d.gold]}
                self.dataset = {"default": {self.care_split: Dataset.from_dict(pairs)}}
                self.data_loaded = True

    return CareRetrievalTask, CareSTSTask


def mteb_task(data: TaskData, name: str, spec=None, *, split: str | None = None, metadata=None,
              description: str = "", min_score: float | None = None, max_score: float | None = None):
    """A loaded project task as a local mteb task, filled in memory (nothing is downloaded or read again).

    retrieval -> Retrieval (the whole corpus); reranking -> Reranking (AbsTaskRetrieval with top_ranked = each
    query's candidates, the graded qrels as relevant_docs); candidates (a Nano split's stored lists) -> Reranking
    of those lists; sts -> STS (AbsTaskSTS: sentence1, sentence2, score; scores scaled by min_score/max_score,
    the gold range by default, which no correlation sees).  `spec` (a TaskSpec: metrics, primary, split; a
    default one when None) sets the main score (the mteb counterpart of spec.primary: map_at_10, ndcg_at_10,
    cosine_pearson) and k_values.  `metadata`: an mteb task's TaskMetadata to keep (a local copy of a C-MTEB
    task), its dataset pointed at the data."""
    import_mteb()
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.task_metadata import TaskMetadata

    if data.type not in MTEB_TYPES:
        raise ValueError(f"task {name}: type {data.type!r} has no mteb counterpart ({', '.join(MTEB_TYPES)})")
    split = split or (spec.split if spec else None) or (metadata.eval_splits[0] if metadata else "test")
    spec = spec or default_spec(data, name, split, metadata.main_score if metadata else None)
    dataset = {"path": str(data.path), "revision": data_revision(data)}
    if metadata is None:
        main = mteb_score(spec.primary) or next((m for m in map(mteb_score, spec.metrics) if m), None) \
            or ("cosine_pearson" if data.type == "sts" else "ndcg_at_10")
        metadata = TaskMetadata(
            name=name, description=description or f"{data.type} task {data.path} (split {split}), read by "
            "care.data.tasks", dataset=dataset, type=MTEB_TYPES[data.type], category="t2t", modalities=["text"],
            eval_splits=[split], eval_langs=LANGUAGES, main_score=main, domains=["Medical"], license="not specified",
            annotations_creators="derived", dialect=[], sample_creation="found", bibtex_citation="")
    else:
        metadata = metadata.model_copy(update={"dataset": dataset, "eval_splits": [split]})
    retrieval_cls, sts_cls = _care_task_classes()
    attrs: dict[str, Any] = {"metadata": metadata, "care_task_type": "retrieval" if data.type == "candidates"
                             else data.type}
    top_ranked = None
    if data.type == "sts":
        base = sts_cls
        low = min(data.gold) if min_score is None else min_score
        high = max(data.gold) if max_score is None else max_score
        attrs.update(min_score=low, max_score=high if high > low else low + 1)
    else:
        base = retrieval_cls
        ks = {parse_metric(m)[1] for m in spec.metrics if m not in STS_SCORES and mteb_score(m)}
        attrs["k_values"] = tuple(sorted(set(AbsTaskRetrieval.k_values) | ks))
        if data.type == "reranking":
            top_ranked = {q: list(j) for q, j in data.qrels.items()}
        elif data.type == "candidates":
            keep = spec.reader_options.get("safeguard", True)
            top_ranked = {q: [d for d in data.candidates[q] if keep or d != data.safeguards.get(q)]
                          for q in data.queries}
    cls = type("Care" + re.sub(r"\W", "", name.title()), (base,), attrs)
    return cls(data, split, spec, top_ranked)


def _builder(build):
    """`build="auto"`: the library never runs a pipeline stage (tests/test_layers.py), so a stand-in benchmark
    must already be built (by `python -m data_pipeline stage=benchmarks` or any evaluate.py run); a missing
    one is named with that command.  Pass data_pipeline.benchmarks.build to build it here."""
    if build != "auto":
        return build

    def require_built(name: str, data: dict, data_dir: str):
        if not (Path(data_dir) / "benchmarks" / name / "stats.json").is_file():
            raise FileNotFoundError(f"the open stand-in benchmark {name} is not built under {data_dir}: run "
                                    "`python -m data_pipeline stage=benchmarks` (or evaluate.py once) first")

    return require_built


def load_project_benchmarks(benchmark: Any = "cmedteb_open", build: Any = "auto", overrides: Sequence[str] = ()):
    """[(Benchmark, [(TaskSpec, TaskData)])] as evaluate.py loads them (care.evaluation.corpora.load_benchmarks,
    stand-in files built first when missing or stale).  `benchmark`: a conf/benchmark name (with evaluate
    `overrides`, e.g. benchmark.tasks.sts.path=...), an app config (evaluate's: its `benchmark` and
    `extra_benchmark`), one benchmark's own config (a mapping with `tasks` or `nano`), or what
    load_benchmarks returned."""
    from omegaconf import DictConfig, OmegaConf

    from care.config import load_config
    from care.evaluation.corpora import load_benchmarks

    if isinstance(benchmark, list):
        return benchmark
    cfg = load_config("evaluate", [f"benchmark={benchmark}", "~benchmark@extra_benchmark", *overrides]) \
        if isinstance(benchmark, str) else benchmark
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    if "tasks" in cfg or "nano" in cfg:  # one benchmark's own config
        cfg = {"benchmark": cfg}
        if cfg["benchmark"].get("build"):
            app = OmegaConf.to_container(load_config("evaluate", ["~benchmark@extra_benchmark"]), resolve=True)
            cfg.update(data=app["data"], data_dir=app["data_dir"])
    return load_benchmarks(cfg, build=_builder(build), show_progress=False)


def benchmark_tasks(benchmark: Any = "cmedteb_open", keys: Sequence[str] | None = None, build: Any = "auto",
                    overrides: Sequence[str] = ()) -> list:
    """Every task of a project benchmark (the open stand-in by default; see load_project_benchmarks for what
    `benchmark` may be) as a local mteb task named `<benchmark>.<task key>`, filled from the data evaluate.py
    loads (mteb_task).  `keys`: only these task keys (or full names)."""
    tasks = []
    for bench, loaded in load_project_benchmarks(benchmark, build, overrides):
        for spec, data in loaded:
            name = f"{bench.name}.{spec.key}"
            if keys and spec.key not in keys and name not in keys:
                continue
            tasks.append(mteb_task(data, name, spec, description=f"{bench.label}: {spec.title}. {spec.source}".strip()))
    if keys and not tasks:
        raise ValueError(f"no task {', '.join(keys)} in the benchmark")
    return tasks


def registered_task(name: str):
    """mteb.get_task(name), or the mteb task whose dataset is the hub dataset `name` (mteb/CMedQAv2-reranking; an
    older id whose last part is the task's name, C-MTEB/CMedQAv2-reranking, finds it too)."""
    mteb = import_mteb()
    try:
        return mteb.get_task(name)
    except KeyError:
        if "/" not in name:
            raise
    from mteb.get_tasks import _TASKS_REGISTRY

    hits = [n for n, cls in _TASKS_REGISTRY.items() if cls.metadata.dataset.get("path") == name] or \
        [n for n in _TASKS_REGISTRY if n == name.rsplit("/", 1)[1]]  # C-MTEB/CMedQAv2-reranking: now mteb/...
    if not hits:
        raise KeyError(f"no mteb task is named {name!r} or reads the dataset {name!r}") from None
    return mteb.get_task(hits[0])


def cmteb_task(name: str, path: str | Path | None = None, split: str | None = None):
    """A C-MTEB (any mteb) task by name or hub dataset: without `path`, mteb's own task, its data from the hub
    as mteb defines it (only its first eval split, or `split`, kept); with `path`, a local copy read by the
    project's loaders (load_local_copy) into a local task of the same name, type and main score."""
    task = registered_task(name)
    meta = task.metadata
    split = split or meta.eval_splits[0]
    if split not in meta.eval_splits and path is None:
        raise ValueError(f"mteb task {meta.name} has no eval split {split!r} (it has {', '.join(meta.eval_splits)})")
    if path is None:
        task.filter_eval_splits([split])
        return task
    kind = DATA_TYPES.get(meta.type)
    if kind is None:
        raise ValueError(f"mteb task {meta.name} is a {meta.type} task: local copies are read for "
                         f"{', '.join(DATA_TYPES)} tasks")
    data = load_local_copy(path, kind, split)
    return mteb_task(data, meta.name, split=split, metadata=meta, min_score=getattr(task, "min_score", None),
                     max_score=getattr(task, "max_score", None))
