"""What an evaluation run embeds, shared by evaluate.py (which scores it) and encode.py (which embeds a
benchmark's documents ahead of time into the embedding cache), so that the two cannot disagree on the
texts, the task types or the model settings, hence on the cache keys:

    load_benchmarks(cfg, build)   the `benchmark` and `extra_benchmark` of an app config, each task loaded
    document_texts(loaded)        every text the task runners embed on the document side, by task type
    evaluation_model(model, n)    the model config as evaluation builds it (token limit capped at n)
    model_from_app_config(cfg)    that config for an app's `model=` or `ckpt=<model folder>`
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from care.data.tasks import TaskData, load_task
from care.evaluation.benchmarks import Benchmark, TaskSpec, load_benchmark, resolve_paths
from care.families import family_of
from care.progress import progress

#: where an app config holds its benchmarks (evaluate.yaml and encode.yaml alike)
PLACES = ("benchmark", "extra_benchmark")


def load_benchmarks(cfg: dict, build: Callable[[str, dict, str], dict] | None = None,
                    show_progress: bool = True) -> list[tuple[Benchmark, list[tuple[TaskSpec, TaskData]]]]:
    """[(benchmark, [(task spec, task data)])] for each benchmark the config names.  `build(name, data,
    data_dir)` makes a stand-in benchmark's files first when missing or stale (the app passes
    data_pipeline.benchmarks.build: the library never imports the stages)."""
    loaded = []
    for where in PLACES:
        if not cfg.get(where):
            continue
        bench = load_benchmark(cfg[where], where)
        if bench.build:
            if build is None:
                raise ValueError(f"benchmark {bench.name} is built from the shared data ({bench.build}) but no builder was given")
            for name in [bench.build] if isinstance(bench.build, str) else bench.build:
                build(name, cfg["data"], cfg["data_dir"])
        specs = resolve_paths(bench, where, cfg.get("cache_root"))
        bench.tasks = specs
        tasks = []
        for spec in progress(specs, desc=f"load {bench.name}", unit="task", enabled=show_progress):
            tasks.append((spec, load_task(spec.type, spec.path, spec.split, spec.reader, spec.reader_options)))
        loaded.append((bench, tasks))
    return loaded


def document_texts(loaded: list[tuple[Benchmark, list[tuple[TaskSpec, TaskData]]]]) -> dict[str, list[str]]:
    """{task type: its document texts, each once, in task order}: what the runners (care.evaluation.tasks)
    embed on the document side, with the task type they pass.  Retrieval corpora and reranking candidates;
    STS embeds both sentences as queries and adds none."""
    out: dict[str, dict[str, None]] = {}
    for _, tasks in loaded:
        for _, data in tasks:
            if data.type != "sts":
                out.setdefault(data.type, {}).update(dict.fromkeys(data.docs.values()))
    return {task: list(texts) for task, texts in out.items()}


def evaluation_model(model: dict, max_length: int | None) -> dict:
    """The model config evaluation builds its encoder from: the model's own token limit (each tower's, for
    two towers), capped at `max_length` when given (evaluate.yaml's `max_length`).  The limit is part of a side's fingerprint, so
    encode.py must cap it the same way for evaluation to find its vectors."""
    model = dict(model)
    if not max_length:
        return model
    if sides := family_of(model).towers:  # two towers: each has its own limit (care.models.towers)
        for side in sides:
            tower = dict(model[side])
            tower["max_length"] = min(int(tower.get("max_length", 512)), int(max_length))
            model[side] = tower
        return model
    model["max_length"] = min(int(model.get("max_length", 512)), int(max_length))
    return model


def model_from_app_config(cfg: dict) -> dict:
    """The model config evaluation would build for an app config's `model=` or `ckpt=<one model folder>`
    (care.encoders.registry.detect), token limit capped by its `max_length` (encode.py, the mteb adapter)."""
    from care.encoders.registry import detect

    model = cfg["model"]
    if cfg.get("ckpt"):
        path = Path(cfg["ckpt"]).expanduser().resolve()
        model = detect(path, model) if path.is_dir() else None
        if model is None:
            raise FileNotFoundError(f"ckpt={cfg['ckpt']}: {path} is not a model folder (no config.json, "
                                    "care_training.json or M3 head files)")
    return evaluation_model(model, cfg.get("max_length"))
