"""Where a model came from, and how a card names paths: nothing here writes a file.

    portable(value) / scrub(text)                  every absolute local path made relative (care.paths, where
                                                   every writer of a file finds them)
    model_id(folder) -> str                        how a card names its own folder ("<run>/final")
    data_lineage(texts, examples) -> dict          the data pipeline's stats behind a pair of training files
    base_models(model_cfg) -> list[str]            the start model(s): hub ids where known, else folder names
    changed_settings(config) -> list[tuple]        the run's settings that differ from conf/train.yaml's

A card holds no absolute local path: paths become names relative to the project's outputs/, .cache/ or
shared data folders, or the folder's own name.  base_models follows a start that is itself a folder this
project trained (a CARE stage I tower, an earlier run's final/) back to its own start, through the
care_training.json record (care.encoders.registry.read_record).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import OmegaConf

from care.config import CONF_DIR, load_config
from care.data.io import file_digest
from care.encoders.registry import TRAINING_RECORD, read_record
from care.families import family_of, tower_configs
from care.paths import portable, relative_name, scrub  # noqa: F401  (portable, scrub: card.py imports them here)

STAGES = ("import", "dedup", "build", "mine")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Settings never shown as "differs from the default": where files go and what the run is called (the
# data files are in the lineage section).
NOT_SETTINGS = ("output_dir", "run_name", "experiment_name", "data.dir", "data.texts", "data.examples",
                "wandb.", "hydra.", "model.build_hint", "model.thresholds.how", "overwrite")


# ---- paths ----------------------------------------------------------------------------------------------

def model_id(folder: str | Path) -> str:
    """How the card names its own folder: "<run>/final" for a training run's final/, best/ or tuned/."""
    folder = Path(folder).resolve()
    return f"{folder.parent.name}/{folder.name}" if folder.name in ("final", "best", "tuned") else folder.name


# ---- lineage --------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _stage_stats(folder: Path) -> dict | None:
    stats = _read_json(folder / "stats.json")
    return stats if stats and stats.get("stage") in STAGES else None


def _compact_stage(name: str, s: dict, folder: Path) -> dict:
    out = {"folder": folder.name, "fingerprint": s.get("fingerprint")}
    if s.get("complete") is False:
        out["complete"] = False
    if name == "import":
        out["outputs"] = s.get("outputs")
        out["sources"] = sorted(s.get("sources") or {})
    elif name == "dedup":
        steps = s.get("stages") or {}
        out["filters"] = {"roles": s.get("roles"), "sources": s.get("sources")}
        out["texts_in"] = s.get("texts_in")
        out["after"] = {k: steps[k].get("out") for k in s.get("stage_order") or steps if k in steps}
        out["texts_out"] = s.get("texts_out")
        th = s.get("thresholds") or {}
        if th:
            out["semantic_cosine"] = th.get("dedup_cosine", th.get("cosine"))
    elif name == "build":
        out.update({k: s.get(k) for k in ("examples", "texts", "training_pairs", "unlabelled_texts")})
        out["rules"] = {r: v.get("kept") for r, v in (s.get("rules") or {}).items()}
        out["leakage_removed"] = s.get("leakage_removed")
    elif name == "mine":
        out.update({k: s.get(k) for k in ("examples", "texts", "similarity", "examples_with_fallback")})
        enc, window = s.get("encoder") or {}, s.get("window") or {}
        out["encoder"] = enc.get("name")
        out["window"] = {k: window.get(k) for k in ("lo", "hi", "source") if k in window}
        out["negatives_per_example"] = (s.get("negatives") or {}).get("per_example_mean")
        out["dedup_texts_removed"] = s.get("dedup_texts_removed")
    return portable(out)


def _compact_leakage(report: dict) -> dict:
    sets = {}
    for name, v in (report.get("eval_sets") or {}).items():
        before, after = v.get("before") or {}, v.get("after") or {}
        sets[name] = {"queries": v.get("queries"),
                      "before": {k: before.get(k, 0) for k in ("as_query", "as_text", "relevant_pairs")},
                      "after": sum(after.values())}
    return {"eval_sets": sets, "removed": report.get("removed") or {}}


def _lines(path: Path) -> int | None:
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return None


def data_lineage(texts_path: str | Path, examples_path: str | Path) -> dict:
    """What the training files came from: the stats.json of each `python -m data_pipeline` stage found
    beside them (the stage that wrote them, and its sibling stage folders under the same data folder:
    import/, dedup/, build/, train/), compacted to fingerprints and counts, plus the build stage's leakage
    report.  Files of your own, with no stage stats beside them, give {"pipeline": False, "note": ...}.
    JSON-able; stored by the trainer in care_training.json under "lineage"."""
    texts, examples = Path(texts_path), Path(examples_path)
    files = {"texts": relative_name(str(texts.resolve())), "examples": relative_name(str(examples.resolve()))}
    for key, path in (("texts", texts), ("examples", examples)):
        if path.is_file():
            files[f"{key}_digest"] = file_digest(path)
    n_examples = _lines(examples)
    own = _stage_stats(examples.parent)
    if own is None:
        return {"pipeline": False, "training_files": files, "training_examples": n_examples,
                "note": "training files not written by `python -m data_pipeline` (no stage stats.json beside "
                        "them): no pipeline lineage"}
    found: dict[str, tuple[Path, dict]] = {own["stage"]: (examples.parent, own)}
    root = examples.parent.parent
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p != examples.parent):
        s = _stage_stats(sub)
        if s is not None and s["stage"] not in found:
            found[s["stage"]] = (sub, s)
    stages = {name: _compact_stage(name, found[name][1], found[name][0]) for name in STAGES if name in found}
    leakage = None
    for name in (own["stage"], "build"):  # mine copies build's leakage.json beside the training files
        if name in found and (report := _read_json(found[name][0] / "leakage.json")) and report.get("eval_sets"):
            leakage = _compact_leakage(report)
            break
    lineage = {"pipeline": True, "training_files": files, "written_by": own["stage"], "stages": stages,
               "leakage": leakage, "training_examples": n_examples}
    missing = [s for s in STAGES if s not in found and STAGES.index(s) < STAGES.index(own["stage"])]
    if missing:
        lineage["note"] = f"no stats.json found for the earlier stage(s) {', '.join(missing)} under {root.name}/"
    if own.get("examples") is not None and n_examples is not None and own["examples"] != n_examples:
        lineage["note"] = (f"{examples.name} has {n_examples} examples but its stage's stats.json says "
                           f"{own['examples']}: the file was changed after the pipeline wrote it")
    return lineage


# ---- base models ----------------------------------------------------------------------------------------

def _is_hub_id(path: str) -> bool:
    return bool(path) and path[0] not in "/.~" and not Path(path).exists() and bool(HUB_ID.match(path))


def training_record(folder: Path) -> dict | None:
    """A folder's training record, or None where it has none (or an unreadable one)."""
    if not (folder / TRAINING_RECORD).is_file():
        return None
    try:
        record = read_record(folder)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _base_of(c: dict, depth: int = 0) -> str:
    if c.get("hub_id"):
        return str(c["hub_id"])
    path = str(c.get("path") or "")
    if not path:
        return str(c.get("name") or "unknown")
    if _is_hub_id(path):
        return path
    folder = Path(path).expanduser()
    if depth < 4:  # a folder this project trained: its own start (CARE stage II's query tower is stage I's)
        record, part = training_record(folder), None
        if record is None and folder.name in ("query", "document"):
            record, part = training_record(folder.parent), folder.name
        if record is not None and record.get("base_models"):  # named when it trained, from its real paths
            names = record["base_models"]
            return names[-1] if part == "document" else names[0]
        start = ((record or {}).get("config") or {}).get("model") or {}
        if part:
            start = start.get(part) or {}
        elif family_of(start).towers:
            start = {}  # a whole CARE model as a one-backbone start: name the folder itself
        if start and Path(str(start.get("path", ""))).expanduser().resolve() != folder.resolve():
            return _base_of(start, depth + 1)
    # a tower of a two-tower folder (care.encoders.builders.towers writes OUT/query, OUT/document): name it with its
    # parent, "care-tiny/query", not just its role
    return f"{folder.parent.name}/{folder.name}" if folder.name in ("query", "document") else folder.name or path


def base_models(model_cfg: dict) -> list[str]:
    """The start model(s) of a model config (the training config's `model`): one for M3 / dense, the query
    and the document tower's for CARE, each as `_base_of` names it (hub_id, a hub path, else the folder's
    name)."""
    return list(dict.fromkeys(_base_of(tower) for tower in tower_configs(model_cfg)))


# ---- settings -------------------------------------------------------------------------------------------

def _flatten(d, prefix: str = "") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                out.update(_flatten(v, key + "."))
            else:
                out[key] = v
    return out


def _defaults(config: dict) -> dict:
    """The resolved conf/train.yaml with the run's model config file, as `python train.py model=NAME` gives."""
    name = (config.get("model") or {}).get("name")
    overrides = [f"model={name}"] if name and (CONF_DIR / "model" / f"{name}.yaml").is_file() else []
    try:
        return OmegaConf.to_container(load_config("train", overrides), resolve=True)
    except Exception:  # noqa: BLE001 (a config the current conf/ no longer composes: no comparison)
        return {}


def changed_settings(config: dict) -> list[tuple[str, object, object]]:
    """(key, this run's value, the default) for every setting of the run that differs from the default
    composition of conf/train.yaml with its model (paths made portable; file locations left out)."""
    if not config:
        return []
    ours, base = _flatten(portable(config)), _flatten(portable(_defaults(config)))
    missing = object()
    rows = []
    for key, value in ours.items():
        if any(key == n or key.startswith(n if n.endswith(".") else n + ".") for n in NOT_SETTINGS):
            continue
        default = base.get(key, missing)
        if default is missing:
            rows.append((key, value, "(not set)"))
        elif default != value:
            rows.append((key, value, default))
    return rows
