"""A benchmark is a config (conf/benchmark/<name>.yaml): a list of task specs, plus how to summarise them.

    name: cmedteb_open
    label: ...                    # shown above every table
    open_stand_in: true           # every output says so
    build: cmedteb_open           # optional: data_pipeline.benchmarks builds the task files when missing/stale
                                  # (a list: several builders, e.g. [cmedteb_open, cmedqa2_retrieval])
    avg: CMedTEB Avg              # optional: the mean of the tasks' slot scores, on a 0-100 scale
    tasks:
      cmed_v1:
        slot: CMed v1             # a column of the summary table (tasks without a slot give one column per metric)
        type: reranking           # retrieval | reranking | sts (care.evaluation.tasks)
        path: /data/CMedQAv1-reranking/test.jsonl   # null: must be given (or `hub`, when the hub is reachable)
        hub: C-MTEB/CMedQAv1-reranking              # optional Hugging Face dataset in the same columns
        split: test
        reader: null              # optional: a data_pipeline source reader (default by type; e.g. cmedqa_release)
        metrics: [map_cut_10, mrr_10]               # care.evaluation.metrics names; acc_N for Acc@N; pearson/spearman
        primary: map_cut_10       # the number in the table
        depth: null               # retrieval: documents kept per query (default: evaluate.yaml `depth`)
        optional: false           # true: skipped when no path is given
        average: null             # a slot task enters the benchmark's `avg`, or the mean column named here
        source: "..."             # where the data comes from, printed under the table
    nano: {path: ...}             # instead of `tasks`: a Nano dataset's splits (care/evaluation/nano.py)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from care.data.io import write_jsonl
from care.data.tasks import TYPES
from care.evaluation.tasks import RUNNERS


@dataclass
class TaskSpec:
    key: str
    type: str
    path: str | None
    metrics: list[str]
    primary: str
    split: str = "test"
    slot: str | None = None
    reader: str | None = None
    reader_options: dict = field(default_factory=dict)
    depth: int | None = None
    hub: str | None = None
    optional: bool = False
    average: str | None = None
    source: str = ""

    @property
    def title(self) -> str:
        return self.slot or self.key


@dataclass
class Benchmark:
    name: str
    label: str
    tasks: list[TaskSpec]
    open_stand_in: bool = False
    build: str | list[str] | None = None
    avg: str | None = None
    note: str = ""


def load_benchmark(cfg: DictConfig | dict, override_prefix: str = "benchmark") -> Benchmark:
    """Validate a benchmark config.  `override_prefix` is where it sits in the app config, for messages."""
    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    name = c.get("name") or "benchmark"
    if c.get("nano"):
        from care.evaluation.nano import nano_tasks

        c["tasks"] = {**nano_tasks(c["nano"], f"{override_prefix}.nano"), **(c.get("tasks") or {})}
    tasks = []
    for key, t in (c.get("tasks") or {}).items():
        where = f"{override_prefix}.tasks.{key}"
        if t.get("type") not in TYPES:
            raise ValueError(f"benchmark {name}: {where}.type is {t.get('type')!r}; choose one of {', '.join(TYPES)}")
        metrics = list(t.get("metrics") or [])
        primary = t.get("primary") or (metrics[0] if metrics else None)
        if primary not in metrics:
            raise ValueError(f"benchmark {name}: {where}.primary {primary!r} is not one of its metrics {metrics}")
        known = set(TaskSpec.__dataclass_fields__) - {"key"}
        unknown = set(t) - known
        if unknown:
            raise ValueError(f"benchmark {name}: {where} has unknown keys {sorted(unknown)} (known: {sorted(known)})")
        tasks.append(TaskSpec(key=key, **{**t, "metrics": metrics, "primary": primary}))
    if not tasks:
        raise ValueError(f"benchmark {name} lists no tasks")
    return Benchmark(name=name, label=c.get("label", name), tasks=tasks, open_stand_in=bool(c.get("open_stand_in")),
                     build=c.get("build"), avg=c.get("avg"), note=c.get("note", ""))


def hub_reachable() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") != "1" and os.environ.get("HF_DATASETS_OFFLINE") != "1"


def from_hub(hub: str, split: str, cache_root: str | Path) -> Path:
    """A hub dataset in C-MTEB's reranking columns, stored once as JSON Lines under the cache folder."""
    path = Path(cache_root) / "benchmarks" / hub.replace("/", "__") / f"{split}.jsonl"
    if not path.exists():
        from datasets import load_dataset

        rows = load_dataset(hub, split=split)
        write_jsonl(path, ({"query": r["query"], "positive": list(r["positive"]), "negative": list(r["negative"])}
                           for r in rows))
    return path


FORMATS = {"retrieval": "a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)",
           "reranking": 'a JSON Lines file {"query", "positive", "negative"}',
           "sts": 'a JSON Lines file {"sentence1", "sentence2", "score"}'}


def resolve_paths(bench: Benchmark, override_prefix: str = "benchmark", cache_root: str | Path | None = None
                  ) -> list[TaskSpec]:
    """The tasks to run: each with a path (a hub copy fetched when allowed, kept under `cache_root`: the app's
    cache_root key), optional ones without a path dropped.  Every task still missing its data is named in one error, with the override that fixes it."""
    ready, missing = [], []
    for t in bench.tasks:
        if t.path:
            ready.append(t)
        elif t.hub and hub_reachable() and cache_root is not None:
            t.path = str(from_hub(t.hub, t.split, cache_root))
            ready.append(t)
        elif not t.optional:
            hub = (f"; or let it come from the hub ({t.hub}): unset HF_HUB_OFFLINE where the hub is reachable"
                   if t.hub else "")
            missing.append(f"  {t.title}: {override_prefix}.tasks.{t.key}.path=... ({FORMATS[t.type]}){hub}")
    if missing:
        raise FileNotFoundError(f"benchmark {bench.name}: no data for {len(missing)} task(s):\n" + "\n".join(missing))
    return ready


def run_task(spec: TaskSpec, data, scorer, depth: int = 1024, seed: int = 0, items: dict | None = None) -> dict:
    """Scores of every method of `scorer` on one loaded task (0-1 scale); `items` as the runners take it."""
    if spec.type == "retrieval":
        return RUNNERS["retrieval"](data, scorer, spec.metrics, depth=spec.depth or depth, seed=seed, items=items)
    if spec.type == "candidates":
        return RUNNERS["candidates"](data, scorer, spec.metrics, items=items,
                                     safeguard=spec.reader_options.get("safeguard", True))
    return RUNNERS[spec.type](data, scorer, spec.metrics, items=items)


def average_groups(bench: Benchmark) -> dict[str, tuple[str, list[str]]]:
    """{score key: (column title, slot task keys)}: the benchmark's Avg ("avg") over the slot tasks that name
    no other mean, then each mean a task names (`average`, e.g. a Nano dataset's "Hybrid mean")."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for t in bench.tasks:
        if not t.slot or (t.average is None and not bench.avg):
            continue
        key, title = ("avg", bench.avg) if t.average is None else (f"avg/{t.average}", t.average)
        groups.setdefault(key, (title, []))[1].append(t.key)
    return groups


def averages(bench: Benchmark, primary_by_task: dict[str, float]) -> dict[str, float]:
    """Each mean column of the benchmark (0-100), e.g. the CMedTEB Avg of the five slots: a plain mean of
    MAP@10, MAP@10, nDCG@10, MAP@10 and Pearson (the paper's definition, mixing a correlation with ranking
    metrics).  A mean with a slot missing is left out."""
    return {key: 100 * sum(primary_by_task[k] for k in keys) / len(keys)
            for key, (_, keys) in average_groups(bench).items() if all(k in primary_by_task for k in keys)}
