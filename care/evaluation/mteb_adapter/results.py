"""Where mteb's results go, and how they are read back: mteb's own result cache layout, written by mteb.

    results_dir(folder=None)          the results folder: `folder`, else <outputs>/mteb (CARE_OUTPUTS moves it)
    model_folder(folder, meta)        <folder>/results/<org__name>/<revision>: one model's task files
    load_results(folder, model)       mteb's own loader (ResultCache.load_results) on the folder
    meta_fields(model_cfg)            the ModelMeta fields a model config states (license, training_datasets)

A run with a results folder (mteb_evaluate, evaluate_tasks, compare, run_mteb: `results=`; the command line:
`results=<dir>`) hands mteb.evaluate `cache=mteb.ResultCache(<dir>)`, so mteb writes, as for any model of its
own:

    <dir>/results/care__tiny_bert/<fingerprint>/cmedteb.rerank.json   mteb's TaskResult (scores rounded to 6
    <dir>/results/care__tiny_bert/<fingerprint>/cmedteb.sts.json        decimals, as mteb rounds on disk)
    <dir>/results/care__tiny_bert/<fingerprint>/model_meta.json       the ModelMeta (model.model_meta)
    <dir>/results/care__tiny_bert/<fingerprint>/run_settings.jsonl    mteb's versions and encode kwargs per task

`mteb.ResultCache(<dir>).load_results(...)`, `mteb.load_results` on it, mteb's leaderboard and its
`results` tools read that folder as they read ~/.cache/mteb.  The name is `care/<model>` (`name=org/name`
to change it), the revision the encoder's fingerprint: a changed model never overwrites another's results.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from care.evaluation.mteb_adapter.model import import_mteb
from care.paths import outputs_dir


def results_dir(folder: str | os.PathLike | None = None) -> Path:
    """The results folder: `folder` when given, else `<outputs>/mteb` (care.paths.outputs_dir)."""
    return Path(folder).expanduser().resolve() if folder else outputs_dir() / "mteb"


def model_folder(folder: str | os.PathLike, meta) -> Path:
    """Where mteb keeps one model's results in a results folder: results/<org__name>/<revision>."""
    return Path(folder) / "results" / meta.model_name_as_path() / (meta.revision or "no_revision_available")


def load_results(folder: str | os.PathLike, models: Iterable[Any] | Any | None = None,
                 tasks: Iterable[Any] | None = None):
    """mteb's BenchmarkResults read from a results folder by mteb's own loader (ResultCache.load_results):
    every model there, or `models` (ModelMeta objects, e.g. an MtebEncoder's `mteb_model_meta`, or
    `org/name` strings), `tasks` (names or tasks) only.  Local results only (no remote repository)."""
    import_mteb()
    from mteb.cache import ResultCache
    from mteb.models.model_meta import ModelMeta

    if isinstance(models, (str, ModelMeta)):  # one model (a ModelMeta iterates over its fields: not a list)
        models = [models]
    return ResultCache(Path(folder)).load_results(models=list(models) if models is not None else None,
                                                  tasks=list(tasks) if tasks is not None else None,
                                                  include_remote=False)


def meta_fields(model_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ModelMeta fields a model config may state: `license` (an mteb license id, e.g. apache-2.0) and
    `training_datasets` (mteb task names it trained on; [] = none of mteb's).  Absent keys stay unstated."""
    cfg = dict(model_cfg or {})
    out = {}
    if cfg.get("license") is not None:
        out["license"] = str(cfg["license"])
    if cfg.get("training_datasets") is not None:
        value = cfg["training_datasets"]
        out["training_datasets"] = {v.strip() for v in value.split(",") if v.strip()} if isinstance(value, str) \
            else {str(v) for v in value}
    return out
