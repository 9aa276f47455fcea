"""Where things live.  Every default path is relative to the project root, so the tools work from any
working directory; each can be moved with an environment variable or a Hydra override."""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def shared_data() -> Path:
    """The read-only real data (`../shared/data` beside the project unless CARE_SHARED_DATA says)."""
    return Path(os.environ.get("CARE_SHARED_DATA", PROJECT_ROOT.parent / "shared" / "data")).resolve()


def cache_dir() -> Path:
    """Built models and embedding caches: git-ignored, never committed (CARE_CACHE moves it)."""
    return Path(os.environ.get("CARE_CACHE", PROJECT_ROOT / ".cache")).resolve()


def outputs_dir() -> Path:
    return Path(os.environ.get("CARE_OUTPUTS", PROJECT_ROOT / "outputs")).resolve()


def register_resolvers() -> None:
    """`${paths:shared_data}` etc. in configs; safe to call twice."""
    table = {
        "root": lambda: str(PROJECT_ROOT),
        "shared_data": lambda: str(shared_data()),
        "cache": lambda: str(cache_dir()),
        "outputs": lambda: str(outputs_dir()),
    }
    if not OmegaConf.has_resolver("paths"):
        OmegaConf.register_new_resolver("paths", lambda key: table[key]())
