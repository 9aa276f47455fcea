"""Compose the real `conf/` tree outside a Hydra app (tests, notebooks, helper scripts)."""
from __future__ import annotations

from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from care.paths import PROJECT_ROOT

CONF_DIR = PROJECT_ROOT / "conf"


def load_config(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose `conf/<config_name>.yaml` with Hydra overrides, exactly as the CLI would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))
