"""care-medical: Chinese medical text embeddings (data pipeline, training, evaluation).

Importing the package registers the OmegaConf resolvers the `conf/` tree uses, turns off ONNX Runtime's
telemetry and moves matplotlib's and wandb's caches under the cache root, for this process and the processes
it starts, so nothing is written under the user's home (README "Where outputs and caches go").
"""
import os

# onnxruntime's 1DS telemetry writes a device id to $XDG_CACHE_HOME or ~/.cache/Microsoft/DeveloperTools/
# .onnxruntime when the library is first imported, unless ORT_DISABLE_TELEMETRY=1 (its documented switch) or
# a CI variable (CI=true, GITHUB_ACTIONS, ...) is set: every app imports this package before onnxruntime, so
# the project writes nothing under a user's home.  A value the user set is kept.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from care.paths import cache_dir, register_resolvers

# matplotlib's font cache (~/.cache/matplotlib, on the first plot: training curves, evaluation figures) and
# wandb's debug logs (~/.cache/wandb/logs, an offline run) go under the project's cache root instead, by each
# library's documented variable; a value the user set is kept.
os.environ.setdefault("MPLCONFIGDIR", str(cache_dir() / "matplotlib"))
os.environ.setdefault("WANDB_CACHE_DIR", str(cache_dir() / "wandb"))

register_resolvers()
