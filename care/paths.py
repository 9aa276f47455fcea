"""Where things live.  Every default path is relative to the project root, so the tools work from any
working directory; each can be moved with an environment variable or a Hydra override."""
from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def shared_data() -> Path:
    """The read-only real data (`../shared/data` beside the project unless CARE_SHARED_DATA says)."""
    return Path(os.environ.get("CARE_SHARED_DATA", PROJECT_ROOT.parent / "shared" / "data")).resolve()


def cache_dir() -> Path:
    """Built models, embedding caches, ONNX exports, the weights-digest memo: git-ignored, never committed.
    CARE_CACHE moves it, and every app sets CARE_CACHE to its resolved cache_root key (conf/roots.yaml:
    follow_cache_root), so a command line's cache_root= moves what code without the config puts here too."""
    return Path(os.environ.get("CARE_CACHE", PROJECT_ROOT / ".cache")).resolve()


def follow_cache_root(root: str | Path) -> None:
    """Make an app's resolved cache_root this process's cache root (and its children's): the Hydra apps at
    job start (care/hydra_callbacks.py), the mteb adapter's command line once it has composed its config."""
    os.environ["CARE_CACHE"] = str(Path(root).expanduser().resolve())


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


# ---- how a written file names a local path ---------------------------------------------------------------
# No file the project writes (a run's care_training.json, a card, summary.json, a stage's stats.json) names
# the machine it was written on (tests/test_no_machine_paths.py): a path is stored relative.
ABSOLUTE = re.compile(r"(?<![\w.:/~-])(?:~/|/)(?:[\w.@+-]+/)*[\w.@+-]+")


def relative_name(path: str | Path, base: str | Path | None = None) -> str:
    """A local path as a written file names it: relative to `base` (the folder the file describes) when
    under it, else from the project's outputs/, .cache/ or shared data folder or the project root, else by
    its last part alone."""
    p = Path(path).expanduser()
    roots = [(Path(base).resolve(), "")] if base is not None else []
    for root, label in [*roots, (outputs_dir(), "outputs"), (cache_dir(), ".cache"), (shared_data(), "shared/data"),
                        (PROJECT_ROOT, "")]:
        try:
            rel = p.resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        return str(Path(label) / rel) if label else str(rel)
    return p.name or "."


def scrub(text: str, base: str | Path | None = None) -> str:
    """`text` (prose: a build hint, a card) with every absolute path in it named as relative_name does."""
    return ABSOLUTE.sub(lambda m: relative_name(m.group(0), base), text)


def portable(value, base: str | Path | None = None):
    """`value` (nested dicts and lists too, their keys included) with every absolute local path, alone or
    inside a sentence, named as relative_name does."""
    if isinstance(value, dict):
        return {portable(k, base): portable(v, base) for k, v in value.items()}  # keys too (a stage's inputs)
    if isinstance(value, (list, tuple)):
        return [portable(v, base) for v in value]
    if isinstance(value, str) and value.startswith(("/", "~/")) and "\n" not in value and " " not in value:
        return relative_name(value, base)
    if isinstance(value, str) and "/" in value:
        return scrub(value, base)
    return value
