"""The command line (python -m care.evaluation.mteb_adapter), and the encoder evaluate.py builds.

    python -m care.evaluation.mteb_adapter model=tiny_bert benchmark=cmedteb_open [keys=cmed_v1,sts]
    python -m care.evaluation.mteb_adapter ckpt=<folder> benchmark=cmedteb benchmark.tasks.sts.path=...
    python -m care.evaluation.mteb_adapter model=bge_m3 tasks=CMedQAv2-reranking,CmedqaRetrieval=/data/Cmedqa
    python -m care.evaluation.mteb_adapter model=tiny_bert nano=outputs/data/nano/CMedNanoOpen [reranking=true]
    python -m care.evaluation.mteb_adapter ckpt=outputs/train/<run>/final nano=<folder> [splits=a,b]

The benchmark and task runs print, per task, mteb's main score and the project's counterpart (evaluate.py's
runners on the same data in the same process, dense head) with the difference; `cache=true` shares the
evaluate embedding cache between the two.  Any other key=value is an evaluate override.

Every run also leaves mteb's results in mteb's own result-cache layout (results.py), read by mteb's tools and
leaderboard: `results=<dir>` (or `--results <dir>`; default <out_root>/mteb, conf/roots.yaml; `results=none`
writes nothing) -> <dir>/results/<org__name>/<revision>/<Task>.json + model_meta.json.  The ModelMeta's name is
`care/<model name>` unless `name=org/name`; `license=<mteb license id>` and `training_datasets=TaskA,TaskB` (mteb
task names; empty = none of mteb's) state what the model config does not (its `license` and
`training_datasets` keys are read too).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from care.data.nano import resolve
from care.encoders import Encoder
from care.encoders.cache import EmbeddingCache
from care.evaluation.mteb_adapter.model import MtebEncoder, import_mteb
from care.evaluation.mteb_adapter.nano import MAIN_SCORES, run_mteb
from care.evaluation.mteb_adapter.results import meta_fields, results_dir
from care.evaluation.mteb_adapter.run import compare, print_comparison
from care.evaluation.mteb_adapter.tasks import benchmark_tasks, cmteb_task
from care.paths import follow_cache_root


def evaluate_config(overrides: Sequence[str]) -> dict:
    """evaluate.py's config for the same overrides, resolved; `model=<folder>` is taken as `ckpt=<folder>`."""
    from omegaconf import OmegaConf

    from care.config import load_config

    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model" and ("/" in value or Path(value).expanduser().is_dir()):  # a folder, not a config name
            o = f"ckpt={value}"
        rest.append(o)
    return OmegaConf.to_container(load_config("evaluate", rest), resolve=True)


def encoder_from_config(overrides: Sequence[str] | Mapping) -> Encoder:
    """The encoder evaluate.py builds for the same overrides (or resolved evaluate config): `model=<conf/model
    name>`, or a checkpoint folder as `ckpt=<folder>` or `model=<folder>` (built like evaluate.py's ckpt=, from
    the folder's own record or the `model` config), plus any evaluate override (`model.path=...`,
    `max_length=...`, `device=...`)."""
    from care.encoders import build_encoder
    from care.evaluation.corpora import model_from_app_config
    from care.families import DENSE, require

    cfg = overrides if isinstance(overrides, Mapping) else evaluate_config(overrides)
    model = model_from_app_config(cfg)
    require(model, APP, needs=(DENSE,))  # mteb scores dense vectors (evaluate.py scores every family)
    return build_encoder(model, device=cfg.get("device"))


APP = "python -m care.evaluation.mteb_adapter"
#: what main() needs told: one of these
USAGE = ("say what to run: benchmark=<conf/benchmark name> (cmedteb_open: the open stand-in; cmedteb: your own "
         "copy, with benchmark.tasks.<slot>.path=...), tasks=<mteb task>[=<local copy>],... (e.g. "
         "tasks=CMedQAv2-reranking,CmedqaRetrieval=/data/CmedqaRetrieval), or nano=<Nano folder>")


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def _dashed(argv: Sequence[str]) -> list[str]:
    """`--results DIR` and `--results=DIR` as `results=DIR` (the one option also spelt the getopt way)."""
    out, args = [], list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--results":
            if not args:
                raise ValueError("--results: expected a folder after it")
            arg = f"results={args.pop(0)}"
        elif arg.startswith("--results="):
            arg = arg[2:]
        out.append(arg)
    return out


def results_options(own: Mapping, model_cfg: Mapping, app_cfg: Mapping) -> tuple[Path | None, dict]:
    """The results folder (None for results=none; default <out_root>/mteb of the app config) and the
    ModelMeta's caller-set fields: the model config's `license` and `training_datasets`, overridden by the
    command line's.  Also points mteb's import-time cache at <cache_root>/mteb unless MTEB_CACHE is set."""
    os.environ.setdefault("MTEB_CACHE", str(Path(app_cfg["cache_root"]) / "mteb"))
    choice = own.get("results") or ""
    folder = None if choice.lower() in ("none", "false", "off") else results_dir(choice or Path(app_cfg["out_root"]) / "mteb")
    meta = meta_fields(model_cfg)
    meta.update(meta_fields({k: own.get(k) for k in ("license", "training_datasets")}))
    return folder, meta


def main(argv: Sequence[str]) -> dict:
    """The command line: one of

        model=<name>|ckpt=<folder> benchmark=<name> [keys=a,b] [tasks=NAME[=PATH],...] [cache=true]
        model=<name>|ckpt=<folder> tasks=NAME[=PATH],... [cache=true]
        model=<name>|ckpt=<folder> nano=<folder> [splits=a,b] [reranking=true] [source=loader]

    each with [results=<dir>|none] [name=org/name] [license=<id>] [training_datasets=A,B] (the module docstring).
    Every other key=value (or ~key) is an evaluate override (benchmark.tasks.<key>.path=..., max_length=...,
    batch_size=...); the extra_benchmark runs only when an override names it (benchmark@extra_benchmark=...).
    Returns compare()'s rows (run_mteb's {split: scores} for nano=)."""
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__)  # the command lines and every option, as --help does for the other command lines
        return {}
    own = {"nano": None, "splits": None, "reranking": "false", "source": "memory", "tasks": None, "keys": None,
           "cache": "false", "results": None, "name": None, "license": None, "training_datasets": None}
    overrides = []
    for arg in _dashed(argv):
        key, eq, value = arg.partition("=")
        if not eq and not arg.startswith("~"):  # ~key: a Hydra deletion (e.g. ~benchmark.tasks.cmed_v1)
            raise ValueError(f"argument {arg!r}: expected key=value")
        if key in own:
            own[key] = value
        else:
            overrides.append(arg)
    keys = [o.partition("=")[0].lstrip("+") for o in overrides]
    extra = any("extra_benchmark" in k and not k.startswith("~") for k in keys)
    benchmark = extra or any(k == "benchmark" or k.startswith("benchmark.") for k in keys)
    if own["nano"]:
        if benchmark or own["tasks"]:
            raise ValueError("nano= runs on its own: give benchmark= or tasks= in a run of their own")
        return main_nano(own, overrides)
    if not benchmark and not own["tasks"]:
        raise ValueError(USAGE)
    cfg = evaluate_config(overrides)
    follow_cache_root(cfg["cache_root"])  # its ONNX exports and digest memo too (the Hydra apps: at job start)
    if not extra:
        cfg["extra_benchmark"] = None
    encoder = encoder_from_config(cfg)
    folder, meta = results_options(own, _model_config(cfg), cfg)
    tasks = benchmark_tasks(cfg, keys=own["keys"].split(",") if own["keys"] else None) if benchmark else []
    for item in filter(None, (own["tasks"] or "").split(",")):
        name, _, path = item.partition("=")
        tasks.append(cmteb_task(name.strip(), path.strip() or None))
    cache = EmbeddingCache(cfg["cache"]["dir"]) if _truthy(own["cache"]) else None
    rows = compare(encoder, tasks, batch_size=cfg["batch_size"], cache=cache, depth=cfg["depth"], seed=cfg["seed"],
                   results=folder, name=own["name"], meta=meta)
    sim = MtebEncoder(encoder).similarity_name
    print_comparison(rows, f"mteb {import_mteb().__version__} | {encoder.name} | {sim} | project: evaluate.py's "
                           "runners in this process, dense head | scores 0-100")
    _say_results(folder, encoder, own["name"], meta)
    return rows


def _model_config(cfg: Mapping) -> dict:
    from care.evaluation.corpora import model_from_app_config

    return model_from_app_config(cfg)


def _say_results(folder: Path | None, encoder: Encoder, name: str | None, meta: Mapping) -> None:
    from care.evaluation.mteb_adapter.results import model_folder

    if folder is not None:
        where = model_folder(folder, MtebEncoder(encoder, name=name, meta=meta).mteb_model_meta)
        print(f"mteb results: {where} (mteb.ResultCache({str(folder)!r}).load_results())")


def main_nano(own: dict, overrides: Sequence[str]) -> dict:
    cfg = evaluate_config(overrides)
    follow_cache_root(cfg["cache_root"])
    encoder = encoder_from_config(cfg)
    folder, meta = results_options(own, _model_config(cfg), cfg)
    reranking = _truthy(own["reranking"])
    splits = own["splits"].split(",") if own["splits"] else None
    got = run_mteb(encoder, own["nano"], splits, reranking=reranking, source=own["source"], results=folder,
                   name=own["name"], meta=meta)
    names = [*MAIN_SCORES, "main_score"]
    print(f"mteb {import_mteb().__version__} | {encoder.name} | {resolve(own['nano'])}"
          + (" | reranking reranking_hybrid" if reranking else " | full-corpus retrieval"))
    print("| split | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for split, s in got.items():
        print(f"| {split} | " + " | ".join(f"{100 * s[n]:.2f}" if n in s else "-" for n in names) + " |")
    _say_results(folder, encoder, own["name"], meta)
    return got
