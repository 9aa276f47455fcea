"""Hydra callbacks every app runs (conf/hydra/default.yaml `callbacks:`); imported by Hydra alone."""
from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from care.paths import follow_cache_root


class FollowCacheRoot(Callback):
    """The job's resolved cache_root (conf/roots.yaml) is the process's cache root while the job runs: it is
    set as CARE_CACHE (care/paths.py follow_cache_root), which cache_dir reads and child processes inherit,
    so what code without the config puts under cache_dir() (the ONNX exports, care/encoders/onnx_backend.py;
    the weights-digest memo, care/models/hub.py) follows a command line's cache_root= as the models and
    embeddings do.  The variable is put back when the job ends (a test may run several apps in one process)."""

    def __init__(self) -> None:
        self.before: list[str | None] = []

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        root = OmegaConf.select(config, "cache_root")
        self.before.append(os.environ.get("CARE_CACHE"))
        if root is not None:
            follow_cache_root(str(root))

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        before = self.before.pop() if self.before else None
        if before is None:
            os.environ.pop("CARE_CACHE", None)
        else:
            os.environ["CARE_CACHE"] = before
