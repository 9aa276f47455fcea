"""Compose the real `conf/` tree outside a Hydra app (tests, notebooks, helper scripts); what of a training
config is its recipe (the settings that change the trained weights, grouped over seeds)."""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from care.data.io import json_digest
from care.paths import PROJECT_ROOT

CONF_DIR = PROJECT_ROOT / "conf"


def load_config(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose `conf/<config_name>.yaml` with Hydra overrides, exactly as the CLI would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


#: the keys of conf/roots.yaml: where every app writes and reads what another app wrote
ROOT_KEYS = ("out_root", "cache_root", "data_dir")


def model_config(name: str, app_config: Mapping | None = None) -> dict:
    """conf/model/<name>.yaml composed through Hydra (a `defaults:` list in it is honoured) and resolved under
    the roots of `app_config` (the calling app's out_root / cache_root / data_dir), as a plain dict.  Works
    inside a running Hydra app (its config search path is conf/) and outside one."""
    app_config = app_config or {}
    overrides = [f"model={name}", *(f"{k}='{app_config[k]}'" for k in ROOT_KEYS if app_config.get(k))]
    if GlobalHydra.instance().is_initialized():
        cfg = compose(config_name="evaluate", overrides=overrides)
    else:
        cfg = load_config("evaluate", overrides)
    return OmegaConf.to_container(cfg.model, resolve=True)


# Settings of a training config that do not change the trained weights (where a run writes, how it logs
# and saves): a run may resume with other values (care/training/checkpoint.py), and runs differing only
# in these share a recipe.
# A run's (or an evaluation row's) training seed in its name, `<stem>-s<seed>`: how make care-study names its runs
# and make care-claim its links; the seeds of one stem are one recipe's (care.training.study, care.evaluation).
SEED_NAME = re.compile(r"^(?P<stem>.+)-s(?P<seed>\d+)$")
RUN_SETTINGS = ("trainer.resume", "trainer.resume_unverified", "trainer.max_steps_this_session",
                "trainer.num_workers", "trainer.log_every",
                "trainer.checkpoint_every", "trainer.keep_checkpoints", "validation.batch_size", "wandb",
                "overwrite", "lock_force", *ROOT_KEYS, "cache", "output_dir", "run_name", "experiment_name", "hydra", "data.dir", "data.texts",
                "data.examples")


def without_keys(config: dict, keys: Sequence[str]) -> dict:
    """A copy of a resolved config without the dotted `keys` (absent ones ignored)."""
    c = copy.deepcopy(config)
    for key in keys:
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return c


# Keys newer than run folders already on disk, with the value that keeps the behaviour those runs had: at that
# value a key is left out of a run's config hash (care.training.checkpoint.config_hash) and of its recipe, so a
# run begun before the key existed still resumes, is still recognised as finished, and groups with the runs of
# its recipe recorded before the key existed.  `*` stands for any one key (a CARE stage's name).
NEUTRAL = {
    "trainer.batching": "mixed", "trainer.rule_weights": None,
    # the CARE stage-I study's options (care/training/care_recipe.py), in a stage's block and its loss
    "model.stages.*.query_share": None, "model.stages.*.query_text_max_length": None,
    "model.stages.*.document_text_max_length": None, "model.stages.*.heldout_texts": 0,
    "model.stages.*.loss.score_distill_weight": 0.0, "model.stages.*.loss.score_distill_temperature": None,
    "loss.score_distill_weight": 0.0, "loss.score_distill_temperature": None,
    "model.*.build.pick": "first",
}


def neutral_keys(config) -> list[str]:
    """The dotted keys of NEUTRAL that `config` (a dict or DictConfig) holds at their neutral value."""
    found = []
    for pattern, neutral in NEUTRAL.items():
        nodes = [("", config)]
        for part in pattern.split("."):
            step = []
            for path, node in nodes:
                if not hasattr(node, "keys"):
                    continue
                for key in (list(node.keys()) if part == "*" else [part] if part in node else []):
                    step.append((f"{path}.{key}" if path else str(key), node[key]))
            nodes = step
        found += [path for path, value in nodes if value == neutral and not hasattr(value, "keys")]
    return found


#: Commands a model config's `build_hint` names that have moved since runs were recorded, new -> old: the hint
#: is in the config a run's hash covers, so it is hashed as it read then (a run folder stays valid).
MOVED_COMMANDS = {"python -m care.tools.build_m3 ": "python -m care.models.m3 "}


def recipe(config: dict, ignore: Sequence[str] = ("seed",)) -> dict:
    """A training config's recipe: without the run settings, the keys of NEUTRAL at their neutral value and
    `ignore` (the seed, so that runs of one recipe over several seeds group together: evaluation's comparison,
    wandb's run groups), its model's prompts under the keys they had before `prompts:` was named
    (care.encoders.prompts.legacy_keyed) and its build hint naming commands as they were (MOVED_COMMANDS).
    What a run's config hash covers (care.training.checkpoint), so configs and records from before a key was
    added or renamed keep their hash and their group."""
    from care.encoders.prompts import legacy_keyed  # here: care.config is imported by light command lines

    c = without_keys(config, (*RUN_SETTINGS, *ignore, *neutral_keys(config)))
    if isinstance(c.get("model"), Mapping):
        c["model"] = legacy_keyed(c["model"])
        if isinstance(hint := c["model"].get("build_hint"), str):
            for new, old in MOVED_COMMANDS.items():
                hint = hint.replace(new, old)
            c["model"]["build_hint"] = hint
    return c


def recipe_group(config: dict, ignore: Sequence[str] = ("seed",)) -> str:
    """A short stable name of a recipe (12 hex digits)."""
    return json_digest(recipe(config, ignore), 12, sort_keys=True, default=str)
