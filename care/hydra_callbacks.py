"""Hydra callbacks every app runs (conf/hydra/default.yaml `callbacks:`); imported by Hydra alone.  Each subclasses
Hydra's Callback, so Hydra finds every hook it calls (a plain class made it warn on each run)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from care.errors import _first_line, describe, wants_traceback
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


class RunFolderCheck(Callback):
    """A Hydra callback (conf/hydra/default.yaml `callbacks`): Hydra makes its run (or sweep) folder under
    out_root before the app's body, and so before `app_errors`, runs; a read-only, missing or file-blocked
    out_root would end in Hydra's OSError traceback.  Checked first: the folder holding Hydra's timestamped
    folders is made (as Hydra would) and a probe folder created and removed in it (root ignores permission
    bits, not a read-only mount); an OSError ends the app in one line naming the folder, exit status 1."""

    def on_run_start(self, config, **kwargs) -> None:
        self._check(config, "run")

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config, "sweep")

    def _check(self, config, mode: str) -> None:
        import tempfile

        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)  # `${hydra:job.name}` in the folder resolves (run_job does too)
        folder = Path(str(config.hydra[mode].dir)).parent  # the timestamped folder's parent: made once
        try:
            folder.mkdir(parents=True, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".write-check.", dir=folder))
        except OSError as e:
            if wants_traceback(config):
                raise
            script = Path(sys.argv[0])
            app = f"python -m {script.parent.name}" if script.name == "__main__.py" else script.name
            where = config.get("out_root", folder)
            print(f"{app}: error: cannot write Hydra's {mode} folder under out_root={where}: "
                  f"{describe(e) or _first_line(e)}; choose a writable out_root= (or CARE_OUTPUTS)",
                  file=sys.stderr, flush=True)
            sys.exit(1)
