"""The rows evaluate.py scores (`model_entries`): the model under test -- a conf/model config, or each model folder of
`ckpt=` (a run's final/, best/ and tuned/, with `checkpoints=all` every saved step too) -- optionally cut to
`truncate_dim`, then the baselines not already among them; and the check that every local model folder exists
before any benchmark is loaded.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from care.config import CONF_DIR, model_config
from care.encoders import detect
from care.encoders.prompts import Prompts
from care.encoders.registry import (
    CHECKPOINT_MODEL,
    TRAINING_RECORD,
    best_weights,
    holds_starting_weights,
    read_record,
)
from care.families import family_of, tower_configs

log = logging.getLogger(__name__)


def checkpoint_models(ckpt: str, model_cfg: dict, checkpoints: str = "best_final") -> list[tuple[str, dict]]:
    """(row name, model config) for a checkpoint folder, or for each checkpoint folder inside it; with
    `checkpoints=all` also every saved checkpoint of a training run (checkpoints/step-N/model), as
    "<run>/step-N", in step order."""
    if checkpoints not in ("best_final", "all"):
        raise ValueError(f"checkpoints={checkpoints}: choose best_final or all")
    path = Path(ckpt).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"ckpt={ckpt}: {path} is not a folder")
    if (own := detect(path, model_cfg)) is not None:
        warn_if_untrained(path, name := row_name(path))
        return [(name, own)]
    subs = [(sub, c) for sub in sorted(path.iterdir()) if sub.is_dir() and (c := detect(sub, model_cfg)) is not None]
    for sub, _ in subs:
        warn_if_untrained(sub, f"{path.name}/{sub.name}")
    found = [(f"{path.name}/{sub.name}", c) for sub, c in subs]
    if checkpoints == "all":
        found += [(f"{path.name}/{step.name}", c) for step in sorted((path / "checkpoints").glob("step-*"))
                  if (c := detect(step / CHECKPOINT_MODEL, model_cfg)) is not None]
    if not found:
        runs = sorted(sub.name for sub in path.iterdir() if (sub / "final").is_dir())
        if (path / "state.pt").exists():
            hint = " It holds state.pt: that is a training-resume checkpoint; evaluate the run's final/ or best/ folder."
        elif runs:  # outputs/train: the folder of runs, one level above the runs
            hint = (f" It holds training runs ({', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}): pass one of "
                    f"them, ckpt={path / runs[0]}")
        else:
            hint = ""
        raise ValueError(f"ckpt={ckpt}: {path} is not a model checkpoint (no config.json, care_training.json or "
                         f"M3 head files) and holds no checkpoint folders.{hint}")
    return found


def warn_if_untrained(folder: Path, name: str) -> None:
    """Say so when a trained folder holds its run's starting weights: its training record chose the step-0
    validation as the best (a later one only tied it, care/training/model_saving.py warn_untrained_final), so the
    row named after a run of N steps scores the weights the run started from (for CARE's final/, stage II's start:
    the stage-I model)."""
    if not (folder / TRAINING_RECORD).is_file():
        return
    record = read_record(folder)
    if holds_starting_weights(record):
        log.warning("row %s: %s holds its run's starting weights (care_training.json weights '%s' after %d steps: "
                    "no later validation beat the start), so it scores the weights that run started from",
                    name, folder, best_weights(0), record["steps"])


def row_name(folder: Path) -> str:
    """The row name of one model folder: a training run's final/, best/ or tuned/ is named after its run
    ("cpu_default-me5_small/final"), a saved checkpoint's model/ (<run>/checkpoints/step-N/model) as
    checkpoints=all names it ("<run>/step-N"), any other folder by its name."""
    folder = Path(folder)
    if folder.name in ("final", "best", "tuned"):
        return f"{folder.parent.name}/{folder.name}"
    step = folder.parent
    if folder.name == CHECKPOINT_MODEL and step.name.startswith("step-") and step.parent.name == "checkpoints":
        return f"{step.parent.parent.name}/{step.name}"
    return folder.name


def _model_file(name: str, cfg: dict) -> dict:
    """A baseline's model config, composed as `model=<name>` would be, under this run's roots."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise FileNotFoundError(f"baseline {name!r}: no conf/model/{name}.yaml (known: bm25, {known})")
    return model_config(name, cfg)


def model_entries(cfg: dict) -> list[dict]:
    """The rows of the table: the model(s) under test, then the baselines not already among them."""
    if cfg.get("ckpt"):
        entries = [{"name": name, "label": name, "model": c}
                   for name, c in checkpoint_models(cfg["ckpt"], cfg["model"], cfg.get("checkpoints", "best_final"))]
    else:
        entries = [{"name": cfg["model"]["name"], "label": cfg["model"].get("label", cfg["model"]["name"]),
                    "model": cfg["model"]}]
    if cfg.get("truncate_dim"):
        entries = [cut_entry(e, int(cfg["truncate_dim"])) for e in entries]
    for name in cfg.get("baselines") or []:
        if name == "bm25":
            entries.append({"name": "bm25", "label": "BM25 (bm25s + jieba)", "bm25": True, "baseline": True})
            continue
        model = _model_file(name, cfg)
        twin = next((e for e in entries if "model" in e and _identity(e["model"]) == _identity(model)), None)
        if twin is not None:  # the model under test is this baseline: one row, labelled as both
            twin["label"] += " [zero-shot baseline]"
            continue
        entries.append({"name": name, "label": f"{model.get('label', name)} [zero-shot baseline]", "model": model,
                        "baseline": True})
    return entries


def cut_entry(entry: dict, dim: int) -> dict:
    """A model under test scored on the first `dim` coordinates of its dense vectors (truncate_dim=: the
    project's Matryoshka convention, normalised at full width and not re-normalised; care/encoders/m3.py)."""
    model = entry["model"]
    if not (family := family_of(model)).cuts:
        why = ("its pair scores are no vectors" if family.cross_encoder else
               "a CARE model's document vectors are already cut to its query tower's width")
        raise ValueError(f"truncate_dim={dim}: {why}; cut a one-encoder model (kind dense or m3)")
    return {**entry, "name": f"{entry['name']}@{dim}d", "label": f"{entry['label']} @ {dim}-d",
            "model": {**model, "truncate_dim": dim}}


def check_model_folders(entries: list[dict], cfg: dict) -> None:
    """A model row whose path is a local folder that does not exist fails here, before any benchmark is
    loaded.  `make model` (the model config's build_hint) is advised only for the folder that config builds;
    a folder of the user's own (model.path=...) is said not to exist, and its row loses the hint."""
    for entry in entries:
        model = entry.get("model") or {}
        path = model.get("path")
        if not path or family_of(model).towers:
            continue
        own = _configured_path(model.get("name"), cfg)
        if own is None or _same_path(path, own):
            hint = model.get("build_hint", "")
        else:
            hint = ""
            model.pop("build_hint", None)
        folder = Path(os.path.expanduser(str(path)))
        looks_local = folder.is_absolute() or str(path).startswith((".", "~"))
        if looks_local and not folder.exists():
            raise FileNotFoundError(f"model {entry['name']}: the model folder {folder} does not exist"
                                    + (f". {hint}" if hint else ""))


def _configured_path(name: str | None, cfg: dict) -> str | None:
    """The model path conf/model/<name>.yaml gives (None for a model without its own config file)."""
    if not name or not (CONF_DIR / "model" / f"{name}.yaml").is_file():
        return None
    try:
        return _model_file(name, cfg).get("path")
    except Exception:  # noqa: BLE001 (an unresolvable file: no path to compare with)
        return None


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and Path(os.path.expanduser(str(a))).resolve() == Path(os.path.expanduser(str(b))).resolve()


def model_folders(entry: dict) -> list[str] | None:
    """The folder(s) holding a row's weights: its model's path, or a two-tower model's towers' (None for BM25):
    what makes a row the same model as an earlier row of its name (care.evaluation.run_folder.claim)."""
    model = entry.get("model")
    if not model:
        return None
    paths = [side.get("path") for side in tower_configs(model)]
    return None if not all(paths) else [str(Path(os.path.expanduser(str(p)))) for p in paths]


def _identity(model: dict) -> tuple:
    """What makes two model configs one model: a CARE model has no top-level path, its towers' folders tell
    a trained checkpoint from the untrained towers of its own config file."""
    return (str(model.get("kind")), str(model.get("truncate_dim")),
            *((str(side.get("path")), str(side.get("pooling"))) for side in tower_configs(model)),
            Prompts.from_config(model))
