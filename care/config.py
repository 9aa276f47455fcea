"""Compose the real `conf/` tree outside a Hydra app (tests, notebooks, helper scripts)."""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from care.paths import PROJECT_ROOT

CONF_DIR = PROJECT_ROOT / "conf"


def load_config(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose `conf/<config_name>.yaml` with Hydra overrides, exactly as the CLI would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


# What a user's input can get wrong (a DataError is a ValueError): one line on stderr, exit status 1.
BAD_INPUT = (FileNotFoundError, ValueError, KeyError, FloatingPointError)


def run_reporting_bad_input(run: Callable[[DictConfig], object], cfg: DictConfig):
    """`run(cfg)` for an app's Hydra main; bad input ends the app with its message and no traceback."""
    try:
        return run(cfg)
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
